"""Issue 57: a plain torchrun script (examples/torchrun-plain/train.py: no spotctl import,
DDP, its own checkpoint) on the default spec (engine unset: torchft) runs as ONE torchrun
job across the nodes, never one copy per node (before: each node printed world 1), and
through a notice, a join and a kill it resumes from its own checkpoint at the new size.
Judged by the script's own records (its step log and its checkpoint file): steps redone
at the notice and the join 0 (it watches SPOTCTL_NOTICE_FILE and saves at the step
boundary), at the kill at most its save interval."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                 reason="torchft is not installed (the default engine's 'ft' extra)")]

SAVE_EVERY = 10
EXAMPLE = REPO / "examples" / "torchrun-plain" / "train.py"


def _records(log: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _steps_at(log: Path, world: int, by: int, timeout: float = 120) -> None:
    """The script logs `by` more steps at `world` than it had when called."""
    def n() -> int:
        return sum(1 for r in _records(log) if "step" in r and r["world"] == world)

    n0 = n()
    wait_until(lambda: n() >= n0 + by, timeout, f"{by} steps at world {world}", 0.5,
               lambda: str(_records(log)[-5:]))


def _redone(log: Path, n0: int, world: int) -> tuple[int, dict[str, Any]]:
    """The first resume at `world` among the records past the first n0: the steps the
    previous group had logged past the step it resumed from (the steps redone)."""
    def find() -> tuple[int, dict[str, Any]] | None:
        recs = _records(log)
        for i in range(n0, len(recs)):
            if recs[i].get("resumed") is not None and recs[i]["world"] == world:
                last = max(r["step"] for r in recs[:i] if "step" in r)
                return last - recs[i]["resumed"], recs[i]
        return None

    return wait_until(find, 120, f"a resume at world {world}", 0.5,
                      lambda: str(_records(log)[-8:]))


def test_plain_script_on_the_default_spec_notice_join_kill(local_cluster):
    c = local_cluster("plain")
    shutil.copy(EXAMPLE, c.project / "train.py")
    log, ckpt = c.tmp / "steps.jsonl", c.tmp / "checkpoint.pt"
    c.write_spec("2..3", engine="", train_env={
        "STEP_LOG": str(log), "CKPT_PATH": str(ckpt), "SAVE_EVERY": str(SAVE_EVERY),
        "SAVE_ON_NOTICE": "1", "STEP_SLEEP_S": "0.05", "SPOTCTL_NOTICE_GRACE_S": "2"})
    up = c.cli("up", "--wait", "120")
    # 1. one torchrun job across the 3 nodes, never one copy per node: every resume and
    # step the script logged is at world 3 (before: three independent copies at world 1)
    _steps_at(log, 3, 10)
    assert {r["world"] for r in _records(log)} == {3}, (
        _records(log)[:3], c.cli("events", "--name", "plain").stdout)
    # recognised at its init_process_group, and said once in up, status and events
    assert "route: plain torchrun script" in up.stderr + up.stdout, up.stderr[-2000:]
    st = c.wait_for("world 3", lambda s: s["world_size"] == 3)
    assert (st["route"], st["engine"]) == ("plain", "torchrun"), st
    routes = c.events("route")
    assert len(routes) == 1 and routes[0]["engine"] == "torchrun", routes
    assert "route: plain torchrun script" in c.cli("status", "--name", "plain").stdout
    assert "not one torchft replica per node" in c.cli("events", "--name", "plain").stdout

    # 2. an AWS-style notice on n1: the script saves at the step boundary, nothing redone
    n0 = len(_records(log))
    r = c.rescale_from(lambda: c.cli("preempt", "n1", "--name", "plain", "--style", "aws"),
                       "notice")
    assert (r["from_world_size"], r["to_world_size"], r["route"]) == (3, 2, "plain"), r
    assert r["notice_to_resume_s"] > 0
    redone, res = _redone(log, n0, 2)
    assert redone == 0, (res, _records(log)[n0:])
    assert any(x.get("saved_on_notice") == res["resumed"] for x in _records(log)[n0:])
    _steps_at(log, 2, 10)

    # 3. a join (`up` replaces n1): the group saves at the step boundary, resumes at 3
    n0 = len(_records(log))
    r = c.rescale_from(lambda: c.cli("up", "--wait", "120"), "join")
    assert (r["from_world_size"], r["to_world_size"]) == (2, 3), r
    redone, res = _redone(log, n0, 3)
    assert redone == 0, (res, _records(log)[n0:])
    _steps_at(log, 3, 10)

    # 4. a hard kill: at most the script's save interval is redone
    n0 = len(_records(log))
    r = c.rescale_from(lambda: c.cli("kill", "n3", "--name", "plain"), "failure")
    assert (r["from_world_size"], r["to_world_size"]) == (3, 2), r
    redone, res = _redone(log, n0, 2)
    assert 0 <= redone <= SAVE_EVERY, (res, _records(log)[n0:])
    _steps_at(log, 2, 5)

    # the script's own checkpoint: a step it logged, saved at its interval or at a notice
    import torch

    saved = int(torch.load(ckpt, map_location="cpu", weights_only=True)["step"])
    recs = _records(log)
    assert saved <= max(x["step"] for x in recs if "step" in x)
    assert saved % SAVE_EVERY == 0 or any(x.get("saved_on_notice") == saved for x in recs)
    # status: world size and restarts; `report` counts the rescales
    st = c.status()
    assert st["world_size"] == 2 and st["restarts"] >= 3, st
    assert len(c.events("rescale")) == st["restarts"]
    assert re.search(rf"pauses \(rescales\)\s+{st['restarts']},",
                     c.cli("report", "--name", "plain").stdout)
