"""What every benchmark shares: result rows, statistics, the table/JSON renderer and the
run context (repeat count, work dir, log, cached cluster sessions)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LIB = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated measurements (n = how many)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat | None:
        vals = [float(v) for v in values]
        if not vals:
            return None
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))

    def to_json(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


@dataclass(frozen=True)
class Row:
    """One line of the table: a metric for spotctl next to its baseline, same units."""

    benchmark: str
    metric: str
    spotctl: Stat | None
    baseline: Stat | None
    unit: str
    note: str = ""
    # figures a docs table reads beside the two sides (e.g. the quorum stability row's
    # heals and heartbeat ages): saved with the row under these keys
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "metric": self.metric,
            "spotctl": self.spotctl.to_json() if self.spotctl else None,
            "baseline": self.baseline.to_json() if self.baseline else None,
            **self.extra,
            "unit": self.unit,
            "note": self.note,
        }


def row(
    benchmark: str,
    metric: str,
    ours: Sequence[float],
    base: Sequence[float],
    unit: str,
    note: str = "",
    extra: dict[str, Any] | None = None,
) -> Row:
    return Row(benchmark, metric, Stat.of(ours), Stat.of(base), unit, note, dict(extra or {}))


def _num(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_stat(s: Stat | None) -> str:
    if s is None:
        return "-"
    if s.n == 1 or s.min == s.max:
        return _num(s.median) + (f" (n={s.n})" if s.n > 1 else "")
    return f"{_num(s.median)} ({_num(s.min)}..{_num(s.max)})"


def table(rows: Sequence[Row], title: str = "spotctl benchmarks") -> Any:
    from rich.table import Table

    t = Table(title=title, show_lines=False, header_style="bold")
    t.add_column("benchmark")
    t.add_column("metric")
    t.add_column("spotctl median (min..max)", justify="right")
    t.add_column("baseline median (min..max)", justify="right")
    t.add_column("unit")
    t.add_column("note", overflow="fold")
    for r in rows:
        t.add_row(r.benchmark, r.metric, fmt_stat(r.spotctl), fmt_stat(r.baseline), r.unit, r.note)
    return t


def rows_json(rows: Sequence[Row]) -> str:
    return json.dumps([r.to_json() for r in rows], indent=2)


@dataclass
class Context:
    """Settings and shared state of one `scripts/bench` run."""

    repeat: int | None = None  # None: each benchmark's own default
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="spotctl-bench-")))
    out: Path = REPO / "out"
    quiet: bool = False
    # Cluster sessions are expensive; recovery, lost and join read the same runs.
    cache: dict[str, Any] = field(default_factory=dict)
    # Measured SimModel fields (spotctl simulate --recovery-json), filled by benchmarks:
    # shared ones at the top, each engine's pauses under its name (`engine_sim`).
    sim: dict[str, Any] = field(default_factory=dict)

    def engine_sim(self, engine: str) -> dict[str, float]:
        """The measured model fields of one engine (`[train] engine`)."""
        d: dict[str, float] = self.sim.setdefault(engine, {})
        return d
    t0: float = field(default_factory=time.monotonic)

    def reps(self, default: int) -> int:
        return max(1, self.repeat if self.repeat is not None else default)

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[bench {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def subdir(self, name: str) -> Path:
        p = self.work / name
        p.mkdir(parents=True, exist_ok=True)
        return p
