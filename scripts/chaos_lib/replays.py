"""Steps replayed on torchrun, from the workers' own records: the sample trace that
templates/train.py writes when SPOTCTL_TRACE_SAMPLES names a folder (a file per worker
process, a line per step it trained, written after its optimizer step: worker group,
data-parallel rank, step, epoch, sample indices). Every node's workers write there, the
leaver's and the survivors'.

On torchrun a worker group (an incarnation: one start of the workers after a rendezvous)
trains each step number once, and every restart is a new group. So a step is replayed
each time a group trains a step number that an earlier group had trained already; a
graceful leave or a join resumes from the step the group drained at and replays nothing.
The head's `lost_steps` (highest step it heard of minus the resume step) is kept beside
it as a cross-check: it hears of steps through throttled reports, so it can miss some.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# step -> the worker groups (incarnations) that trained it
Trained = dict[int, set[str]]


def trace_lines(trace_dir: Path) -> Iterator[tuple[str, int, int, int, list[int]]]:
    """(worker group, data-parallel rank, step, epoch, sample indices) of every complete
    line of every worker's trace (a line without its newline is one a killed worker was
    writing)."""
    for f in sorted(trace_dir.glob("*.txt")):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines(keepends=True):
            parts = line.split()
            if not line.endswith("\n") or len(parts) < 4 or not all(
                    x.isdigit() for x in parts[1:]):
                continue
            inc, rank, step, epoch, *idx = parts
            yield inc, int(rank), int(step), int(epoch), [int(i) for i in idx]


def trained(trace_dir: Path) -> Trained:
    """step -> the worker groups that trained it, from every complete trace line."""
    out: Trained = {}
    for inc, _, step, _, _ in trace_lines(trace_dir):
        out.setdefault(step, set()).add(inc)
    return out


def replayed(before: Trained, after: Trained) -> dict[int, int]:
    """step -> how many of its trainings recorded in `after` but not in `before` repeat a
    training of it (the first training of a step is no replay, wherever it falls)."""
    out = {}
    for step, groups in after.items():
        extra = len(groups) - max(1, len(before.get(step, ())))
        if extra > 0:
            out[step] = extra
    return out


def _highest(t: Trained) -> dict[str, int]:
    """group -> the highest step it trained."""
    top: dict[str, int] = {}
    for step, groups in t.items():
        for g in groups:
            top[g] = max(top.get(g, 0), step)
    return top


def settled(before: Trained, now: Trained) -> bool:
    """Whether every replay of what happened since `before` is in `now`: no group started
    since, or the newest group (the one alone at the highest step) is one of them, past
    every step an earlier group trained."""
    old = set(_highest(before))
    top = _highest(now)
    if not set(top) - old:
        return True
    best = max(top.values())
    leaders = [g for g, s in top.items() if s == best]
    return len(leaders) == 1 and leaders[0] not in old


@dataclass
class Window:
    """The workers' trace from a mark on (a scenario's start), to count its replays."""

    trace_dir: Path
    before: Trained = field(default_factory=dict)

    @classmethod
    def open(cls, trace_dir: Path) -> Window:
        return cls(trace_dir, trained(trace_dir))

    def close(self, timeout: float = 120.0) -> dict[str, Any]:
        """Wait (up to `timeout` s) until the groups started since the mark have trained
        past every step trained before them, so every replay is recorded; then the count.
        `settled` False: the count is what was recorded by then (a lower bound)."""
        deadline = time.monotonic() + timeout
        while True:
            now = trained(self.trace_dir)
            ok = settled(self.before, now)
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.4)
        steps = replayed(self.before, now)
        new = sorted(set(_highest(now)) - set(_highest(self.before)))
        return {
            "replayed": sum(steps.values()),
            "steps": steps,
            "new_groups": len(new),
            "settled": ok,
        }


def fill(
    res: Any, window: Window | None, head_lost_steps: int | None, timeout: float = 120.0
) -> None:
    """A fault-matrix row's steps_replayed from the workers' trace since `window` opened,
    the head's figure beside it in detail (both in detail["replays_disagree"] where they
    differ). A cluster whose workers write no trace (window None) keeps the head's."""
    res.detail["head_lost_steps"] = head_lost_steps
    if window is None:
        res.steps_replayed = head_lost_steps
        return
    w = window.close(timeout)
    res.steps_replayed = w["replayed"]
    res.detail["workers_replayed"] = w
    if head_lost_steps is not None and head_lost_steps != w["replayed"]:
        res.detail["replays_disagree"] = {"workers": w["replayed"], "head": head_lost_steps}
