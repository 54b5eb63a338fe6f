"""GCP fixtures: a fake Compute REST server and a provider pointed at it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.providers.base import ProviderContext
from spotctl.spec import ClusterSpec
from spotctl.state import ClusterDir
from tests.conftest import CloudFlow, cloud_spec_text

from .fake_compute import FakeCompute

PROJECT = "test-proj"
CIDR = "203.0.113.7/32"


@pytest.fixture
def fake() -> Iterator[FakeCompute]:
    with FakeCompute() as f:
        yield f


# `spotctl_home` (a fresh SPOTCTL_HOME, SPOTCTL_GCP_ENDPOINT unset) is tests/conftest.py's.


def gcp_leftovers(fake: FakeCompute) -> dict[str, list[str]]:
    """What is left on the fake (one per test): VMs, firewall rules, placement policies,
    service accounts, and bucket IAM bindings naming a service account. Empty lists:
    nothing left."""
    return {
        "instances": [f"{z}/{n}" for z, n in fake.instances],
        "firewalls": sorted(fake.firewalls),
        "resource_policies": sorted(n for _r, n in fake.policies),
        "service_accounts": sorted(fake.storage.service_accounts),
        "bucket_bindings": [f"{b}: {m}" for b, pol in fake.storage.policies.items()
                            for bd in pol.get("bindings", []) for m in bd.get("members", [])
                            if m.startswith("serviceAccount:")],
        # the project's and service accounts' IAM bindings naming a service account
        "iam_bindings": [f"{r}: {m}" for r, pol in fake.storage.iam_policies.items()
                         for bd in pol.get("bindings", []) for m in bd.get("members", [])
                         if m.startswith("serviceAccount:")],
    }  # fmt: skip


GCP_NOTHING: dict[str, list[str]] = {
    "instances": [], "firewalls": [], "resource_policies": [], "service_accounts": [],
    "bucket_bindings": [], "iam_bindings": [],
}  # fmt: skip


@pytest.fixture
def gcp_flow(cloud_flow: Callable[..., CloudFlow], fake: FakeCompute) -> Callable[..., CloudFlow]:
    """gcp_flow(machine_type, **spec) -> a CloudFlow (tests/conftest.py) of a fresh cluster on
    the fake Compute API, its VMs reached through the loopback sshd."""

    def make(machine_type: str = "g2-standard-4", zone: str = "us-central1-a",
             **spec: Any) -> CloudFlow:  # fmt: skip
        name = f"flow{uuid.uuid4().hex[:8]}"
        section = (
            f'[gcp]\nproject = "{PROJECT}"\nregion = "us-central1"\nzones = ["{zone}"]\n'
            f'machine_types = ["{machine_type}"]\nssh_cidr = "127.0.0.1/32"\n'
        )
        return cloud_flow(name, cloud_spec_text(name, section, **spec),
                          {"SPOTCTL_GCP_ENDPOINT": fake.endpoint})  # fmt: skip

    return make


def make_ctx(fake: FakeCompute, home: Path, cluster: str = "demo", **gcp: Any) -> ProviderContext:
    settings: dict[str, Any] = {
        "project": PROJECT,
        "region": "us-central1",
        "ssh_cidr": CIDR,
    }
    settings.update(gcp)
    spec = ClusterSpec.model_validate({"name": cluster, "provider": "gcp", "gcp": settings})
    cdir = ClusterDir(home, cluster).ensure()
    return ProviderContext(
        cluster=cluster,
        spec=spec,
        cluster_dir=cdir,
        options={
            "gcp_endpoint": fake.endpoint,
            "gcp_backoff_base": 0.01,
            "gcp_backoff_max": 0.05,
            "gcp_poll_interval": 0.01,
            "gcp_op_timeout": 30,
            # these fake VMs have no SSH (tests/gcp/test_up_flow.py has one)
            "head_process": False,
        },
    )


@pytest.fixture
def provider(fake: FakeCompute, spotctl_home: Path) -> Any:
    from spotctl.providers import get_provider

    return get_provider("gcp", make_ctx(fake, spotctl_home))
