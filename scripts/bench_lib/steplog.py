"""The per-step log both benchmark training scripts write (rank 0 of each worker group):

    <unix time> resume <step loaded> <world size> <group tag>
    <unix time> step <step completed> <world size> <group tag>

From it: when training stopped and started again, at which world size, and how many
completed steps a restart threw away. Lines cut short by a kill are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    t: float
    kind: str  # "resume" | "step"
    step: int
    world: int
    tag: str


def read(path: Path) -> list[Entry]:
    out: list[Entry] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines(keepends=True):
        parts = line.split()
        if not line.endswith("\n") or len(parts) != 5 or parts[1] not in ("resume", "step"):
            continue
        try:
            out.append(Entry(float(parts[0]), parts[1], int(parts[2]), int(parts[3]), parts[4]))
        except ValueError:
            continue
    out.sort(key=lambda e: e.t)
    return out


def last_step(entries: list[Entry]) -> Entry | None:
    steps = [e for e in entries if e.kind == "step"]
    return steps[-1] if steps else None


@dataclass(frozen=True)
class Transition:
    """Training at one world size stopped; a new group resumed at another."""

    last_old: Entry  # last completed step before the event
    resume: Entry  # the new group's "resume" line
    first_new: Entry  # its first completed step

    @property
    def lost_steps(self) -> int:
        return max(0, self.last_old.step - self.resume.step)

    def since(self, t: float) -> float:
        return self.first_new.t - t

    @property
    def pause_s(self) -> float:
        return self.first_new.t - self.last_old.t


def transition(entries: list[Entry], after: float, world: int) -> Transition | None:
    """The first group at `world` that resumed after time `after`, with the last step
    completed before `after`... or before that group resumed, whichever is later (a notice
    or join lets training go on for a few steps before it stops)."""
    resume = next(
        (e for e in entries if e.kind == "resume" and e.t > after and e.world == world), None
    )
    if resume is None:
        return None
    first = next((e for e in entries if e.kind == "step" and e.tag == resume.tag), None)
    if first is None:
        return None
    before = [e for e in entries if e.kind == "step" and e.t < resume.t and e.tag != resume.tag]
    if not before:
        return None
    return Transition(last_old=before[-1], resume=resume, first_new=first)
