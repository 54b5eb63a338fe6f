"""`spotctl check`: is this cloud account ready for `up`? The core behind cmd_check.py.

This module owns building a provider for a check (no cluster is created: a placeholder
name, nothing written but the store's directory) and asking it for its checks; the
provider decides what to look at (spotctl/providers/aws/check.py, gcp/check.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from spotctl.control.address import Lookup, public_address, ssh_cidr_line
from spotctl.errors import SpecError
from spotctl.providers import ProviderContext, get_provider
from spotctl.providers.checks import Check, run_check
from spotctl.spec import ClusterSpec

CHECK_CLUSTER = "check"
CLOUDS = ("aws", "gcp")


def check_account(
    provider: str, spec: ClusterSpec, options: dict[str, Any] | None = None,
    lookup: Lookup = public_address,
) -> list[Check]:
    """The provider's checks, in order, then who may SSH to the nodes (`ssh_cidr`, or the
    address `up` would fill it with). Raises SpecError for a provider without any."""
    if provider not in CLOUDS:
        raise SpecError(f"--provider: check knows {' and '.join(CLOUDS)}, not {provider!r}")
    from spotctl.state import Store

    store = Store()
    try:
        ctx = ProviderContext(
            cluster=CHECK_CLUSTER,
            spec=spec,
            cluster_dir=store.cluster_dir(CHECK_CLUSTER),
            options={"first_launch": lambda offers: first_launch(spec, offers),
                     **(options or {})},
        )
        checks: list[Check] = get_provider(provider, ctx).checks()  # type: ignore[attr-defined]
    finally:
        store.close()
    return [*checks, run_check("storage extra", lambda: storage_extra(provider, spec)),
            run_check("ssh_cidr", lambda: ssh_cidr_line(spec, lookup)[1])]


def first_launch(spec: ClusterSpec, offers: list[Any]) -> tuple[Any, int] | None:
    """(offer, count) of the first launch of a new cluster's first plan (what `up` would
    launch first, as `up --dry-run` shows it), None when that plan launches nothing."""
    import time

    from spotctl.control.planner import Observed, plan

    for act in plan(spec, Observed(), offers, {}, time.time()).actions:
        for la in (act.launches if act.type == "move" else (act,)):
            if la.offer is not None and la.count > 0:
                return la.offer, la.count
    return None


DEFAULT_SCHEME = {"aws": "s3", "gcp": "gs"}


def storage_extra(provider: str, spec: ClusterSpec) -> str:
    """The fsspec backend for the checkpoint dir is importable: train.checkpoint_dir's
    scheme, else the cloud's default (a prefix in the cluster's bucket). `up` ships the
    controller's copy to the nodes (spotctl/remote/package.py), so it must be here."""
    root = spec.train.checkpoint_dir
    scheme = root.split("://", 1)[0] if "://" in root else ("" if root else
                                                             DEFAULT_SCHEME[provider])
    from spotctl.remote.package import SCHEME_PACKAGES

    where = root or f"{scheme}:// (the default on {provider})"
    if not SCHEME_PACKAGES.get(scheme):
        return f"checkpoints in {where}: no object-store backend needed"
    module = SCHEME_PACKAGES[scheme][0]
    try:
        importlib.import_module(module)
    except ImportError:
        raise SpecError(f"checkpoints in {where} need {module}, which is not installed here "
                        "(nodes get what the controller has): pip install 'spotctl[storage]'"
                        ) from None
    return f"checkpoints in {where}: {module} installed"


def blocking_failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok and c.blocking]
