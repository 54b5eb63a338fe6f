"""The head replaces a lost worker by itself ([rebalance] on_head), with nothing running on
the controller: moto for EC2 and IAM, the loopback sshd for every instance, the head's
credentials from its own metadata service (the role `up` made for it, through STS).

The controller runs `up`, then nothing until `down`: a worker gets a spot notice (IMDSv2),
leaves, and is terminated as EC2 would at the end of its two minutes; the head's reconcile
loop launches the replacement into moto and bootstraps it over SSH, and training goes on.
What is judged: the workers' own step records (the template's sample trace), the
instances in moto, the head's metadata service (its role's credentials were read), and
what the controller's own journal holds (it launched nothing after `up`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CloudFlow, kill_procs_mentioning, wait_until

from .conftest import HEAD_METADATA, aws_leftovers

pytestmark = [pytest.mark.aws, pytest.mark.slow, pytest.mark.timeout(900)]


def _records(trace: Path) -> list[tuple[str, int, int]]:
    """(incarnation, dp_rank, step) of every step every worker recorded."""
    out = []
    for f in sorted(trace.glob("*.txt")):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def test_the_head_replaces_a_preempted_worker_with_its_own_role(
    aws_flow: Callable[..., CloudFlow], moto_url: str, ec2: Any, tmp_path: Path,
    metadata_router: Any,
) -> None:  # fmt: skip
    trace = tmp_path / "trace"
    trace.mkdir()
    flow = aws_flow("g5.xlarge", env={"SPOTCTL_TRACE_SAMPLES": str(trace),
                                      "TRAIN_DATASET_SIZE": "100000"})
    spec = flow.project / "spotctl.toml"
    spec.write_text(spec.read_text() + "\n[rebalance]\non_head_interval_s = 5\n")
    up = flow.up("aws", "2", 2)
    first = sorted(up["launched"])
    flow.wait_for("2 workers training", lambda s: s.get("world_size") == 2
                  and (s.get("step") or 0) >= 5, timeout=240, interval=1)  # fmt: skip
    journal_after_up = len(flow.events())

    victim = first[0]
    flow.metadata.node(victim).preempt("aws", in_s=120)
    flow.wait_for("the notice's leave", lambda s: victim not in
                  [n["id"] for n in s["nodes"] if n["state"] in ("running", "joining")],
                  timeout=120)  # fmt: skip
    step_at_leave = max(s for _, _, s in _records(trace))
    # EC2 ends the instance at the end of its notice: the VM and what ran on it go
    ec2.terminate_instances(InstanceIds=[victim])
    kill_procs_mentioning(flow.remote / flow.name / victim)

    def replaced(s: dict[str, Any]) -> bool:
        ids = {n["id"] for n in s["nodes"] if n["state"] == "running"}
        return len(ids) == 2 and victim not in ids and s.get("world_size") == 2

    st = flow.wait_for("a replacement the head launched, training", replaced, timeout=300,
                       interval=2)
    [new] = sorted({n["id"] for n in st["nodes"]} - set(first))
    # the workers' own records: both ranks of the new world step on past the leave
    wait_until(lambda: max(s for _, _, s in _records(trace)) >= step_at_leave + 10, 120,
               "steps after the replacement joined", 1)  # fmt: skip
    recs = _records(trace)
    last = max(recs, key=lambda r: r[2])[0]  # the incarnation of the latest step
    assert {r for i, r, s in recs if i == last and s > step_at_leave} == {0, 1}, recs[-10:]
    steps = {s for _, _, s in recs}
    assert steps == set(range(1, max(steps) + 1)), "a step was never trained"

    # the instance is real in moto, a spot worker of this cluster with the workers' role
    raw = ec2.describe_instances(InstanceIds=[new])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags["spotctl:cluster"] == flow.name and tags["spotctl:role"] == "worker", tags
    assert raw["IamInstanceProfile"]["Arn"].endswith(f"spotctl-{flow.name}-node"), raw
    # the head's loop did it, with the head role's credentials from its metadata service
    creds = metadata_router.node(HEAD_METADATA).requests
    assert any(p.startswith(f"/latest/meta-data/iam/security-credentials/spotctl-{flow.name}")
               for p in creds), creds
    log = next(flow.remote.glob(f"{flow.name}/head/head/rebalance.log")).read_text()
    assert '"type": "replace"' in log or '"type": "launch"' in log, log[-3000:]
    assert new in log, log[-3000:]
    # and not the controller: its journal has no launch after `up`
    later = flow.events()[journal_after_up:]
    assert not [e for e in later if e["type"] in ("launch", "plan-launch", "plan-replace")], later
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
