"""Two decisions a Run makes at every step boundary, each on a Run that holds only what that
decision reads (the whole engines: tests/elastic/test_timed_checkpoints.py and
tests/elastic/test_ft_engine.py, slow):

- the timed checkpoint: the agreed flag says a save is due once `every_s` have passed since
  the last save, and a save starts the clock again (rank 0's clock, here a stand-in);
- run.all_reduce on the torchft engine after a replica failed during the step: NaN, never
  this replica's partial sum (the manager's errored() is what torchft answers then)."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

import spotctl.elastic as elastic
from spotctl.elastic import Run


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _timed_run(clock: _Clock, every_s: float) -> Run:
    run = object.__new__(Run)
    run.every_s, run.every, run.rank, run.step = every_s, 10_000, 0, 0
    run.drain_requested = False
    run.ckpt = SimpleNamespace(started=0, uploading=lambda: False)  # type: ignore[assignment]
    run._last_save_t = clock.now
    run._time_due = run._save_owed = run._upload_busy = False
    run._flags_after = run._flags_made_after = 0
    return run


def _saved_steps(run: Run, clock: _Clock, step_s: float, steps: int,
                 late: bool = False) -> list[int]:
    """Run `steps` steps of `step_s` each; the steps that saved. The control flags are
    made at each step's start and read at once (torchft's _leave_agreed) or, `late`, at
    the next step's start (the restart path's next_step: an async all_reduce read a step
    later)."""
    saved, sent = [], None
    for _ in range(steps):
        if late:
            if sent is not None:
                run._take_flags(sent)
            sent = run._control_flags()
        else:
            run._take_flags(run._control_flags())
        clock.now += step_s
        run.step += 1
        if run._save_now():
            saved.append(run.step)
            run.ckpt.started = run.step  # the save's start, as Checkpointer records it
    return saved


def test_a_timed_save_starts_the_clock_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """kills: the timed-checkpoint clock never reset (`self._last_save_t = ...` dropped
    from _save_now: once due, a save at every step)."""
    clock = _Clock()
    monkeypatch.setattr(elastic, "time", clock)
    run = _timed_run(clock, every_s=1.0)
    # steps of 0.25 s: the flag is read at a step's start, so the first save is the step
    # that starts 1.0 s after the last save (the 5th), and the clock starts again at its
    # end: the next starts 1.0 s after that, the 10th
    saved = _saved_steps(run, clock, 0.25, 22)
    assert saved == [5, 10, 15, 20], saved


def test_a_due_flag_made_before_a_save_does_not_save_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart path reads the flags a step after making them: the flag made at the
    start of the step that saved still said "due", and each timed save was followed by a
    second one two steps later (saves at 6, 8, 14, 16, ...: twice what every_s asks).
    A flag made before the newest save started no longer counts. Then one save every
    1.5 s of 0.25 s steps (1.0 s, plus the step the flag waits to be read)."""
    clock = _Clock()
    monkeypatch.setattr(elastic, "time", clock)
    run = _timed_run(clock, every_s=1.0)
    saved = _saved_steps(run, clock, 0.25, 26, late=True)
    assert saved == [6, 12, 18, 24], saved
    # a save by step count resets the clock too: a due flag made before it is dropped
    run = _timed_run(clock, every_s=1.0)
    run.every = 5
    saved = _saved_steps(run, clock, 0.25, 16, late=True)
    assert saved == [5, 10, 15], saved


def test_no_timed_save_before_its_time_nor_without_every_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds on both sides: 0.99 s after a save none is due, at 1.0 s one is; every_s 0
    saves by the clock never."""
    clock = _Clock()
    monkeypatch.setattr(elastic, "time", clock)
    run = _timed_run(clock, every_s=1.0)
    clock.now += 0.99
    assert run._control_flags()[1].item() == 0
    clock.now += 0.01
    assert run._control_flags()[1].item() == 1
    off = _timed_run(clock, every_s=0.0)
    assert _saved_steps(off, clock, 5.0, 10) == []
    # only rank 0's clock counts: another rank's flag never says due
    other = _timed_run(clock, every_s=1.0)
    other.rank = 1
    clock.now += 50
    assert other._control_flags()[1].item() == 0


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (the 'ft' extra)")
@pytest.mark.parametrize("value", [3.0, torch.tensor([2.0, 4.0]), torch.tensor([5, 7])])
def test_all_reduce_after_a_replica_failed_is_nan_not_a_partial_sum(value: object) -> None:
    """kills: run.all_reduce returning one replica's partial sum after a failure instead
    of NaN (the `errored()` check in FtRun.all_reduce skipped)."""
    from spotctl.elastic.ft import FtRun

    run = object.__new__(FtRun)
    run.step, run.world, run.local_dp_world, run.dp_world = 4, 1, 1, 2
    run._outer = None  # [train] sync = "ddp": the reduction spans every replica
    # the reduction as torchft leaves it after an error: this replica's part alone
    run._reduce = lambda t, op: None  # type: ignore[method-assign]
    run.manager = SimpleNamespace(errored=lambda: None)  # type: ignore[assignment]
    ok = run.all_reduce(value, "sum")
    if isinstance(value, torch.Tensor):
        assert torch.equal(ok, value)  # no failure: the reduction's own value
    else:
        assert ok == value
    run.manager = SimpleNamespace(errored=lambda: RuntimeError("replica r1 gone"))  # type: ignore[assignment]
    for op in ("sum", "mean", "max"):
        got = run.all_reduce(value, op)
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape and got.dtype.is_floating_point, (op, got)
            assert torch.isnan(got).all(), (op, got)
        else:
            assert isinstance(got, float) and math.isnan(got), (op, got)
