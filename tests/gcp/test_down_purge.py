"""`spotctl down` / `down --purge` on GCP through the CLI (tests/conftest.py's cli_main)
against the fake Compute + Storage + IAM server: the checkpoints under the cluster's
gs:// prefix stay on `down`, and `--purge` deletes them (no other prefix), with the count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.providers.gcp.provider import GcpProvider
from spotctl.state import Store
from tests.conftest import cli_main as spotctl

from .conftest import PROJECT, make_ctx
from .fake_compute import FakeCompute

pytestmark = pytest.mark.gcp

BUCKET = f"spotctl-{PROJECT}-us-central1"


def _put(fake: FakeCompute, name: str) -> None:
    code, _, out = fake.storage.handle(
        "POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name}",
        {"Content-Type": "application/octet-stream"}, b"x",
    )  # fmt: skip
    assert code == 200, out


def test_down_keeps_checkpoints_and_purge_deletes_only_this_clusters_prefix(
    fake: FakeCompute, spotctl_home: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("SPOTCTL_GCP_ENDPOINT", fake.endpoint)
    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()  # bucket, service account, bindings
    Store().upsert_cluster("demo", "gcp", p.ctx.spec.model_dump(mode="json"), "running")
    mine = [f"demo/checkpoints/step-0000001{i}/x" for i in range(3)]
    others = ["demo-2/checkpoints/keep", "other/keep"]
    for k in mine + others:
        _put(fake, k)

    code, out, err = spotctl(capsys, "down", "--name", "demo", "--yes")
    assert code == 0, err
    assert out.strip() == "cluster demo is down; checkpoints kept (`spotctl down --purge` deletes them)"
    assert sorted(fake.storage.objects[BUCKET]) == sorted(mine + others)

    code, out, err = spotctl(capsys, "down", "--name", "demo", "--yes", "--purge", "--json")
    assert code == 0, err
    assert json.loads(out) == {"cluster": "demo", "leaks": [], "checkpoints": "deleted",
                               "purged": 3}  # fmt: skip
    assert sorted(fake.storage.objects[BUCKET]) == others
