"""Deciding that a node is lost, without false alarms.

A replacement costs money and a rescale, so one flaky reply must never trigger one. A
node is declared lost only when
- the provider says the instance is gone (authoritative), or
- its heartbeat has been missing for at least `lost_after_observations` consecutive
  observations that span at least `lost_after_s` seconds (two cron runs in the same
  second do not make two pieces of evidence).
Any observation that sees the node resets its count. Once lost, a node stays lost (the
reconciler has replaced it or is about to; a late heartbeat from it must not undo that)
until `forget` is called for it.

The detector is persisted as a plain dict between cron runs (`to_dict`/`from_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Verdict(str, Enum):
    OK = "ok"  # seen this time
    SUSPECT = "suspect"  # missing, but not for long enough to act on
    LOST = "lost"  # act: the node is gone


@dataclass
class _Track:
    misses: int = 0  # consecutive observations without a heartbeat
    first_miss: float | None = None  # when the current run of misses started
    lost: bool = False
    why: str = ""


class LossDetector:
    """Per-node evidence of loss. `observe` once per node per reconcile."""

    def __init__(self, lost_after_observations: int = 3, lost_after_s: float = 60.0):
        if lost_after_observations < 1:
            raise ValueError("lost_after_observations must be at least 1")
        if lost_after_s < 0:
            raise ValueError("lost_after_s must not be negative")
        self.lost_after_observations = lost_after_observations
        self.lost_after_s = lost_after_s
        self._nodes: dict[str, _Track] = {}

    def observe(self, node_id: str, seen: bool, provider_gone: bool, now: float) -> Verdict:
        t = self._nodes.setdefault(node_id, _Track())
        if t.lost:
            return Verdict.LOST
        if provider_gone:
            t.lost, t.why = True, "the provider reports the instance gone"
            return Verdict.LOST
        if seen:
            t.misses, t.first_miss = 0, None
            return Verdict.OK
        t.misses += 1
        if t.first_miss is None:
            t.first_miss = now
        span = now - t.first_miss
        if t.misses >= self.lost_after_observations and span >= self.lost_after_s:
            t.lost = True
            t.why = f"no heartbeat in {t.misses} consecutive observations over {span:.0f}s"
            return Verdict.LOST
        return Verdict.SUSPECT

    def verdict(self, node_id: str) -> Verdict:
        t = self._nodes.get(node_id)
        if t is None or (t.misses == 0 and not t.lost):
            return Verdict.OK
        return Verdict.LOST if t.lost else Verdict.SUSPECT

    def reason(self, node_id: str) -> str:
        """Why the node was declared lost ("" when it was not)."""
        t = self._nodes.get(node_id)
        return t.why if t is not None and t.lost else ""

    def lost(self) -> list[str]:
        return sorted(n for n, t in self._nodes.items() if t.lost)

    def forget(self, node_id: str) -> None:
        """Drop a node (terminated and journaled): its id may not come back as evidence."""
        self._nodes.pop(node_id, None)

    def prune(self, keep: set[str] | frozenset[str]) -> None:
        """Forget every node not in `keep` (the ids the reconciler still tracks)."""
        for n in [n for n in self._nodes if n not in keep]:
            del self._nodes[n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "lost_after_observations": self.lost_after_observations,
            "lost_after_s": self.lost_after_s,
            "nodes": {
                n: {"misses": t.misses, "first_miss": t.first_miss, "lost": t.lost, "why": t.why}
                for n, t in sorted(self._nodes.items())
            },
        }

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any] | None,
        lost_after_observations: int | None = None,
        lost_after_s: float | None = None,
    ) -> LossDetector:
        """Restore a saved detector. The thresholds given here (from the current spec) win
        over the saved ones. A malformed entry restarts that node's evidence from zero:
        the error then delays a verdict instead of inventing one."""
        data = data if isinstance(data, dict) else {}
        n_obs = lost_after_observations or _int(data.get("lost_after_observations"), 3)
        span = lost_after_s if lost_after_s is not None else _float(data.get("lost_after_s"), 60.0)
        d = cls(max(n_obs, 1), max(span, 0.0))
        nodes = data.get("nodes")
        for node_id, raw in (nodes if isinstance(nodes, dict) else {}).items():
            if not isinstance(raw, dict):
                continue
            first = raw.get("first_miss")
            misses = _int(raw.get("misses"), 0)
            lost = raw.get("lost") is True
            if first is not None and not isinstance(first, int | float):
                first, misses = None, 0
            if misses > 0 and first is None:
                misses = 0
            d._nodes[str(node_id)] = _Track(
                misses=max(misses, 0),
                first_miss=float(first) if first is not None else None,
                lost=lost,
                why=str(raw.get("why", "")) if lost else "",
            )
        return d


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _float(v: Any, default: float) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default
