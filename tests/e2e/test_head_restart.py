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
    nodes = sorted(n["id"] for n in c.status()["nodes"] if n["state"] == "running")
    pids = c.worker_pids(nodes)
    head_json = c.cluster_dir / "head" / "head.json"
    old = json.loads(head_json.read_text())
    os.kill(old["pid"], signal.SIGKILL)

    def started_again() -> bool:
        """The new head recorded a training start after its restart: until then the
        status can show the old workers' steps (torchrun's restart comes when its store
        call fails), so world size and step alone do not say the job resumed."""
        evs = c.events()
        restart = next((i for i, e in enumerate(evs) if e["type"] == "head-restart"), None)
        return restart is not None and any(e["type"] == "train-start" for e in evs[restart:])

    after = c.wait_for("the job to resume under a new head",
                       lambda s: json.loads(head_json.read_text())["pid"] != old["pid"]
                       and started_again() and s["world_size"] == 2
                       and s["step"] > before["last_checkpoint_step"] + 5, timeout=150)
    new = json.loads(head_json.read_text())
    assert new["url"] == old["url"] and new["store_port"] == old["store_port"]
    assert new.get("lighthouse") == old.get("lighthouse")  # torchft: same address; else none
    assert bool(new.get("lighthouse")) == (engine == "torchft"), new
    evs = c.events()
    restart = next(i for i, e in enumerate(evs) if e["type"] == "head-restart")
    starts = [e for e in evs[restart:] if e["type"] == "train-start"]
    assert starts and starts[0]["resume_step"] >= before["last_checkpoint_step"], evs[-12:]
    if engine == "torchft":
        # the replicas' own reports: the same worker processes went on from memory
        assert c.worker_pids(nodes) == pids, "a replica's worker restarted"
        # the new head found them training (their quorum's first step before it started),
        # taken up at the step it saw; or, on a loaded machine, one replica asked the
        # restarted Lighthouse first and went on alone, and the other joined it again
        first = starts[0]
        assert first.get("adopted") or (
            first["world_size"] < 2 and any(e["type"] == "rescale" and e["to_world_size"] == 2
                                            for e in evs[restart:])), evs[restart:]
    else:  # torchrun restarted them from the checkpoint
        assert not any(e.get("adopted") for e in starts), starts
        assert c.worker_pids(nodes) != pids
    assert after["last_checkpoint_step"] >= before["last_checkpoint_step"]
