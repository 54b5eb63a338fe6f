"""Issue 2: a local cluster end to end (real CLI, torchrun, gloo), hard failure included;
on both engines (issue 17)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import ENGINES

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.parametrize("engine", ENGINES)
def test_up_kill_continue_down(local_cluster, engine):
    c = local_cluster("e2e2")
    c.write_spec("2..3", checkpoint_every=10, engine=engine)
    c.cli("up", "--wait", "120")
    st = c.steps_advance(world=3, by=10, timeout=180)
    assert {n["id"] for n in st["nodes"]} == {"n1", "n2", "n3"}
    assert all(n["state"] == "running" for n in st["nodes"])
    assert st["provider"] == "local" and st["cost_per_hour"] == 0.0
    assert all({"id", "state", "zone", "instance_type", "gpus", "step", "heartbeat_age_s"} <= n.keys()
               for n in st["nodes"])

    pids_before = c.processes()
    # picked by reason: on torchft the start-up quorum's growth is rescale events too
    r = c.rescale_from(lambda: c.cli("kill", "n2", "--name", "e2e2"), "failure")
    st = c.steps_advance(world=2, by=10, timeout=180)
    n2 = next(n for n in st["nodes"] if n["id"] == "n2")
    assert n2["state"] == "lost"
    assert (r["from_world_size"], r["to_world_size"]) == (3, 2)
    assert r["engine"] == engine
    # a hard kill loses at most the steps since the last committed checkpoint
    assert 0 <= r["lost_steps"] <= 10 + 1

    assert len(pids_before) > 6  # head + 3 x (vm, agent, torchrun, worker)
    c.cli("down", "--name", "e2e2", "--yes")
    time.sleep(0.5)
    assert c.processes() == []
    assert any(e["type"] == "down" for e in c.events())
    # down of an unknown cluster says so in one line and fails with "not found" (3)
    p = c.cli("down", "--name", "nosuch", "--yes", check=False)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == ["error: no cluster named 'nosuch' (see `spotctl list`)"]
