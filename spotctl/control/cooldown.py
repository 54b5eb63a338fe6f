"""Zone cool-downs and launch back-off, derived from a cluster's event journal.

One function, used by the live reconciler (events from the state DB) and by the
simulator (events it journals itself), so both make the same decisions from the same
history. Pure: no I/O, no clock reads.

Rules (cool-downs rank, they do not forbid):

- A zone that preempted a node or refused a launch (capacity error) is *cooling* for
  `cooldown_s` after that event: the planner tries it last, only when no other offer
  reaches the target.
- Capacity errors also set a *back-off*: no launch in that zone before the error time
  plus `start_s` x 2^(k-1) (k = capacity errors in that zone since its last successful
  launch), capped at `cooldown_s`. So a capacity error costs one API call per back-off,
  not a whole cool-down.
- A capacity error for several instances at once (`count` > 1: the cloud refuses the
  whole request) sets no back-off: it *caps* the zone at half that count, so the next try
  (at once, in the same reconcile) asks for less. Only a refused single instance backs
  off. So a zone with k of N free is found in about log2(N) calls, not missed for good.
- A successful launch in a zone resets its back-off (k = 0) and its cap, and a cool-down
  that ran out without a new error forgets both.
- A preemption sets no back-off: capacity that comes back is used at the next reconcile.
- Events that name a `placement` (a launch into one placement group of the zone) are kept
  under zone/placement (Offer.slot): a full placement group backs off alone, and the
  zone's other placements stay usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spotctl.providers.base import Offer

BACKOFF_START_S = 60.0
BAD = ("capacity-error", "preempted")


@dataclass(frozen=True)
class ZoneCooldowns:
    """`blocked`: zone -> no launch before this time (back-off after capacity errors).
    `cooling`: zone -> ranked last until this time. Only entries still in force at `now`."""

    blocked: dict[str, float] = field(default_factory=dict)
    cooling: dict[str, float] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # capacity errors since a launch
    caps: dict[str, int] = field(default_factory=dict)  # zone -> most instances to ask for

    def offers(self, offers: Sequence[Offer]) -> list[Offer]:
        """`offers` with each capped zone's availability lowered to its cap."""
        from spotctl.control.planner import with_placements

        out = []
        for o in with_placements(offers):
            cap = self.caps.get(o.slot, self.caps.get(o.zone))
            if cap is not None and (o.available is None or o.available > cap):
                o = replace(o, available=cap)
            out.append(o)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "blocked": {z: round(t, 3) for z, t in sorted(self.blocked.items())},
            "cooling": {z: round(t, 3) for z, t in sorted(self.cooling.items())},
            "failures": dict(sorted(self.failures.items())),
            "caps": dict(sorted(self.caps.items())),
        }


def backoff_s(failures: int, cooldown_s: float, start_s: float = BACKOFF_START_S) -> float:
    """Back-off after the `failures`-th capacity error in a row (1-based)."""
    if failures <= 0:
        return 0.0
    return min(start_s * 2.0 ** min(failures - 1, 60), max(cooldown_s, 0.0))


def zone_cooldowns(
    events: Iterable[Mapping[str, Any]],
    cooldown_s: float,
    now: float,
    start_s: float = BACKOFF_START_S,
) -> ZoneCooldowns:
    """Fold a journal (dicts with `type`, `ts` and, where it applies, `zone`) into the
    zones cooling down and backing off at `now`. Events after `now` are ignored."""
    failures: dict[str, int] = {}
    retry: dict[str, float] = {}
    cool: dict[str, float] = {}
    caps: dict[str, int] = {}
    for ev in sorted(events, key=lambda e: float(e["ts"])):
        zone, ts, typ = ev.get("zone"), float(ev["ts"]), ev["type"]
        if not zone or ts > now:
            continue
        if ev.get("placement"):  # a launch into one placement of the zone (Offer.slot)
            zone = f"{zone}/{ev['placement']}"
        if typ == "launch":
            failures.pop(zone, None)
            retry.pop(zone, None)
            caps.pop(zone, None)
        elif typ in BAD:
            if cool.get(zone, ts) < ts:  # the last cool-down ran out: start afresh
                caps.pop(zone, None)
            cool[zone] = max(cool.get(zone, ts), ts + cooldown_s)
            count = int(ev.get("count") or 1)
            if typ == "capacity-error" and count > 1:
                caps[zone] = min(caps.get(zone, count), count) // 2
            elif typ == "capacity-error":
                # a cool-down that ran out forgets the old errors
                k = failures.get(zone, 0) + 1 if retry.get(zone, -1e300) + cooldown_s > ts else 1
                failures[zone] = k
                retry[zone] = ts + backoff_s(k, cooldown_s, start_s)
    return ZoneCooldowns(
        blocked={z: t for z, t in retry.items() if t > now},
        cooling={z: t for z, t in cool.items() if t > now},
        failures={z: k for z, k in failures.items() if cool.get(z, 0) > now},
        caps={z: c for z, c in caps.items() if cool.get(z, 0) > now},
    )
