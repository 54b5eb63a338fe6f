"""Baseline: plain torchrun agents on this machine, no spotctl anywhere.

N agents (`python -m torch.distributed.run`, c10d rendezvous, default rendezvous
settings) run train_plain.py. The rendezvous store is a TCPStore in this process, like
spotctl's head hosts it; the agents find the port taken and join as clients. Each cycle
SIGKILLs one agent's whole process tree (a node lost with no notice handling: plain
torchrun has none, so a graceful notice ends the same way at its deadline), times the
survivors' first step at N-1 from the step log, then starts a new agent and times the
join (torchrun restarts every worker on a join, without a checkpoint).

Two settings differ from torch's defaults, both needed for elasticity at all:
- `--max-restarts`: the default 0 makes the first failure end the job;
- TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the shared rendezvous/worker store the
  re-formed round waits for the dead node's keys, times out after 60 s and every agent
  exits (measured here with torch 2.13: no recovery at all).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import steplog
from .core import LIB, Context

STEP_SLEEP_S = "0.05"
# Smoke tests only (tests/bench): rendezvous settings for the baseline's agents, e.g.
# "last_call_timeout=1", so a smoke run does not wait out torch's 30 s last call twice.
# Its figures are then not torch's defaults; a benchmark run leaves it unset.
RDZV_CONF_ENV = "BENCH_BASELINE_RDZV_CONF"


@dataclass
class Cycle:
    every: int  # checkpoint interval (steps) of the group that was hit
    recovery_s: float | None = None  # kill -> survivors' first step at N-1
    kill_lost: int | None = None
    join_pause_s: float | None = None  # last step before the join -> first step at N
    join_s: float | None = None  # new agent started -> first step at N
    join_lost: int | None = None


@dataclass
class BaselineResult:
    nodes: int
    cycles: list[Cycle] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    start_s: float = 0.0


class TorchrunGroup:
    def __init__(self, work: Path, nodes: int, log: Any):
        self.work = work
        self.nodes = nodes
        self.log = log
        self.steps = work / "steps.log"
        self.every_file = work / "ckpt-every"
        self.agents: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.store: Any = None
        self.n = 0

    def tag(self, name: str) -> str:
        return f"{self.work}/{name}"

    def start_store(self) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )

    def start_agent(self) -> str:
        name = f"a{self.n}"
        self.n += 1
        env = dict(
            os.environ,
            SPOTCTL_NODE_TAG=self.tag(name),  # lets proctree find the whole tree
            BENCH_CKPT=str(self.work / "ckpt.pt"),
            BENCH_STEP_LOG=str(self.steps),
            BENCH_CKPT_EVERY_FILE=str(self.every_file),
            TRAIN_STEP_SLEEP_S=STEP_SLEEP_S,
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        out = open(self.work / f"{name}.log", "ab")
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes=1:{self.nodes}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.store.port}",
                "--rdzv-id=bench",
                "--max-restarts=1000",
                *([f"--rdzv-conf={conf}"] if (conf := os.environ.get(RDZV_CONF_ENV)) else []),
                str(LIB / "train_plain.py"),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        self.agents.append((name, p))
        return name

    def kill(self, name: str) -> None:
        from spotctl.agent import proctree

        proctree.signal_all(proctree.tagged(self.tag(name)), signal.SIGKILL)
        self.agents = [(n, p) for n, p in self.agents if n != name]

    def wait_steps(
        self, world: int, after: float, steps: int, timeout: float
    ) -> steplog.Entry | None:
        """Wait for `steps` completed steps at `world` by a group that started after `after`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            es = steplog.read(self.steps)
            tags = {e.tag for e in es if e.kind == "resume" and e.t > after and e.world == world}
            mine = [e for e in es if e.kind == "step" and e.tag in tags]
            if len(mine) >= steps:
                return mine[-1]
            time.sleep(0.25)
        return None

    def close(self) -> None:
        from spotctl.agent import proctree

        for _ in range(3):
            pids = proctree.tagged_prefix(f"{self.work}/")
            if not pids:
                break
            proctree.signal_all(pids, signal.SIGKILL)
            time.sleep(0.3)
        for _, p in self.agents:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.agents = []
        self.store = None


def run(
    ctx: Context, nodes: int, kills: int, intervals: tuple[int, ...], timeout_s: float = 150.0
) -> BaselineResult:
    work = ctx.subdir(f"torchrun-{nodes}")
    res = BaselineResult(nodes=nodes)
    rng = random.Random(1)
    g = TorchrunGroup(work, nodes, ctx.log)
    try:
        g.start_store()
        g.every_file.write_text(str(intervals[0]))
        t0 = time.time()
        ctx.log(f"torchrun baseline: starting {nodes} agents")
        for _ in range(nodes):
            g.start_agent()
        if g.wait_steps(nodes, t0, 3, 180) is None:
            res.failures.append(f"{nodes} plain torchrun agents never trained at world {nodes}")
            return res
        res.start_s = time.time() - t0
        for i in range(kills):
            every = intervals[i % len(intervals)]
            cyc = Cycle(every=every)
            res.cycles.append(cyc)
            # run past a checkpoint, then kill at a random point of the interval
            es = steplog.read(g.steps)
            cur = steplog.last_step(es)
            base = cur.step if cur else 0
            target = base + every + rng.randrange(every)
            if not _wait_step(g, target, timeout_s):
                res.failures.append(f"cycle {i}: training stalled before the kill")
                break
            victim = g.agents[0][0]
            t_kill = time.time()
            g.kill(victim)
            ctx.log(f"torchrun baseline: SIGKILLed agent {victim} (cycle {i + 1}/{kills})")
            if g.wait_steps(nodes - 1, t_kill, 1, timeout_s) is None:
                res.failures.append(
                    f"cycle {i}: no step at world {nodes - 1} within {timeout_s:.0f} s of the kill"
                )
                break
            tr = steplog.transition(steplog.read(g.steps), t_kill, nodes - 1)
            if tr is not None:
                cyc.recovery_s = tr.since(t_kill)
                cyc.kill_lost = tr.lost_steps
            ctx.log(
                f"torchrun baseline: world {nodes - 1} after {cyc.recovery_s:.1f} s, "
                f"lost {cyc.kill_lost} steps"
            )
            # the checkpoint interval of the next cycle applies from this restart on
            g.every_file.write_text(str(intervals[(i + 1) % len(intervals)]))
            g.wait_steps(nodes - 1, t_kill, 3, timeout_s)
            t_join = time.time()
            g.start_agent()
            if g.wait_steps(nodes, t_join, 1, timeout_s) is None:
                res.failures.append(
                    f"cycle {i}: the new agent never joined within {timeout_s:.0f} s"
                )
                break
            tr = steplog.transition(steplog.read(g.steps), t_join, nodes)
            if tr is not None:
                cyc.join_s = tr.since(t_join)
                cyc.join_pause_s = tr.pause_s
                cyc.join_lost = tr.lost_steps
            ctx.log(
                f"torchrun baseline: rejoined world {nodes}: pause {cyc.join_pause_s:.1f} s, "
                f"lost {cyc.join_lost} steps"
            )
        return res
    finally:
        g.close()


def _wait_step(g: TorchrunGroup, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = steplog.last_step(steplog.read(g.steps))
        if cur is not None and cur.step >= step and cur.world == g.nodes:
            return True
        time.sleep(0.2)
    return False
