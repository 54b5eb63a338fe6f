"""spotctl side of the cluster benchmarks: a real local cluster driven through the CLI.

`spotctl up` starts N local nodes running train_spotctl.py. Each cycle hits one running
node - `spotctl preempt NODE --style aws` (a graceful notice) or `spotctl kill NODE`
(SIGKILL of its process tree, no notice) - waits for the rescale to N-1, then runs
`spotctl up` so a new node joins back to N through a drain. Figures come from the
head's rescale events (notice_to_resume_s, lost_steps, reason) and from the step log
(training pause around a join). The checkpoint interval of each cycle's worker group is
set through BENCH_CKPT_EVERY_FILE, read at worker start.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import steplog
from .core import LIB, Context

# appended to a bench cluster's spotctl.toml: nodes are replaced only when the bench asks
# (`up`, `rebalance`), never by the head's own reconcile loop racing what it measures
# no reconcile loop on the head, and the cluster on this machine's loopback: the
# benchmark reads the head from its own process (a private network would hide it)
NO_HEAD_LOOP = "\n[rebalance]\non_head = false\n\n[local]\nprivate_network = false\n"

STEP_SLEEP_S = "0.05"


@dataclass
class Cycle:
    kind: str  # "notice" | "kill"
    every: int  # checkpoint interval of the group that was hit
    victim: str = ""
    reason: str = ""  # rescale event's reason
    recovery_s: float | None = None  # notice (or last heartbeat) -> first step at N-1
    lost: int | None = None
    join_s: float | None = None  # join request -> first step at N (event)
    join_pause_s: float | None = None  # last step before the drain -> first step at N
    join_lost: int | None = None


@dataclass
class SpotctlResult:
    nodes: int
    cycles: list[Cycle] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    start_s: float = 0.0
    leftover_processes: int = 0


class Cluster:
    def __init__(self, work: Path, nodes: int, first_every: int):
        self.work = work
        self.name = "bench"
        self.nodes = nodes
        self.home = work / "home"
        self.project = work / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        self.steps = work / "steps.log"
        self.every_file = work / "ckpt-every"
        self.every_file.write_text(str(first_every))
        shutil.copy(LIB / "train_spotctl.py", self.project / "train.py")
        env = {
            "TRAIN_STEP_SLEEP_S": STEP_SLEEP_S,
            "BENCH_STEP_LOG": str(self.steps),
            "BENCH_CKPT_EVERY_FILE": str(self.every_file),
        }
        env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
        (self.project / "spotctl.toml").write_text(
            f'name = "{self.name}"\nprovider = "local"\ngpus = "{nodes - 1}..{nodes}"\n\n'
            f'[train]\nengine = "torchrun"\nscript = "train.py"\n'
            f"checkpoint_every = {first_every}\n"
            f"env = {{ {env_toml} }}\n"
            + NO_HEAD_LOOP
        )
        self.env = dict(os.environ, SPOTCTL_HOME=str(self.home), NO_COLOR="1")
        self._store: Any = None

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [sys.executable, "-m", "spotctl.cli.app", *args],
            cwd=self.project,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if p.returncode != 0:
            raise RuntimeError(
                f"spotctl {' '.join(args)} exited {p.returncode}: "
                f"{(p.stderr or p.stdout).strip()[-500:]}"
            )
        return p

    def head(self) -> Any:
        from spotctl.control.reconcile import head_client
        from spotctl.state import Store

        if self._store is None:
            self._store = Store(self.home)
        return head_client(self._store, self.name, timeout_s=3)

    def rescales(self) -> list[dict[str, Any]]:
        from spotctl.head.client import HeadUnavailable

        try:
            return [e for e in self.head().events() if e.get("type") == "rescale"]
        except HeadUnavailable:
            return []

    def wait_rescale(self, count: int, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = self.rescales()
            if len(evs) >= count:
                return evs[count - 1]
            time.sleep(0.5)
        return None

    def running_nodes(self) -> list[str]:
        st = self.head().status()
        ids = [
            n for n, v in st["nodes"].items() if v.get("state") == "running" and v.get("workers")
        ]
        return sorted(ids, key=lambda s: (len(s), s))

    def wait_steps(self, world: int, after: float, steps: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            es = steplog.read(self.steps)
            tags = {e.tag for e in es if e.kind == "resume" and e.t > after and e.world == world}
            if sum(1 for e in es if e.kind == "step" and e.tag in tags) >= steps:
                return True
            time.sleep(0.25)
        return False

    def wait_step(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cur = steplog.last_step(steplog.read(self.steps))
            if cur is not None and cur.step >= step and cur.world == self.nodes:
                return True
            time.sleep(0.2)
        return False

    @property
    def cluster_dir(self) -> Path:
        return self.home / "clusters" / self.name

    def down(self) -> int:
        """Stop everything; returns how many tagged processes had to be SIGKILLed after."""
        from spotctl.agent import proctree

        if (self.home / "state.db").exists():
            try:
                self.cli("down", "--name", self.name, "--yes", timeout=120)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        left = proctree.tagged_prefix(str(self.cluster_dir) + "/")
        if left:
            proctree.signal_all(left, signal.SIGKILL)
        if self._store is not None:
            self._store.close()
            self._store = None
        return len(left)


def schedule(
    notices: int, kills_per_interval: int, intervals: tuple[int, ...]
) -> list[tuple[str, int]]:
    cycles = [("notice", intervals[i % len(intervals)]) for i in range(notices)]
    cycles += [("kill", e) for e in intervals for _ in range(kills_per_interval)]
    return cycles


def run(
    ctx: Context,
    nodes: int,
    notices: int,
    kills_per_interval: int,
    intervals: tuple[int, ...],
    timeout_s: float = 150.0,
) -> SpotctlResult:
    work = ctx.subdir(f"spotctl-{nodes}")
    plan = schedule(notices, kills_per_interval, intervals)
    res = SpotctlResult(nodes=nodes)
    rng = random.Random(2)
    c = Cluster(work, nodes, plan[0][1] if plan else intervals[0])
    try:
        t0 = time.time()
        ctx.log(f"spotctl: starting a local cluster of {nodes} nodes")
        c.cli("up", "--wait", "180", timeout=300)
        if not c.wait_steps(nodes, t0, 3, 180):
            res.failures.append(f"the local cluster never trained at world {nodes}")
            return res
        res.start_s = time.time() - t0
        seen = len(c.rescales())
        for i, (kind, every) in enumerate(plan):
            cyc = Cycle(kind=kind, every=every)
            res.cycles.append(cyc)
            cur = steplog.last_step(steplog.read(c.steps))
            base = cur.step if cur else 0
            # a kill lands at a random point of the interval, past a checkpoint of this
            # group; a notice only needs the group to be training
            target = base + every + rng.randrange(every) if kind == "kill" else base + 5
            if not c.wait_step(target, timeout_s):
                res.failures.append(f"cycle {i}: training stalled before the {kind}")
                break
            cyc.victim = c.running_nodes()[0]
            t_act = time.time()
            if kind == "notice":
                c.cli("preempt", cyc.victim, "--name", c.name, "--style", "aws")
            else:
                c.cli("kill", cyc.victim, "--name", c.name)
            ev = c.wait_rescale(seen + 1, timeout_s)
            if ev is None:
                res.failures.append(
                    f"cycle {i}: no rescale within {timeout_s:.0f} s of the {kind} on {cyc.victim}"
                )
                break
            seen += 1
            cyc.reason = str(ev.get("reason"))
            cyc.recovery_s = float(ev["notice_to_resume_s"])
            cyc.lost = int(ev["lost_steps"])
            ctx.log(
                f"spotctl: {kind} on {cyc.victim} -> world {ev['to_world_size']} in "
                f"{cyc.recovery_s:.1f} s, lost {cyc.lost} steps ({cyc.reason}) "
                f"[cycle {i + 1}/{len(plan)}]"
            )
            nxt = plan[i + 1][1] if i + 1 < len(plan) else every
            c.every_file.write_text(str(nxt))
            c.wait_steps(nodes - 1, t_act, 3, timeout_s)
            t_join = time.time()
            c.cli("up", "--wait", "120", timeout=240)
            ev = c.wait_rescale(seen + 1, timeout_s)
            if ev is None:
                res.failures.append(f"cycle {i}: no join rescale within {timeout_s:.0f} s")
                break
            seen += 1
            cyc.join_s = float(ev["notice_to_resume_s"])
            cyc.join_lost = int(ev["lost_steps"])
            c.wait_steps(nodes, t_join, 1, timeout_s)
            tr = steplog.transition(steplog.read(c.steps), t_join, nodes)
            if tr is not None:
                cyc.join_pause_s = tr.pause_s
            ctx.log(
                f"spotctl: join back to {ev['to_world_size']}: pause "
                f"{cyc.join_pause_s if cyc.join_pause_s is not None else float('nan'):.1f} s, "
                f"lost {cyc.join_lost} steps"
            )
        return res
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        res.failures.append(str(e))
        return res
    finally:
        ctx.log("spotctl: down")
        res.leftover_processes = c.down()
