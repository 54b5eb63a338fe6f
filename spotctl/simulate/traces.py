"""Spot traces, read into one shape: node add/remove events and a capacity timeline.

Two public formats are understood:

- spot-traces JSON (skypilot-org/spot-traces): `{"metadata": {"gap_seconds": G},
  "data": [v0, v1, ...], "prices": [...]?}`. `data[i]` holds during tick i (G seconds
  long); 1 means available/running, 0 unavailable, and multi-node files carry the count
  of available nodes. `prices`, when present, is spot USD per node-hour per tick.
- bamboo CSV (uclasystem/bamboo): no header, rows `t_ms,add|remove,node`.

A count trace becomes events on numbered slots: a rise adds the next slots, a drop
removes the highest ones first. The simulator hands out the lowest free slots, so a job
loses nodes only when the count falls below what it holds (capacity semantics: the trace
is taken as how many nodes one can hold at each moment).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotctl.errors import SpecError


@dataclass(frozen=True)
class NodeEvent:
    """One node appearing in or leaving the trace."""

    t_s: float  # seconds since the trace start
    kind: str  # "add" | "remove" (a remove of a held node is a preemption)
    node: str  # trace node name: "slot-3" for count traces, the CSV's name for bamboo


@dataclass(frozen=True)
class Trace:
    """A capacity trace, normalised. Times are seconds from the trace start."""

    name: str  # file stem, e.g. "us-east-1c_v100_1"
    path: str  # where it was read from
    format: str  # "spot-traces" | "bamboo"
    span_s: float  # simulated length: ticks x gap, or the last CSV event
    events: tuple[NodeEvent, ...]  # sorted by time; removes before adds at equal times
    timeline: tuple[tuple[float, int], ...]  # (t_s, available) change points, first at 0
    gap_s: float | None = None  # tick length of a JSON trace; None for CSV
    # Spot USD per node-hour as (t_s, price) change points; empty when the file has none.
    prices: tuple[tuple[float, float], ...] = ()
    # Hints from the file's path for the price lookup (empty when unknown).
    region: str = ""
    zone: str = ""
    instance_type: str = ""
    gpus_per_node: int = 0  # 0 = unknown
    _times: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_times", tuple(t for t, _ in self.timeline))

    @property
    def preemptions(self) -> tuple[NodeEvent, ...]:
        return tuple(e for e in self.events if e.kind == "remove")

    @property
    def max_nodes(self) -> int:
        return max((n for _, n in self.timeline), default=0)

    def available_at(self, t: float) -> int:
        i = bisect.bisect_right(self._times, t) - 1
        return self.timeline[i][1] if i >= 0 else 0

    def node_seconds(self, cap: int | None = None, until: float | None = None) -> float:
        """Integral of available nodes (each capped at `cap`) over [0, until]."""
        end = self.span_s if until is None else min(until, self.span_s)
        total = 0.0
        for i, (t, n) in enumerate(self.timeline):
            if t >= end:
                break
            nxt = self.timeline[i + 1][0] if i + 1 < len(self.timeline) else end
            total += (min(nxt, end) - t) * (n if cap is None else min(n, cap))
        return total

    def truncated(self, hours: float) -> Trace:
        """The first `hours` of the trace (events after the cut dropped)."""
        end = hours * 3600.0
        if end >= self.span_s:
            return self
        return Trace(
            name=self.name,
            path=self.path,
            format=self.format,
            span_s=end,
            events=tuple(e for e in self.events if e.t_s < end),
            timeline=tuple(p for p in self.timeline if p[0] < end),
            gap_s=self.gap_s,
            prices=tuple(p for p in self.prices if p[0] < end),
            region=self.region,
            zone=self.zone,
            instance_type=self.instance_type,
            gpus_per_node=self.gpus_per_node,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "format": self.format,
            "span_h": round(self.span_s / 3600.0, 4),
            "gap_s": self.gap_s,
            "max_nodes": self.max_nodes,
            "mean_available_nodes": round(self.node_seconds() / self.span_s, 4)
            if self.span_s
            else 0.0,
            "removals": len(self.preemptions),
            "has_prices": bool(self.prices),
            "region": self.region or None,
            "zone": self.zone or None,
            "instance_type": self.instance_type or None,
        }


def read_trace(path: str | Path) -> Trace:
    """Read a spot-traces JSON or bamboo CSV file. Bad input raises one SpecError line."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"trace {p}: no such file")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise SpecError(f"trace {p}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"trace {p}: cannot read ({e.strerror})") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        tr = _parse_json(text, str(p))
    else:
        tr = _parse_csv(text, str(p))
    return _with_hints(tr, p)


# bounds that keep a replay finite and its figures printable
MAX_GAP_S = 7 * 86400.0
MAX_SPAN_S = 1e8  # about three years
MAX_PRICE = 1e5  # USD per node-hour


def _fail(where: str, msg: str) -> SpecError:
    return SpecError(f"trace {where}: {msg}")


