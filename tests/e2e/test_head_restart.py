"""The head dies (SIGKILL): its supervisor restarts it on the same ports. On torchrun the
agents restart torchrun when the store is back, and the job resumes from the last
committed checkpoint; on torchft (issue 17) the head's Lighthouse comes back with it, and
the replicas' managers ask it again and go on from memory."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.conftest import ENGINES

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("engine", ENGINES)
def test_head_killed_is_restarted_and_job_resumes(local_cluster, engine):
    c = local_cluster("headr")
    c.write_spec("2", checkpoint_every=10, engine=engine)
    c.cli("up", "--wait", "120")
    before = c.steps_advance(world=2, by=15, timeout=150)
    head_json = c.cluster_dir / "head" / "head.json"
    old = json.loads(head_json.read_text())
    os.kill(old["pid"], signal.SIGKILL)
    after = c.wait_for("the job to resume under a new head",
                       lambda s: s["world_size"] == 2 and s["step"] > before["last_checkpoint_step"] + 5
                       and json.loads(head_json.read_text())["pid"] != old["pid"], timeout=150)
    new = json.loads(head_json.read_text())
    assert new["url"] == old["url"] and new["store_port"] == old["store_port"]
    assert new.get("lighthouse") == old.get("lighthouse")  # torchft: same address; else none
    assert bool(new.get("lighthouse")) == (engine == "torchft"), new
    starts = c.events("train-start")
    assert starts[-1]["resume_step"] >= before["last_checkpoint_step"], c.events()[-12:]
    # torchft: the new head found the replicas training from memory (their quorum's first
    # step before it started), taken up at the step it saw; torchrun restarted them
    assert bool(starts[-1].get("adopted")) == (engine == "torchft"), starts
    assert any(e["type"] == "head-restart" for e in c.events())
    assert after["last_checkpoint_step"] >= before["last_checkpoint_step"]
