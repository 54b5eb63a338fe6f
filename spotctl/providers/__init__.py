"""Providers, imported lazily by name so a missing cloud SDK never breaks another cloud."""

from __future__ import annotations

import importlib
from typing import Any

from spotctl.errors import SpecError
from spotctl.providers.base import HeadInfo, Instance, Offer, Provider, ProviderContext

__all__ = ["HeadInfo", "Instance", "Offer", "Provider", "ProviderContext", "get_provider"]

KNOWN = ("local", "aws", "gcp", "ssh")


def network_of(spec: Any, offer: Offer) -> str:
    """The network a node launched from `offer` gets, in a few words (`up --dry-run`)."""
    fast = bool(spec.placement.fast_network)
    if offer.provider == "aws":
        from spotctl.providers.aws import efa

        return efa.describe(offer.instance_type, fast)
    if offer.provider == "gcp":
        from spotctl.providers.gcp import placement

        return placement.describe(offer.instance_type, offer.gpus, fast)
    if offer.provider == "local":
        return "loopback (a process tree on this machine)"
    return "the host's own network"


def get_provider(name: str, ctx: ProviderContext) -> Any:
    """Return the provider `name` for this cluster. Each module exposes `create(ctx)`."""
    if name not in KNOWN:
        raise SpecError(f"provider: unknown provider {name!r} (choose from {', '.join(KNOWN)})")
    try:
        mod = importlib.import_module(f"spotctl.providers.{name}.provider")
    except ImportError as e:
        extra = {"aws": "aws", "gcp": "gcp", "local": "train"}.get(name, "")
        hint = f"; install spotctl[{extra}]" if extra else ""
        raise SpecError(f"provider {name!r} is not available: {e}{hint}") from None
    return mod.create(ctx)
