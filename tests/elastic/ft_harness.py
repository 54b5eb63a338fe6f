"""Replica groups on the torchft engine, for tests and scripts/bench: a Lighthouse (the
head's module) on loopback and one real torchrun per replica running ft_train.py (`nproc`
workers per replica group), each worker logging its committed steps. Notices are SIGUSR1 to the replica's worker (what the agent
sends), kills SIGKILL its whole process tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spotctl.agent import proctree
from spotctl.head.lighthouse import Lighthouse, LighthouseTiming

SCRIPT = Path(__file__).with_name("ft_train.py")
ROOT = Path(__file__).resolve().parents[2]


class FtReplicas:
    def __init__(self, tmp: Path, max_steps: int, every: int = 25, delay: float = 0.03,
                 engine: str = "torchft", timing: LighthouseTiming | None = None,
                 script: Path = SCRIPT, nproc: int = 1, ckpt_url: str | None = None):
        self.tmp = Path(tmp)
        self.nproc = nproc
        self.max_steps, self.every, self.delay, self.engine = max_steps, every, delay, engine
        os.environ.setdefault("RUST_LOG", "warn")
        self.lh = Lighthouse("127.0.0.1", timing=timing) if engine == "torchft" else None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.ckpt = self.tmp / "ckpt"
        self.ckpt_dir = ckpt_url or str(self.ckpt)  # an object store's URL instead
        self.script = script

    def log(self, name: str, local_rank: int = 0) -> Path:
        # ft_train.py: worker 0 writes FT_STEP_LOG, worker k FT_STEP_LOG + ".k"
        p = self.tmp / f"{name}.steps.jsonl"
        return p.with_name(f"{p.name}.{local_rank}") if local_rank else p

    def start(self, name: str, gated: bool = False, local_addr: str = "127.0.0.1",
              extra_env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, **(extra_env or {}))
        env.update(
            SPOTCTL_ENGINE=self.engine, SPOTCTL_FT_REPLICA_ID=name,
            SPOTCTL_CHECKPOINT_DIR=self.ckpt_dir, SPOTCTL_MAX_STEPS=str(self.max_steps),
            SPOTCTL_CHECKPOINT_EVERY=str(self.every), OMP_NUM_THREADS="1",
            FT_STEP_LOG=str(self.log(name)), FT_STEP_DELAY=str(self.delay), RUST_LOG="warn",
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        if self.lh is not None:
            env["TORCHFT_LIGHTHOUSE"] = self.lh.address
        if gated:
            env["FT_JOIN_GATE"] = str(self.tmp / f"{name}.go")
        out = open(self.tmp / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            # the c10d rendezvous store on port 0: torchrun's agent binds a port the kernel
            # picks and keeps it (no port chosen here and bound later, which can race)
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
             f"--nproc-per-node={self.nproc}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={local_addr}:0", f"--rdzv-id={name}",
             f"--local-addr={local_addr}", str(self.script)],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()

    def open_gate(self, name: str) -> float:
        (self.tmp / f"{name}.go").touch()
        return time.time()

    def steps(self, name: str, local_rank: int = 0) -> list[dict[str, Any]]:
        p = self.log(name, local_rank)
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return out

    def finished(self, name: str, local_rank: int = 0) -> dict[str, Any]:
        """What ft_train.py recorded once run.finish() returned: its time, the step, and
        the threads still running other than torchft's watchdog (it only sleeps, and returns
        at its next look) and the script's own DataLoader iterator's queue feeder."""
        p = self.log(name, local_rank)
        rec = dict(json.loads(p.with_name(p.name + ".finish").read_text()))
        rec["threads"] = [t for t in rec["threads"]
                          if "_watchdog_loop" not in t and t != "QueueFeederThread"]
        return rec

    def last_step(self, name: str) -> int:
        s = self.steps(name)
        return s[-1]["step"] if s else 0

    def wait(self, what: str, pred: Any, timeout: float = 120.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if pred():
                return
            for n, p in self.procs.items():
                if n not in self.killed and p.poll() not in (None, 0):
                    raise AssertionError(f"{n} exited {p.returncode} waiting for {what}:\n"
                                         + self.output(n))
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}:\n"
                             + "\n".join(self.output(n) for n in self.procs))

    def output(self, name: str) -> str:
        p = self.tmp / f"{name}.out"
        return f"--- {name}\n" + (p.read_text(errors="replace")[-3000:] if p.exists() else "")

    def notice(self, name: str) -> float:
        pid = self.steps(name)[-1]["pid"]
        t = time.time()
        os.kill(pid, signal.SIGUSR1)
        return t

    def kill(self, name: str) -> float:
        """SIGKILL the replica's whole tree at once (torchrun's workers run in sessions of
        their own, so its process group is not enough)."""
        self.killed.add(name)
        root = self.procs[name].pid
        tree = [root, *proctree.descendants(root)]
        t = time.time()
        proctree.signal_all(tree, signal.SIGKILL)
        self.procs[name].wait(10)
        return t

    def finish(self, names: list[str], timeout: float = 180.0) -> dict[str, int]:
        codes = {}
        for n in names:
            try:
                codes[n] = self.procs[n].wait(timeout)
            except subprocess.TimeoutExpired as e:
                raise AssertionError(f"{n} did not finish:\n" + self.output(n)) from e
        return codes

    def stop(self) -> None:
        for p in self.procs.values():
            proctree.signal_all([p.pid, *proctree.descendants(p.pid)], signal.SIGKILL)
            p.wait(10)
        if self.lh is not None:
            self.lh.stop()


def reference_steps(tmp: Path, max_steps: int) -> dict[int, dict[str, Any]]:
    """An uninterrupted one-replica, one-process run's step log, by step."""
    (tmp / "ref").mkdir()
    ref = FtReplicas(tmp / "ref", max_steps, delay=0.0)
    try:
        ref.start("solo")
        assert ref.finish(["solo"]) == {"solo": 0}, ref.output("solo")
        steps = {s["step"]: s for s in ref.steps("solo")}
    finally:
        ref.stop()
    assert sorted(steps) == list(range(1, max_steps + 1))
    return steps


def pause_at(steps: list[dict[str, Any]], t_event: float, to_replicas: int) -> float:
    """The pause a membership change added to a survivor's training: the gap between its
    last committed step before the change and its first with `to_replicas` replicas (after
    `t_event`), minus its median step time. A redone step (after a kill) is inside it."""
    ts = [s["t"] for s in steps]
    dts = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    median = dts[len(dts) // 2] if dts else 0.0
    for i in range(1, len(steps)):
        if (ts[i] >= t_event and steps[i]["replicas"] == to_replicas
                and steps[i - 1]["replicas"] != to_replicas):
            return max(0.0, ts[i] - ts[i - 1] - median)
    return float("nan")
