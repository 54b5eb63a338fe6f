"""Shared builders for planner tests, and an independent simulator of a plan's end state."""

from __future__ import annotations

from dataclasses import dataclass

from spotctl.control.planner import Action, Observed, ObservedNode, Plan
from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec


def spec(gpus: str = "4..8", budget: float = 0.0, saving: float = 30.0,
         engine: str = "torchrun", spread: bool = True) -> ClusterSpec:
    """A spec for planner tests: the torchrun engine by default, whose nodes may differ
    in size (the torchft engine's plans keep one node size: tests that say so), and
    zones spread over (`[placement] spread_zones`; the default spec's one-zone planning
    is tested with spread=False)."""
    return ClusterSpec.model_validate(
        {
            "name": "t",
            "gpus": gpus,
            "budget": {"max_usd_per_hour": budget},
            "rebalance": {"replace_saving_pct": saving},
            "train": {"engine": engine},
            "placement": {"spread_zones": spread},
        }
    )


def offer(
    zone: str = "r1-a",
    price: float = 1.0,
    gpus: int = 1,
    band: int | None = None,
    available: int | None = None,
    provider: str = "aws",
    itype: str = "",
    gpu: str = "A10G",
) -> Offer:
    region = zone.rsplit("-", 1)[0]
    return Offer(
        provider=provider,
        region=region,
        zone=zone,
        instance_type=itype or f"g{gpus}",
        gpus=gpus,
        gpu_name=gpu,
        spot_price=price,
        on_demand_price=price * 3,
        interruption_band=band,
        available=available,
    )


def node(
    id: str, zone: str = "r1-a", gpus: int = 1, price: float = 1.0, state: str = "running",
    itype: str = "",
) -> ObservedNode:
    return ObservedNode(
        id=id,
        zone=zone,
        region=zone.rsplit("-", 1)[0],
        instance_type=itype or f"g{gpus}",
        gpus=gpus,
        price=price,
        state=state,
    )


@dataclass
class End:
    gpus: int
    cost: float
    launch_zones: list[str]
    launch_regions: set[str]
    drains: int
    removed: set[str]


def launched(a: Action) -> list[Action]:
    """Every launch an action implies (a replace launches, a move launches its list)."""
    if a.type in ("launch", "replace"):
        return [a]
    if a.type == "move":
        return list(a.launches)
    return []


def end_state(observed: Observed, p: Plan) -> End:
    """What the cluster looks like once every action of `p` has completed."""
    live = {n.id: n for n in observed.live}
    gpus = sum(n.gpus for n in live.values())
    cost = sum(n.price for n in live.values())
    zones: list[str] = []
    regions: set[str] = set()
    removed: set[str] = set()
    for a in p.actions:
        for la in launched(a):
            assert la.offer is not None and la.count > 0
            gpus += la.count * la.offer.gpus
            cost += la.count * la.offer.spot_price
            zones.append(la.offer.zone)
            regions.add(la.offer.region)
        if a.type in ("terminate", "replace", "move"):
            for nid in a.node_ids:
                if nid in live and nid not in removed:
                    gpus -= live[nid].gpus
                    cost -= live[nid].price
                removed.add(nid)
    return End(gpus, cost, zones, regions, sum(1 for a in p.actions if a.drain), removed)
