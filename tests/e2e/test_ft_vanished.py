"""A replica that vanishes mid-step on the torchft engine (its worker frozen inside a
quorum, before its collectives: no socket closed, no heartbeat sent, as a VM that is gone)
with a cross-replica timeout of 120 s, long enough for a GPU's first compiled step or a
heal: the survivor's collective is given up once the frozen replica's heartbeats stop
(spotctl.elastic.ftwatch), in seconds, and it trains on alone, judged by its own step log
(its pid, every step once, the time between steps); then the frozen worker is killed and
its node's new worker heals back in."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import node_steps, up_ft_train, wait_until

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
FREEZE_AT = 30


def test_a_replica_gone_mid_step_is_found_by_its_heartbeats(local_cluster):
    c = local_cluster("ftv")
    logs = up_ft_train(c, 2, together=False, SPOTCTL_FT_TIMEOUT_S="120",
                       FT_FREEZE=f"n2:{FREEZE_AT}")
    frozen = wait_until(lambda: _stopped(c.worker_pids(["n2"])["n2"]), 240,
                        "n2's worker to freeze itself at its step 30", 0.5, c.debug)
    assert max(s["step"] for s in node_steps(logs, "n2")) == FREEZE_AT - 1
    # n1 was in the same quorum: its step 30 waited for n2's gradients
    wait_until(lambda: any(s["replicas"] == 1 for s in node_steps(logs, "n1")), 100,
               "n1 training alone", 0.5, c.debug)
    n1 = node_steps(logs, "n1")
    steps = [s["step"] for s in n1]
    assert steps == list(range(1, len(steps) + 1)), steps  # every step once, none lost
    assert len({s["pid"] for s in n1}) == 1, "n1's worker restarted"
    before = next(s for s in n1 if s["step"] == FREEZE_AT - 1)
    alone = next(s for s in n1 if s["replicas"] == 1)
    assert alone["step"] == FREEZE_AT, (before, alone)
    # the pause: the heartbeat's staleness (2 s) and the watch's polls, not the 120 s
    # timeout (a generous bound for a loaded 2-core machine)
    assert alone["t"] - before["t"] < 30, alone["t"] - before["t"]
    os.kill(frozen, signal.SIGKILL)
    wait_until(lambda: node_steps(logs, "n1")[-1]["replicas"] == 2, 240,
               "n2's new worker healed back in", 0.5, c.debug)
    c.cli("down", "--name", "ftv", "--yes")


def _stopped(pid: int) -> int | None:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return pid if state == "T" else None
