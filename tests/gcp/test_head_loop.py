"""The GCP head replaces a lost worker by itself ([rebalance] on_head), with nothing
running on the controller: the fake Compute API for the VMs, the loopback sshd for every
VM. The controller runs `up`, then nothing until `down`: a worker is preempted (its
metadata says so, then GCP deletes it), the head's reconcile loop inserts the replacement
and bootstraps it over SSH, and training goes on. Judged by the workers' own step records
(the template's sample trace), the fake's VMs and requests, and the controller's own
journal (it launched nothing after `up`). Under the seam the head's loop reaches the fake
anonymously, like the controller: the head's account and its scope are
tests/gcp/test_head_identity.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.aws.test_head_loop import _records
from tests.conftest import CloudFlow, kill_procs_mentioning, wait_until

from .conftest import GCP_NOTHING, gcp_leftovers

pytestmark = [pytest.mark.gcp, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_gcp_head_replaces_a_preempted_worker(
    gcp_flow: Callable[..., CloudFlow], fake: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    flow = gcp_flow("g2-standard-4", env={"SPOTCTL_TRACE_SAMPLES": str(trace),
                                          "TRAIN_DATASET_SIZE": "100000"})
    spec = flow.project / "spotctl.toml"
    spec.write_text(spec.read_text() + "\n[rebalance]\non_head_interval_s = 5\n")
    up = flow.up("gcp", "2", 2)
    first = sorted(up["launched"])
    flow.wait_for("2 workers training", lambda s: s.get("world_size") == 2
                  and (s.get("step") or 0) >= 5, timeout=240, interval=1)  # fmt: skip
    journal_after_up = len(flow.events())
    inserts_after_up = len(fake.calls("instances.insert"))

    victim = first[0]
    flow.metadata.node(victim).preempt("gcp")
    flow.wait_for("the notice's leave", lambda s: victim not in
                  [n["id"] for n in s["nodes"] if n["state"] in ("running", "joining")],
                  timeout=120)  # fmt: skip
    step_at_leave = max(s for _, _, s in _records(trace))
    # GCP deletes the preempted VM (instance_termination_action=DELETE): it and what ran
    # on it end
    [key] = [k for k in fake.instances if k[1] == victim]
    del fake.instances[key]
    kill_procs_mentioning(flow.remote / flow.name / victim)

    def replaced(s: dict[str, Any]) -> bool:
        ids = {n["id"] for n in s["nodes"] if n["state"] == "running"}
        return len(ids) == 2 and victim not in ids and s.get("world_size") == 2

    st = flow.wait_for("a replacement the head launched, training", replaced, timeout=300,
                       interval=2)
    [new] = sorted({n["id"] for n in st["nodes"] if n["state"] == "running"} - set(first))
    wait_until(lambda: max(s for _, _, s in _records(trace)) >= step_at_leave + 10, 120,
               "steps after the replacement joined", 1)  # fmt: skip
    recs = _records(trace)
    last = max(recs, key=lambda r: r[2])[0]
    assert {r for i, r, s in recs if i == last and s > step_at_leave} == {0, 1}, recs[-10:]
    steps = {s for _, _, s in recs}
    assert steps == set(range(1, max(steps) + 1)), "a step was never trained"
    # the replacement is a spot worker of this cluster, running as the workers' account
    [ins] = [c for c in fake.calls("instances.insert")[inserts_after_up:]
             if c.body["name"] == new]
    assert ins.body["labels"]["spotctl-role"] == "worker", ins.body["labels"]
    assert ins.body["serviceAccounts"][0]["email"].startswith("spotctl-"), ins.body
    log = next(flow.remote.glob(f"{flow.name}/head/head/rebalance.log")).read_text()
    assert new in log, log[-3000:]
    later = flow.events()[journal_after_up:]
    assert not [e for e in later if e["type"] in ("launch", "plan-launch", "plan-replace")], later

    out = flow.down()
    assert out["leaks"] == [], out
    assert gcp_leftovers(fake) == GCP_NOTHING
