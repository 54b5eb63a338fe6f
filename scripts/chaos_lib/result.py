"""One row of the fault matrix, and the table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Result:
    scenario: str
    survived: bool = False
    # committed checkpoint steps that the job no longer has after recovery (must be 0)
    committed_steps_lost: int | None = None
    # steps computed again after recovery (0 after a notice; <= checkpoint interval otherwise)
    steps_replayed: int | None = None
    # seconds from the fault to training advancing again
    recover_s: float | None = None
    # processes or instances left behind
    leaks: list[str] = field(default_factory=list)
    notice: bool = False  # a notice came (replays must then be 0)
    blocked: str = ""  # why the scenario could not run here
    notes: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def table(rows: list[Result]) -> str:
    head = [
        "scenario",
        "survived",
        "committed_steps_lost",
        "steps_replayed",
        "recover_s",
        "leaks",
        "notes",
    ]
    lines = []
    for r in rows:
        lines.append(
            [
                r.scenario,
                "blocked" if r.blocked else ("yes" if r.survived else "NO"),
                "-" if r.committed_steps_lost is None else str(r.committed_steps_lost),
                "-" if r.steps_replayed is None else str(r.steps_replayed),
                "-" if r.recover_s is None else f"{r.recover_s:.1f}",
                str(len(r.leaks)) if r.leaks else "0",
                (r.blocked or r.notes)[:90],
            ]
        )
    widths = [
        max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)
    ]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in lines]
    return "\n".join(out)