def _parse_json(text: str, where: str) -> Trace:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(where, f"not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise _fail(where, "expected an object with 'metadata' and 'data'")
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or "gap_seconds" not in meta:
        raise _fail(where, "metadata.gap_seconds is missing")
    gap = meta["gap_seconds"]
    if isinstance(gap, bool) or not isinstance(gap, int | float) or not 0 < gap <= MAX_GAP_S:
        raise _fail(where, f"metadata.gap_seconds must be a positive number up to "
                    f"{MAX_GAP_S:g}, got {gap!r}")
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise _fail(where, "data must be a non-empty list of node counts")
    for i, v in enumerate(data):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail(where, f"data[{i}] must be a non-negative integer, got {v!r}")
    prices: list[tuple[float, float]] = []
    raw_prices = doc.get("prices")
    if raw_prices is not None:
        if not isinstance(raw_prices, list) or len(raw_prices) != len(data):
            raise _fail(where, f"prices must be a list as long as data ({len(data)})")
        for i, v in enumerate(raw_prices):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_PRICE:
                raise _fail(where, f"prices[{i}] must be a number from 0 to {MAX_PRICE:g}, "
                            f"got {v!r}")
            if not prices or prices[-1][1] != float(v):
                prices.append((i * float(gap), float(v)))
    if len(data) * float(gap) > MAX_SPAN_S:
        raise _fail(where, f"spans {len(data) * float(gap):g} s, past {MAX_SPAN_S:g} s")
    counts = [(i * float(gap), int(v)) for i, v in enumerate(data)]
    return _from_counts(counts, len(data) * float(gap), where, "spot-traces", float(gap), prices)


def _from_counts(
    counts: list[tuple[float, int]],
    span: float,
    where: str,
    fmt: str,
    gap: float | None,
    prices: list[tuple[float, float]],
) -> Trace:
    events: list[NodeEvent] = []
    timeline: list[tuple[float, int]] = []
    cur = 0
    for t, n in counts:
        if timeline and n == cur:
            continue
        # Removes take the highest slots so a job holding the lowest ones loses nodes
        # only when the count falls below what it holds.
        for k in range(cur, n, -1):
            events.append(NodeEvent(t, "remove", f"slot-{k}"))
        for k in range(cur + 1, n + 1):
            events.append(NodeEvent(t, "add", f"slot-{k}"))
        timeline.append((t, n))
        cur = n
    return Trace(
        name=Path(where).stem,
        path=where,
        format=fmt,
        span_s=span,
        events=tuple(events),
        timeline=tuple(timeline),
        gap_s=gap,
        prices=tuple(prices),
    )


def _parse_csv(text: str, where: str) -> Trace:
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if not rows:
        raise _fail(where, "empty file (expected rows `t_ms,add|remove,node`)")
    present: set[str] = set()
    events: list[NodeEvent] = []
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    last_ms = 0
    for lineno, row in enumerate(rows, 1):
        if len(row) != 3:
            raise _fail(where, f"row {lineno}: expected `t_ms,add|remove,node`, got {row!r}")
        t_raw, kind, node = (c.strip() for c in row)
        try:
            t_ms = int(t_raw)
        except ValueError:
            raise _fail(
                where, f"row {lineno}: time {t_raw!r} is not integer milliseconds"
            ) from None
        if t_ms < last_ms:
            raise _fail(where, f"row {lineno}: time {t_ms} ms goes back (previous {last_ms})")
        if t_ms > MAX_SPAN_S * 1000:
            raise _fail(where, f"row {lineno}: time {t_ms} ms is past {MAX_SPAN_S:g} s")
        if kind not in ("add", "remove"):
            raise _fail(where, f"row {lineno}: event {kind!r} is not 'add' or 'remove'")
        if not node:
            raise _fail(where, f"row {lineno}: node name is empty")
        if kind == "add" and node in present:
            raise _fail(where, f"row {lineno}: node {node} added twice")
        if kind == "remove" and node not in present:
            raise _fail(where, f"row {lineno}: node {node} removed but not present")
        (present.add if kind == "add" else present.discard)(node)
        t = t_ms / 1000.0
        events.append(NodeEvent(t, kind, node))
        if timeline[-1][0] == t:
            timeline[-1] = (t, len(present))
        else:
            timeline.append((t, len(present)))
        last_ms = t_ms
    # Removes first at equal times: a node leaving and another arriving in the same
    # minute is a preemption followed by new capacity, not the other way round.
    events.sort(key=lambda e: (e.t_s, 0 if e.kind == "remove" else 1))
    merged: list[tuple[float, int]] = []
    for t, n in timeline:
        if merged and merged[-1][1] == n:
            continue
        merged.append((t, n))
    span = events[-1].t_s
    if span <= 0:
        raise _fail(where, "all events are at time 0; nothing to replay")
    return Trace(
        name=Path(where).stem,
        path=where,
        format="bamboo",
        span_s=span,
        events=tuple(events),
        timeline=tuple(merged),
    )


# spot-traces file names end like `us-east-1c_v100_1.json` (zone, accelerator, count);
# bamboo ones like `p3-trace.csv`. These map them to the AWS type the trace was taken on.
_ACCEL_TYPES = {
    ("v100", 1): ("p3.2xlarge", 1),
    ("v100", 4): ("p3.8xlarge", 4),
    ("v100", 8): ("p3.16xlarge", 8),
    ("k80", 1): ("p2.xlarge", 1),
    ("k80", 8): ("p2.8xlarge", 8),
    ("intel", 64): ("r5.16xlarge", 1),  # CPU trace (64 vCPUs); one "node" unit per VM
}
_BAMBOO_TYPES = {"p3": ("p3.2xlarge", 1), "g4dn": ("g4dn.xlarge", 1)}
_ZONE_RE = re.compile(r"^([a-z]{2}-[a-z]+-\d)([a-z])$")
_GCP_ZONE_RE = re.compile(r"^([a-z]+-[a-z]+\d)-([a-z])$")


def _with_hints(tr: Trace, p: Path) -> Trace:
    region = zone = itype = ""
    gpus = 0
    parts = p.stem.split("_")[-3:]  # a prefix such as "aws-4node-08-03-2023_" is allowed
    if len(parts) == 3:
        zone = parts[0]
        m = _ZONE_RE.match(zone) or _GCP_ZONE_RE.match(zone)
        region = m.group(1) if m else ""
        try:
            key = (parts[1].lower(), int(parts[2]))
        except ValueError:
            key = ("", 0)
        if key in _ACCEL_TYPES and _ZONE_RE.match(zone):
            itype, gpus = _ACCEL_TYPES[key]
    elif p.stem.endswith("-trace"):
        fam = p.stem.removesuffix("-trace")
        if fam in _BAMBOO_TYPES:
            itype, gpus = _BAMBOO_TYPES[fam]
            region = "us-east-1"  # undocumented in bamboo; assumed for the price lookup
    return Trace(
        name=tr.name,
        path=tr.path,
        format=tr.format,
        span_s=tr.span_s,
        events=tr.events,
        timeline=tr.timeline,
        gap_s=tr.gap_s,
        prices=tr.prices,
        region=region,
        zone=zone,
        instance_type=itype,
        gpus_per_node=gpus,
    )


# --- synthetic traces -------------------------------------------------------------------


def _counts_trace(name: str, counts: list[int], gap_s: float) -> Trace:
    tr = _from_counts(
        [(i * gap_s, n) for i, n in enumerate(counts)],
        len(counts) * gap_s,
        f"synthetic:{name}",
        "synthetic",
        gap_s,
        [],
    )
    return Trace(
        name=name,
        path=tr.path,
        format=tr.format,
        span_s=tr.span_s,
        events=tr.events,
        timeline=tr.timeline,
        gap_s=gap_s,
    )


def poisson_trace(
    nodes: int = 8,
    hours: float = 24.0,
    mean_up_h: float = 6.0,
    mean_down_min: float = 20.0,
    seed: int = 1,
    gap_s: float = 60.0,
) -> Trace:
    """Independent departures: each of `nodes` slots stays up for an exponential time
    (mean `mean_up_h`), then is gone for an exponential time (mean `mean_down_min`).
    Deterministic for a seed."""
    import random

    rnd = random.Random(seed)
    ticks = int(hours * 3600 / gap_s)
    up = [[True] * ticks for _ in range(nodes)]
    for slot in up:
        t = rnd.expovariate(1 / (mean_up_h * 3600))
        while t < ticks * gap_s:
            down = rnd.expovariate(1 / (mean_down_min * 60))
            for i in range(int(t // gap_s), min(ticks, int((t + down) // gap_s) + 1)):
                slot[i] = False
            t += down + rnd.expovariate(1 / (mean_up_h * 3600))
    counts = [sum(slot[i] for slot in up) for i in range(ticks)]
    return _counts_trace(f"poisson-{nodes}n-seed{seed}", counts, gap_s)


def bursty_trace(
    nodes: int = 8,
    hours: float = 24.0,
    mean_between_h: float = 4.0,
    burst_share: float = 0.5,
    mean_down_min: float = 30.0,
    seed: int = 1,
    gap_s: float = 60.0,
) -> Trace:
    """Correlated departures: bursts arrive as a Poisson process (mean gap
    `mean_between_h`); each takes up to `burst_share` of the nodes (at least one) away
    together for an exponential time (mean `mean_down_min`), as a zone-wide reclaim
    does. Deterministic for a seed."""
    import random

    rnd = random.Random(seed)
    ticks = int(hours * 3600 / gap_s)
    gone = [0] * ticks
    t = rnd.expovariate(1 / (mean_between_h * 3600))
    while t < ticks * gap_s:
        k = max(1, round(nodes * burst_share * rnd.uniform(0.5, 1.0)))
        down = rnd.expovariate(1 / (mean_down_min * 60))
        for i in range(int(t // gap_s), min(ticks, int((t + down) // gap_s) + 1)):
            gone[i] = max(gone[i], k)
        t += rnd.expovariate(1 / (mean_between_h * 3600))
    counts = [nodes - g for g in gone]
    return _counts_trace(f"bursty-{nodes}n-seed{seed}", counts, gap_s)
