"""GCP fixtures: a fake Compute REST server and a provider pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.providers.base import ProviderContext
from spotctl.spec import ClusterSpec
from spotctl.state import ClusterDir

from .fake_compute import FakeCompute

PROJECT = "test-proj"
CIDR = "203.0.113.7/32"


@pytest.fixture
def fake() -> Iterator[FakeCompute]:
    with FakeCompute() as f:
        yield f


# `spotctl_home` (a fresh SPOTCTL_HOME, SPOTCTL_GCP_ENDPOINT unset) is tests/conftest.py's.


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
