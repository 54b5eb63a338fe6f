"""The capacity planner: a pure function from what is observed to what to do.

`plan(spec, observed, offers, blocked, now) -> Plan`: no I/O, no clock reads, no
randomness. Every action carries a reason. Rules, in order:
1. restore the minimum GPUs; 2. grow toward the maximum within the budget;
prefer lower $/GPU-h, then lower interruption band; keep the job in one region;
skip zones that are cooling down after a capacity error or a preemption.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec


@dataclass(frozen=True)
class ObservedNode:
    id: str
    zone: str
    region: str
    instance_type: str
    gpus: int
    price: float  # USD/h it was launched at
    state: str  # "running" | "pending" | "draining" | "lost"


@dataclass(frozen=True)
class Observed:
    nodes: tuple[ObservedNode, ...] = ()
    drain_in_progress: bool = False

    @property
    def live(self) -> tuple[ObservedNode, ...]:
        """Nodes that count toward capacity (a draining node is on its way out)."""
        return tuple(n for n in self.nodes if n.state in ("running", "pending"))

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.live)

    @property
    def cost_per_hour(self) -> float:
        return sum(n.price for n in self.live)


@dataclass(frozen=True)
class Action:
    type: str  # "launch" | "terminate" | "replace" | "move"
    reason: str
    offer: Offer | None = None
    count: int = 0
    node_ids: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "reason": self.reason}
        if self.offer is not None:
            d.update(
                provider=self.offer.provider,
                region=self.offer.region,
                instance_type=self.offer.instance_type,
                zone=self.offer.zone,
                gpus=self.offer.gpus,
                count=self.count,
                price=self.offer.spot_price,
                price_per_gpu_hour=round(self.offer.price_per_gpu_hour, 6),
            )
        if self.node_ids:
            d["node_ids"] = list(self.node_ids)
        return d


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why nothing (more) was done

    @property
    def launches(self) -> list[Action]:
        return [a for a in self.actions if a.type == "launch"]

    def to_json(self) -> dict[str, Any]:
        return {"actions": [a.to_json() for a in self.actions], "notes": list(self.notes)}


def offer_rank(o: Offer) -> tuple[float, int, str, str]:
    band = o.interruption_band if o.interruption_band is not None else 2
    return (round(o.price_per_gpu_hour, 6), band, o.zone, o.instance_type)


def _usable(offers: Sequence[Offer], blocked: Mapping[str, float], now: float) -> list[Offer]:
    return sorted(
        (o for o in offers if o.gpus > 0 and blocked.get(o.zone, -math.inf) <= now),
        key=offer_rank,
    )


def plan(
    spec: ClusterSpec,
    observed: Observed,
    offers: Sequence[Offer],
    blocked: Mapping[str, float],
    now: float,
) -> Plan:
    """Decide launches toward [min, max] GPUs. `blocked` maps zone -> cool-down end time."""
    out = Plan()
    have = observed.gpus
    lo, hi = spec.gpus.min, spec.gpus.max
    budget = spec.budget.max_usd_per_hour or math.inf
    cost = observed.cost_per_hour
    usable = _usable(offers, blocked, now)
    live_regions = {n.region for n in observed.live}
    if live_regions:
        region = sorted(live_regions)[0]
        usable = [o for o in usable if o.region == region]
    elif usable:
        region = usable[0].region
        usable = [o for o in usable if o.region == region]
    if have >= hi:
        out.notes.append(f"at maximum ({have}/{hi} GPUs)")
        return out
    if not usable:
        out.notes.append("no usable offer (all zones blocked or none offered)")
        return out
    for o in usable:
        if have >= hi:
            break
        room = hi - have
        n = room // o.gpus
        if n <= 0:
            continue
        if budget < math.inf:
            n = min(n, int((budget - cost + 1e-9) // o.spot_price) if o.spot_price > 0 else n)
        if n <= 0:
            continue
        reason = "restore minimum" if have < lo else "grow toward maximum"
        out.actions.append(Action("launch", f"{reason} ({have}->{have + n * o.gpus} of "
                                  f"{lo}..{hi} GPUs)", o, n))
        have += n * o.gpus
        cost += n * o.spot_price
        # One offer per plan: the cheapest that fits; the next reconcile grows further.
        break
    if have < lo:
        out.notes.append(f"cannot reach minimum {lo} GPUs within budget/offers")
    return out


def plan_to_json(p: Plan) -> dict[str, Any]:
    return p.to_json()


def observed_to_json(o: Observed) -> dict[str, Any]:
    return {"nodes": [asdict(n) for n in o.nodes], "drain_in_progress": o.drain_in_progress}
