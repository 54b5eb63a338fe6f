"""A replica group that spans nodes: its Manager's `Kill` is refused to whoever reaches it.

torchft serves every ManagerService call, `Kill` included (it exits the worker), to anyone
who reaches the Manager, and a group of several nodes must let its other nodes reach it.
So spotctl binds that Manager on loopback and serves the group's address through the same
gRPC filter as the head's Lighthouse, passing only the calls the group's workers make.

Here one replica group of 2 workers as a spanning group's first node has them
(SPOTCTL_FT_REPLICA_NODES=2, its cluster address 127.0.0.2, not loopback), with a real
torchrun, torchft and Lighthouse. The attacker reads the Manager's address where the
group's workers read it (torchft's `manager_addr` in the group's store) and calls `Kill`
there: the connection is closed, no worker restarts, training goes on. Worker 1 calls the
Manager at that same address every step (quorum, commit vote), so the steps it logs show
the filter passes what the group needs.
"""

from __future__ import annotations

import importlib.util
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

from tests.elastic.ft_harness import FtReplicas  # noqa: E402
from tests.security.torchft_attacks import grpc_call, http1, kill_request  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_a_spanning_groups_manager_refuses_kill_and_serves_its_workers(tmp_path: Path) -> None:
    import torch.distributed as dist

    c = FtReplicas(tmp_path, 400, every=1000, delay=0.03, nproc=2)
    try:
        c.start("g0", local_addr="127.0.0.2",
                extra_env={"SPOTCTL_FT_REPLICA_NODES": "2"})
        c.wait("both workers training", lambda: len(c.steps("g0", 1)) >= 5)
        pids = {c.steps("g0", k)[-1]["pid"] for k in (0, 1)}
        env = _environ(c.steps("g0")[-1]["pid"])
        assert env["MASTER_ADDR"] == "127.0.0.2", env.get("MASTER_ADDR")
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                              wait_for_workers=False, timeout=timedelta(seconds=10))
        addr = store.get("manager_addr").decode()
        assert re.fullmatch(r"http://127\.0\.0\.2:\d+", addr), addr

        ans = grpc_call(addr, "/torchft.ManagerService/Kill", kill_request())
        assert ans.closed and not ans.grpc_status, ans
        time.sleep(1.0)
        for pid in pids:  # torchft's Kill exits the worker at once; the filter never passed it
            assert Path(f"/proc/{pid}").exists(), f"worker {pid} was killed"
        assert http1(addr, "GET", "/").status in ("", "403"), "HTTP/1 passed the filter"
        at = c.last_step("g0")
        c.wait("training past the attack", lambda: len(c.steps("g0", 1)) >= 5
               and c.steps("g0", 1)[-1]["step"] >= at + 10)
        time.sleep(0.5)
        assert {c.steps("g0", k)[-1]["pid"] for k in (0, 1)} == pids  # nobody restarted
        assert all(p.poll() is None for p in c.procs.values()), c.output("g0")
        steps1 = [s["step"] for s in c.steps("g0", 1)]
        assert steps1 == list(range(steps1[0], steps1[-1] + 1)), steps1  # none lost
    finally:
        c.stop()
    out = (tmp_path / "g0.out").read_text(errors="replace")
    assert "manager filter: closed a connection from 127.0.0.1: path b'/torchft.ManagerService" \
           "/Kill' is not a method this filter passes" in out, out[-3000:]
