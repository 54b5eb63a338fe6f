"""The torchft engine (spotctl.elastic.ft) with real torchrun replica groups on CPU/gloo and
the head's Lighthouse module: a notice is a graceful leave (0 steps lost), a SIGKILL drops
the replica at the next quorum, a pre-started joiner recovers from a live peer; the loss
after every step equals an uninterrupted one-replica run's, and every step's samples are
the fixed global batch split over the step's replicas."""

from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)
os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info

from tests.elastic.ft_harness import FtReplicas, pause_at, reference_steps  # noqa: E402

pytestmark = pytest.mark.slow
M = 160


def _reference(tmp: Path) -> dict[int, dict]:
    return reference_steps(tmp, M)


def test_notice_kill_join_keep_the_trajectory(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the script does what training scripts do between backward() and step(): a
    # GradScaler, clipping (to a norm every step exceeds), a gradient-norm log and the
    # global loss from run.all_reduce; the uninterrupted reference runs the same script
    monkeypatch.setenv("FT_USER", "1")
    ref = _reference(tmp_path)
    c = FtReplicas(tmp_path, M, every=25, delay=0.04)
    try:
        for n in ("r0", "r1", "r2"):
            # r1 dies at a planted point: right after a step's commit vote, before its
            # metric all_reduce, where the survivor's all_reduce must come back NaN
            c.start(n, extra_env={"FT_DIE_GATE": str(tmp_path / "r1.die")} if n == "r1" else {})
        c.start("r3", gated=True)  # pre-started joiner: imports done, waits at the gate
        c.wait("three replicas in one quorum",
               lambda: all(any(s["replicas"] == 3 for s in c.steps(n))
                           for n in ("r0", "r1", "r2")))
        # notice: r0 finishes the agreed step, commits, leaves; exit 0
        t_notice = c.notice("r0")
        assert c.finish(["r0"], timeout=60) == {"r0": 0}, c.output("r0")
        left_at = c.last_step("r0")
        c.wait("survivors past the leave", lambda: c.last_step("r2") >= left_at + 8)
        # hard kill: r1's worker SIGKILLs its torchrun and itself after its next commit vote
        t_kill_step = c.last_step("r2")
        c.killed.add("r1")
        (tmp_path / "r1.die").touch()
        t_kill = time.time()
        c.procs["r1"].wait(60)
        c.wait("survivor past the kill", lambda: c.last_step("r2") >= t_kill_step + 8)
        # join: r3 recovers from r2 while r2 trains
        t_join = c.open_gate("r3")
        c.wait("joiner training", lambda: len(c.steps("r3")) >= 3)
        codes = c.finish(["r2", "r3"])
        assert codes == {"r2": 0, "r3": 0}, c.output("r2") + c.output("r3")
        logs = {n: c.steps(n) for n in ("r0", "r1", "r2", "r3")}
    finally:
        c.stop()

    r2 = [s["step"] for s in logs["r2"]]
    # the survivor never lost, repeated or skipped a step through notice, kill and join
    assert r2 == list(range(r2[0], M + 1)), r2
    # the leaver's last step is the survivor's: nothing it did was lost
    assert left_at in r2 and any(s["replicas"] == 3 for s in logs["r0"])
    # the joiner did not start from scratch: it recovered a live peer's state
    r3 = [s["step"] for s in logs["r3"]]
    assert r3[0] > t_kill_step and r3 == list(range(r3[0], M + 1))
    # ... received in place: every tensor of that state (the model's, AdamW's moments made
    # before the heal, the RNG states) landed in the joiner's own tensors, none in new memory
    in_place, tensors = logs["r3"][0]["healed"]
    assert tensors > 6 and in_place == tensors, logs["r3"][0]["healed"]
    assert any(s["replicas"] == 2 for s in logs["r2"] if s["step"] > r3[0])
    # the loss after every step equals the uninterrupted run's (float tolerance), and the
    # learning-rate schedule stepped only with committed steps
    for name, steps in logs.items():
        for s in steps:
            want = ref[s["step"]]
            assert math.isclose(s["full_loss"], want["full_loss"], rel_tol=2e-4, abs_tol=1e-6), (
                name, s["step"], s["full_loss"], want["full_loss"])
            assert math.isclose(s["lr"], want["lr"]), (name, s["step"])
            # user code between backward() and step() saw the global gradient: the norm
            # it clipped (and logged) is the uninterrupted run's, the scaler's scale too,
            # and run.all_reduce gave every replica the step's global loss
            assert s["norm"] > 0.05 and math.isclose(s["norm"], want["norm"], rel_tol=1e-3), (
                name, s["step"], s["norm"], want["norm"])
            assert s["scale"] == want["scale"], (name, s["step"], s["scale"], want["scale"])
            if math.isnan(s["gloss"]):
                continue  # unknown (below), never a partial sum
            assert math.isclose(s["gloss"], want["gloss"], rel_tol=1e-4), (name, s["step"])
    # the step whose metric all_reduce the SIGKILL interrupted (r1 died after its commit
    # vote, so r2 committed it too) has no global loss: NaN, exactly there, the step after
    # r1's last; a graceful leave and a join never cost one
    unknown = [(n, s["step"]) for n, steps in logs.items() for s in steps
               if math.isnan(s["gloss"])]
    died_at = _last_step(logs["r1"]) + 1
    assert unknown == [("r2", died_at)] and t_kill_step < died_at, (unknown, died_at)
    # run.is_main: exactly one process of the job at every step all replicas logged
    for step in range(1, M + 1):
        entries = [s for steps in logs.values() for s in steps if s["step"] == step]
        if entries and len(entries) == entries[0]["replicas"]:
            assert sum(s["main"] for s in entries) == 1, (step, entries)
    # every step's samples: the fixed global batch, split without overlap over its replicas
    by_step: dict[int, list[list[int]]] = {}
    for steps in logs.values():
        for s in steps:
            by_step.setdefault(s["step"], []).append(s["idx"])
    for step, parts in by_step.items():
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)), step
        assert set(flat) <= set(ref[step]["idx"]), step
        if len(parts) == logs_replicas(logs, step):
            assert sorted(flat) == sorted(ref[step]["idx"]), step
    # periodic checkpoints went on (for the case every replica dies)
    assert any((tmp_path / "ckpt").glob("*")), "no checkpoint written"
    print(f"pauses (s): notice {pause_at(logs['r2'], t_notice, 2):.3f} "
          f"kill {pause_at(logs['r2'], t_kill, 1):.3f} join {pause_at(logs['r2'], t_join, 2):.3f}")


def _last_step(steps: list[dict]) -> int:
    return int(steps[-1]["step"]) if steps else 0


def logs_replicas(logs: dict[str, list[dict]], step: int) -> int:
    for steps in logs.values():
        for s in steps:
            if s["step"] == step:
                return int(s["replicas"])
    return 0
