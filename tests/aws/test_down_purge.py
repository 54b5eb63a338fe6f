"""`spotctl down` keeps a cluster's checkpoints; `down --purge` deletes the objects under
its prefix (and nothing under any other prefix), and says how many. The CLI runs in this
process (tests/conftest.py's cli_main: real flag parsing and error mapping) against moto in
server mode; the cluster is made by the provider itself (bucket, role, one worker).
The full `up -> status -> down` path over SSH is tests/aws/test_up_flow.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec
from spotctl.state import Store
from tests.conftest import cli_main as spotctl

from .conftest import REGION

pytestmark = pytest.mark.aws

BUCKET = f"spotctl-123456789012-{REGION}"  # moto's account id


def keys(s3: Any, prefix: str) -> list[str]:
    page = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in page.get("Contents", []))


def test_down_keeps_checkpoints_and_purge_deletes_only_this_clusters_prefix(
    make_provider: Callable[..., AwsProvider], moto_url: str, ec2: Any, home: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto_url)
    p = make_provider()
    name = p.ctx.cluster
    offer = Offer(provider="aws", region=REGION, zone=f"{REGION}a", instance_type="g4dn.xlarge",
                  gpus=1, gpu_name="T4", spot_price=0.2, on_demand_price=0.5)  # fmt: skip
    [inst] = p.launch(offer, 1, "purge")  # prepares the bucket, role and profile first
    Store().upsert_cluster(name, "aws", p.ctx.spec.model_dump(mode="json"), "running")
    mine = [f"{name}/checkpoints/step-10/COMMIT", f"{name}/checkpoints/step-10/__0_0.distcp",
            f"{name}/checkpoints/step-20/__0_0.distcp"]  # fmt: skip
    # neighbours: a cluster whose name starts with this one's, and an unrelated one
    others = [f"{name}-2/checkpoints/step-5/COMMIT", "other/checkpoints/step-1/COMMIT"]
    for k in mine + others:
        s3.put_object(Bucket=BUCKET, Key=k, Body=b"x")

    code, out, err = spotctl(capsys, "down", "--name", name, "--yes")
    assert code == 0, err
    assert out.strip() == (f"cluster {name} is down; checkpoints kept "
                           "(`spotctl down --purge` deletes them)")  # fmt: skip
    assert keys(s3, f"{name}/") == sorted(mine)  # kept
    state = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    assert state["State"]["Name"] == "terminated"

    # later: the same (already down) cluster, purged
    code, out, err = spotctl(capsys, "down", "--name", name, "--yes", "--purge", "--json")
    assert code == 0, err
    assert json.loads(out) == {"cluster": name, "leaks": [], "checkpoints": "deleted",
                               "purged": 3}  # fmt: skip
    assert keys(s3, f"{name}/") == []
    assert [k for k in others if keys(s3, k)] == others  # only this cluster's prefix went
    downs = [e for e in Store().events(name) if e["type"] == "down"]
    assert "purged" not in downs[0] and downs[-1]["purged"] == 3  # the journal says so too


def test_purge_without_a_checkpoint_store_is_refused_before_anything_stops(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint directory the user named (train.checkpoint_dir) is theirs, not
    spotctl's: `down --purge` is one line, exit 2, and the cluster is left as it was (not
    marked down). (A local cluster's own checkpoints, in its directory, are purged:
    tests/e2e/test_cli_no_name.py.)"""
    spec = ClusterSpec.model_validate({"name": "loc", "provider": "local",
                                       "train": {"checkpoint_dir": str(home / "mine")}})
    Store().upsert_cluster("loc", "local", spec.model_dump(mode="json"), "running")
    code, out, err = spotctl(capsys, "down", "--name", "loc", "--yes", "--purge")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: --purge: the local provider keeps no checkpoint store of its own to delete "
        "(train.checkpoint_dir is yours to remove)"
    ]
    assert Store().get_cluster("loc").state == "running"
