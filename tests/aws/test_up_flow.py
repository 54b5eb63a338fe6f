"""`up -> status -> down` on AWS through the real CLI: moto in server mode for EC2, S3 and
IAM, and a real loopback sshd standing in for every instance (head included).

Test seam (documented in spotctl/remote/bootstrap.py and spotctl/providers/aws/provider.py;
set by tests/conftest.py's CloudFlow): SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT sends every
instance's SSH to the sshd fixture, SPOTCTL_SSH_OVERRIDE_KEY is the key it accepts (moto's
key pair material is not a usable key), SPOTCTL_HEAD_PORTS picks free ports for the head,
SPOTCTL_SSH_REMOTE_ROOT puts the node directories under tmp_path, and SPOTCTL_METADATA_URL
points each agent at its own metadata emulator (AWS IMDSv2) behind tests/conftest.py's
MetadataRouter. The bootstrap, the head (`spotctl head`) and the agents (torchrun + the
train script) really run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import CloudFlow, run_spanning_group_flow, run_torchft_flow

from .conftest import aws_leftovers

pytestmark = [pytest.mark.aws, pytest.mark.slow, pytest.mark.timeout(900)]

NOTHING: dict[str, list[str]] = {
    "instances": [], "security_groups": [], "key_pairs": [], "launch_templates": [],
    "placement_groups": [], "roles": [], "instance_profiles": [],
}  # fmt: skip


def test_up_status_down_on_moto_leaves_nothing(
    aws_flow: Callable[..., CloudFlow], ec2: Any, moto_url: str
) -> None:
    flow = aws_flow("g5.xlarge")
    st = flow.run("aws", nodes=2)
    assert st["world_size"] == 2
    # the instances were real moto instances: 2 spot workers and an on-demand head
    flt = [{"Name": "tag:spotctl:cluster", "Values": [flow.name]}]
    raw = [i for r in ec2.describe_instances(Filters=flt)["Reservations"] for i in r["Instances"]]
    roles = sorted(t["Value"] for i in raw for t in i["Tags"] if t["Key"] == "spotctl:role")
    assert roles == ["head", "worker", "worker"]
    assert aws_leftovers(flow.name, moto_url) == NOTHING
    assert flow.leftover() == []


def test_eight_nodes_up_status_notice_down_on_moto_leave_nothing(
    aws_flow: Callable[..., CloudFlow], moto_url: str
) -> None:
    """Many instances through the whole CLI: `up --gpus 4..8` on 1-GPU g4dn.xlarge (8 spot
    workers and the head, bootstrapped in parallel), status, a spot notice (IMDSv2
    instance-action) for one node, down: nothing is left on the cloud, on this machine, or
    in the state dir. The workers run tests/conftest.py's IDLE_SCRIPT: 8 ranks training on
    this machine's CPUs is not what this checks (the 2-node flow trains for real). 16
    workers at the API: tests/aws/test_scale.py (16 here took 90-107 s of CI)."""
    flow = aws_flow("g4dn.xlarge", script="idle.py")
    out = flow.up_notice_down("aws", "4..8", 8)
    assert out["leaks"] == [] and out["checkpoints"] == "kept", out
    assert aws_leftovers(flow.name, moto_url) == NOTHING
    assert flow.leftover() == []
    assert flow.state_left() == CloudFlow.CLEAN


def test_torchft_engine_on_moto_head_runs_the_lighthouse_agents_use_it(
    aws_flow: Callable[..., CloudFlow], ec2: Any, moto_url: str
) -> None:
    """`[train] engine = "torchft"` on AWS: the head VM's `spotctl head` runs torchft's
    Lighthouse, both nodes' agents are configured with it (the head's private address) and
    their replicas train in one quorum there; down leaves nothing."""
    flow = aws_flow("g5.xlarge")
    out = run_torchft_flow(flow, "aws", nodes=2)
    lighthouse = out["head_json"]["lighthouse"]
    assert lighthouse.startswith("http://127.0.0.1:"), out["head_json"]
    assert out["head"]["lighthouse"] == lighthouse, out["head"]  # recorded in the state dir
    for node, cfg in out["agents"].items():
        assert (cfg["engine"], cfg["lighthouse"]) == ("torchft", lighthouse), (node, cfg)
        assert node in out["lighthouse_status"], out["lighthouse_status"]
    assert aws_leftovers(flow.name, moto_url) == NOTHING
    assert flow.leftover() == []


def test_one_replica_group_spans_two_instances_on_moto(
    aws_flow: Callable[..., CloudFlow], moto_url: str
) -> None:
    """`[train] nodes_per_replica = 2` on AWS: two spot instances make one replica group
    under one torchrun (tests/conftest.py's run_spanning_group_flow says what is checked);
    `down` leaves nothing."""
    flow = aws_flow("g5.xlarge")
    run_spanning_group_flow(flow, "aws")
    assert aws_leftovers(flow.name, moto_url) == NOTHING
    assert flow.leftover() == []
