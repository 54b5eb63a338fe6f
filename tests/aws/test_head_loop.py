"""The head replaces a lost worker by itself ([rebalance] on_head), with nothing running on
the controller: moto for EC2 and IAM, the loopback sshd for every instance, the head's
credentials from its own metadata service (the role `up` made for it, through STS).

tests/conftest.py's run_head_replacement_flow: `up`, a spot notice (IMDSv2) for one
worker, which leaves and is terminated as EC2 would at the end of its two minutes; the
head's loop launches the replacement into moto and bootstraps it over SSH; judged by the
workers' own step records and the controller's journal. Here also: the instance in moto,
the head's metadata service (its role's credentials were read), and a `rebalance` by hand
(which pauses the head's loop)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CloudFlow, run_head_replacement_flow

from .conftest import HEAD_METADATA, aws_leftovers

pytestmark = [pytest.mark.aws, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_head_replaces_a_preempted_worker_with_its_own_role(
    aws_flow: Callable[..., CloudFlow], moto_url: str, ec2: Any, tmp_path: Path,
    metadata_router: Any,
) -> None:  # fmt: skip
    trace = tmp_path / "trace"
    trace.mkdir()
    flow = aws_flow("g5.xlarge", env={"SPOTCTL_TRACE_SAMPLES": str(trace),
                                      "TRAIN_DATASET_SIZE": "100000"})
    ids = run_head_replacement_flow(
        flow, "aws", trace, lambda vm: ec2.terminate_instances(InstanceIds=[vm]))
    new = ids["new"]
    # the instance is real in moto, a spot worker of this cluster with the workers' role
    raw = ec2.describe_instances(InstanceIds=[new])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags["spotctl:cluster"] == flow.name and tags["spotctl:role"] == "worker", tags
    assert raw["IamInstanceProfile"]["Arn"].endswith(f"spotctl-{flow.name}-node"), raw
    # the head's loop did it, with the head role's credentials from its metadata service
    creds = metadata_router.node(HEAD_METADATA).requests
    assert any(p.startswith(f"/latest/meta-data/iam/security-credentials/spotctl-{flow.name}")
               for p in creds), creds
    # the controller's journal has the head's replacement from the cloud's list
    assert new in {n["id"] for n in flow.status()["nodes"]}
    # a `rebalance` by hand pauses the head's loop while it acts, and resumes it
    agent_log = next(flow.remote.glob(f"{flow.name}/head/agent.log"))
    before = agent_log.read_text().count("reconcile loop resumed")
    out = json.loads(flow.cli("rebalance", "--name", flow.name, "--json").stdout)
    assert out["actions"] == [] and out["launched"] == [], out
    text = agent_log.read_text()
    assert text.count("reconcile loop resumed") == before + 1, text[-2000:]

    out = flow.down()
    assert out["leaks"] == [], out
    assert all(not v for v in aws_leftovers(flow.name, moto_url).values())
