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
    # figures that do not apply to this scenario (reported as null, never as 0)
    not_applicable: list[str] = field(default_factory=list)
    notes: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


FIGURES = ("committed_steps_lost", "steps_replayed", "recover_s")


def unmeasured(r: Result) -> list[str]:
    """Figures that are neither measured nor declared not applicable, and figures declared
    not applicable that still carry a value: either is a result that was not measured."""
    bad = [f for f in FIGURES if getattr(r, f) is None and f not in r.not_applicable]
    return bad + [f"{f} (not applicable, yet set)" for f in r.not_applicable
                  if getattr(r, f) is not None]  # fmt: skip


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
                _cell(r, "committed_steps_lost", str),
                _cell(r, "steps_replayed", str),
                _cell(r, "recover_s", lambda v: f"{v:.1f}"),
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


def _cell(r: Result, name: str, fmt: Any) -> str:
    v = getattr(r, name)
    if v is None:
        return "n/a" if name in r.not_applicable else "-"
    return str(fmt(v))
