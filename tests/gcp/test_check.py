"""`spotctl check --provider gcp` against the fake Compute API."""

from __future__ import annotations

import pytest

from spotctl.providers.gcp.provider import GcpProvider

from .conftest import PROJECT, make_ctx

pytestmark = pytest.mark.gcp


def _checks(p: GcpProvider) -> dict[str, object]:
    return {c.name: c for c in p.checks()}


def test_new_project_without_spot_gpu_quota_is_blocked_with_the_metric(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="T4"))
    checks = {c.name: c for c in p.checks()}
    assert list(checks) == ["credentials", "region", "spot GPU quota", "network",
                            "image (workers)", "image (head)", "checkpoint bucket"]  # fmt: skip
    assert checks["credentials"].ok and PROJECT in checks["credentials"].detail
    assert checks["region"].ok and "4 zones" in checks["region"].detail
    q = checks["spot GPU quota"]
    assert not q.ok and q.blocking and "PREEMPTIBLE_NVIDIA_T4_GPUS 0 (1 needed)" in q.detail
    assert checks["network"].ok
    assert checks["image (workers)"].ok and "disk >= 50 GB" in checks["image (workers)"].detail
    assert checks["image (head)"].ok and "debian-12" in checks["image (head)"].detail
    fake.region_quotas["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 8
    assert {c.name: c for c in p.checks()}["spot GPU quota"].ok


def test_missing_network_image_and_region_each_fail_their_line(fake, spotctl_home):
    fake.networks.clear()
    p = GcpProvider(make_ctx(fake, spotctl_home, image="projects/nope/global/images/family/x"))
    checks = {c.name: c for c in p.checks()}
    assert not checks["network"].ok and "gcloud compute networks create" in checks["network"].detail
    assert not checks["image (workers)"].ok and "gcp.image" in checks["image (workers)"].detail
    bad_region = GcpProvider(make_ctx(fake, spotctl_home, region="nowhere"))
    r = {c.name: c for c in bad_region.checks()}["region"]
    assert not r.ok and "gcp.region" in r.detail and "\n" not in r.detail
