"""The capacity planner: a pure function from what is observed to what to do.

`plan(spec, observed, offers, blocked, now) -> Plan`: no I/O, no clock reads, no
randomness (same input, same plan). Every action carries a reason. Rules, in order:

1. Lost nodes are released (terminate; not a drain: they are already out of the job).
2. Above the maximum, or above the budget, shed one node (a drain; with replica groups of
   several nodes, a whole group, after any node of a group that is not full) - never below the
   minimum: the minimum is never given up to save money.
3. Restore the minimum, then grow toward the maximum while the $/h budget allows
   (`spec.budget.max_usd_per_hour`, 0 = no cap). Offers are taken cheapest $/GPU-h
   first, then lowest interruption band; one plan may mix zones of one region (and
   instance sizes) when one offer cannot fill the gap alone (availability, budget, or
   sizes that do not divide the range). GPUs never exceed the maximum.
4. One job lives in one region (network locality). When its region cannot hold the
   minimum (offers missing, too small for the range, over budget, or every zone cooling
   down), plan a "move" to the region (possibly another provider) that can: the job
   stops at a committed checkpoint, the old nodes go, the new ones resume from it.
5. When nothing else is to be done, replace one running node by a cheaper offer when
   the $/h saving reaches `spec.rebalance.replace_saving_pct` (launch new, then drain
   old). At most one drain per plan, and none while a drain is in progress.

Placements: an offer that lists placement choices (base.Offer.placements: on AWS, an EFA
type's cluster placement group of the zone, a second group, none) stands for one offer per
choice, ranked in that order at the same price. Capacity errors back off the choice they
happened in (`blocked` keyed by `Offer.slot`, zone/placement), so launches go to the next
choice and the plan says so in a note; when the first one's back-off ends it ranks first
again, and launches go back to it. Such an error does not cool the zone down.

Cool-downs rank, they do not forbid. Zones with `cooling[zone] > now` (a preemption or a
capacity error there recently) are tried last: only when the other offers cannot reach
the target, and never for a replacement. Zones with `blocked[zone] > now` are not
launched in before that time (the back-off after capacity errors: about a minute,
doubling up to the cool-down, reset by a successful launch). Both come from the event
journal through `spotctl.control.cooldown.zone_cooldowns`, in the reconciler and the
simulator alike.

GPU and budget figures in the invariants refer to the state after the plan completes
(a replace briefly runs old and new side by side until the old node drains).
Cost: O((nodes + offers) log) plus, only when the greedy fill falls short, a small
knapsack over GPU counts (bounded by the maximum and by what the budget can buy).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec

EPS = 1e-9  # float slack for $ comparisons, so 0.1+0.2 never "exceeds" a 0.3 budget
VIA_CHECKPOINT = "committed-checkpoint"


@dataclass(frozen=True)
class ObservedNode:
    id: str
    zone: str
    region: str
    instance_type: str
    gpus: int
    price: float  # USD/h it was launched at
    state: str  # "running" | "pending" | "draining" | "lost"
    # GPU model, where the provider says (GCP: one machine type takes several); "" = the
    # model the offers of its instance type have
    gpu_name: str = ""
    # torchft replica groups of several nodes: the group the head placed it in ("" = none
    # yet, or one node per group)
    group: str = ""


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
        # fsum: exact, so the total (and the notes that print it) never depends on the
        # order the nodes were listed in
        return math.fsum(n.price for n in self.live)

    @property
    def draining(self) -> bool:
        """A drain is under way: the head says so or a node is still leaving."""
        return self.drain_in_progress or any(n.state == "draining" for n in self.nodes)


@dataclass(frozen=True)
class Action:
    """One step of a plan.

    launch:    start `count` instances of `offer`.
    terminate: stop `node_ids` (`drain` says whether they are in the job and must drain).
    replace:   launch `count` x `offer`, then drain `node_ids` (the old node) once it runs.
    move:      commit a checkpoint, drain every node in `node_ids` (the old region), launch
               `launches` in `region`/`provider`; they resume from that checkpoint.
    """

    type: str  # "launch" | "terminate" | "replace" | "move"
    reason: str
    offer: Offer | None = None
    count: int = 0
    node_ids: tuple[str, ...] = ()
    drain: bool = False  # stops nodes that are part of the job (at most one per plan)
    launches: tuple[Action, ...] = ()  # move only: launches in the target region
    region: str = ""  # move only: target region
    provider: str = ""  # move only: target provider
    from_region: str = ""  # move only: the region being left ("" when nothing ran)

    @property
    def gpus_added(self) -> int:
        if self.type == "move":
            return sum(a.gpus_added for a in self.launches)
        return self.count * self.offer.gpus if self.offer is not None else 0

    @property
    def usd_per_hour_added(self) -> float:
        if self.type == "move":
            return math.fsum(a.usd_per_hour_added for a in self.launches)
        return self.count * self.offer.spot_price if self.offer is not None else 0.0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "reason": self.reason}
        if self.offer is not None:
            if self.offer.placement:
                d["placement"] = self.offer.placement
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
        if self.drain:
            d["drain"] = True
        if self.type == "move":
            d.update(
                provider=self.provider,
                region=self.region,
                from_region=self.from_region,
                via=VIA_CHECKPOINT,
                launches=[a.to_json() for a in self.launches],
            )
        return d


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why nothing (more) was done
    region: str = ""  # where the job lives once the plan is done ("" when unknown)
    gpus_before: int = 0
    gpus_after: int = 0
    usd_per_hour_before: float = 0.0
    usd_per_hour_after: float = 0.0
    # replica groups spread over zones: what their syncs' cross-zone traffic costs
    # ([placement] cross_zone_gb_per_hour at the provider's inter-zone rate; 0 = unknown
    # or one zone), on top of the nodes' $/h above
    transfer_usd_per_hour: float = 0.0

    @property
    def launches(self) -> list[Action]:
        return [a for a in self.actions if a.type == "launch"]

    @property
    def drains(self) -> list[Action]:
        return [a for a in self.actions if a.drain]

    def to_json(self) -> dict[str, Any]:
        return {
            "actions": [a.to_json() for a in self.actions],
            "notes": list(self.notes),
            "region": self.region,
            "gpus_before": self.gpus_before,
            "gpus_after": self.gpus_after,
            "usd_per_hour_before": round(self.usd_per_hour_before, 6),
            "usd_per_hour_after": round(self.usd_per_hour_after, 6),
            "transfer_usd_per_hour": round(self.transfer_usd_per_hour, 6),
        }


def offer_rank(o: Offer) -> tuple[float, int, str, str]:
    """Preference order: $/GPU-h, then interruption band (unknown counts as middling)."""
    band = o.interruption_band if o.interruption_band is not None else 2
    return (round(o.price_per_gpu_hour, 6), band, o.zone, o.instance_type)


def with_placements(offers: Sequence[Offer]) -> list[Offer]:
    """One offer per placement choice of each offer that lists several (base.Offer:
    AWS EFA types, the zone's placement group, a second one, none); others as they are."""
    out: list[Offer] = []
    for o in offers:
        if o.placements and not o.placement:
            out += [replace(o, placement=p) for p in o.placements]
        else:
            out.append(o)
    return out


def _placement_rank(o: Offer) -> int:
    """0 for the first placement choice (or an offer without any), then its position."""
    return o.placements.index(o.placement) if o.placement in o.placements else 0


def _total_rank(o: Offer) -> tuple[Any, ...]:
    """offer_rank made total, so the order of `offers` never changes the plan."""
    return (
        *offer_rank(o),
        _placement_rank(o),
        o.spot_price,
        o.gpus,
        o.provider,
        o.region,
        -1 if o.available is None else o.available,
        o.gpu_name,
        o.on_demand_price or 0.0,
        o.gpu_memory_gib,
    )


def _usable(offers: Sequence[Offer], blocked: Mapping[str, float], now: float) -> list[Offer]:
    return sorted(
        (
            o
            for o in offers
            if o.gpus > 0
            and o.spot_price >= 0
            and (o.available is None or o.available > 0)
            and blocked.get(o.zone, -math.inf) <= now
            and blocked.get(o.slot, -math.inf) <= now
        ),
        key=_total_rank,
    )


# --- filling a GPU gap from a region's offers ------------------------------------------


@dataclass(frozen=True)
class _Fill:
    picks: tuple[tuple[Offer, int], ...] = ()  # (offer, count) in preference order
    gpus: int = 0
    cost: float = 0.0


EXACT_ROOM = 1024  # GPUs searched exactly; beyond it greedy fixes the head (bounded time)


def _cap(o: Offer, room: int, budget_left: float, available: int | None) -> int:
    """Most instances of `o` that fit the GPU room, its availability and the budget."""
    n = room // o.gpus
    if available is not None:
        n = min(n, available)
    if o.spot_price > 0 and budget_left < math.inf:
        n = min(n, int((budget_left + EPS) // o.spot_price))
    return max(n, 0)


def _greedy(ranked: Sequence[Offer], room: int, budget_left: float) -> list[int]:
    """Counts per offer, cheapest $/GPU-h first."""
    counts = [0] * len(ranked)
    gpus, cost = 0, 0.0
    for i, o in enumerate(ranked):
        n = _cap(o, room - gpus, budget_left - cost, o.available)
        counts[i] = n
        gpus += n * o.gpus
        cost += n * o.spot_price
        if gpus == room:
            break
    return counts


def _exact(
    ranked: Sequence[Offer], room: int, budget_left: float, limits: Sequence[int | None]
) -> list[int]:
    """Counts per offer: most GPUs (<= room) within the budget, then the cheapest way.

    A bounded knapsack over GPU counts (`limits[i]` instances of offer i at most, None =
    unbounded). Only offers that can matter are kept: per instance size, the cheapest
    ones until their availability covers the room (an unbounded one covers it alone).
    Counts are split in powers of two.
    """
    counts = [0] * len(ranked)
    if budget_left < math.inf:
        ppg = min((o.price_per_gpu_hour for o in ranked), default=0.0)
        if ppg > 0:
            room = min(room, int((budget_left + EPS) / ppg))
    if room <= 0:
        return counts
    covered: dict[int, float] = {}
    items: list[tuple[int, int, int, float]] = []  # (offer index, count, gpus, cost)
    for i, o in enumerate(ranked):  # same size => $/GPU-h order is price order
        if covered.get(o.gpus, 0) >= room // o.gpus:
            continue
        lim = limits[i]
        covered[o.gpus] = covered.get(o.gpus, 0) + (math.inf if lim is None else lim)
        n, k = _cap(o, room, budget_left, lim), 1
        while n > 0:
            t = min(k, n)
            items.append((i, t, t * o.gpus, t * o.spot_price))
            n -= t
            k *= 2
    best = [math.inf] * (room + 1)
    best[0] = 0.0
    took: list[bytearray] = []
    for _, _, w, c in items:
        # 0/1 step over the whole array at C speed: min() keeps the old value on ties (so
        # earlier, preferred offers win), and identity tells which cells took the item.
        old = best[w:]
        new = list(map(min, old, [v + c for v in best[: room + 1 - w]]))
        took.append(bytearray(w) + bytearray(map(operator.is_not, new, old)))
        best = best[:w] + new
    d = max(x for x in range(room + 1) if best[x] < math.inf and best[x] <= budget_left + EPS)
    for j in range(len(items) - 1, -1, -1):
        if took[j][d]:
            i, t, w, _ = items[j]
            counts[i] += t
            d -= w
    return counts


def _as_fill(ranked: Sequence[Offer], counts: Sequence[int]) -> _Fill:
    picks = tuple((o, n) for o, n in zip(ranked, counts, strict=True) if n > 0)
    return _Fill(picks, sum(o.gpus * n for o, n in picks), math.fsum(o.spot_price * n for o, n in picks))


def _fill_last(
    warm: Sequence[Offer], cool: Sequence[Offer], room: int, budget_left: float
) -> _Fill:
    """Fill from `warm` offers; cooling ones (ranked after every warm one) only when the
    warm ones alone fall short."""
    f = _fill(warm, room, budget_left)
    if f.gpus >= room or not cool:
        return f
    g = _fill([*warm, *cool], room, budget_left)
    return g if g.gpus > f.gpus else f


def _fill(ranked: Sequence[Offer], room: int, budget_left: float) -> _Fill:
    """Greedy (cheapest first) when it reaches the room; otherwise an exact search, which
    finds what greedy misses (sizes that don't divide the range, budget edges). For a big
    room, greedy's head is kept and only the last EXACT_ROOM GPUs are searched exactly."""
    if room <= 0 or not ranked:
        return _Fill()
    greedy = _greedy(ranked, room, budget_left)
    g = _as_fill(ranked, greedy)
    if g.gpus == room:
        return g
    head = [0] * len(ranked)
    keep = max(0, g.gpus - EXACT_ROOM // 2) if room > EXACT_ROOM else 0
    got, spent = 0, 0.0
    for i, o in enumerate(ranked):
        n = min(greedy[i], (keep - got) // o.gpus)
        head[i] = n
        got += n * o.gpus
        spent += n * o.spot_price
    limits = [
        None if o.available is None else o.available - h for o, h in zip(ranked, head, strict=True)
    ]
    tail = _exact(ranked, min(room - got, EXACT_ROOM), budget_left - spent, limits)
    e = _as_fill(ranked, [h + t for h, t in zip(head, tail, strict=True)])
    return e if e.gpus > g.gpus else g


def _zone_whole(
    warm: Sequence[Offer], cool: Sequence[Offer], room: int, budget_left: float, group: int,
    held: Mapping[str, int],
) -> _Fill:
    """A fill in which every zone gets whole replica groups of `group` nodes (with the
    `held[zone]` nodes there already): a group's inner all-reduce stays inside its zone.
    A zone that would hold part of a group keeps only whole ones and is capped there; the
    rest is filled again from the other zones (a few rounds: each caps a zone for good)."""
    warm, cool = list(warm), list(cool)
    f = _fill_last(warm, cool, room, budget_left)
    for _ in range(2 * len({o.zone for o in [*warm, *cool]}) + 2):
        per_zone: Counter[str] = Counter()
        for o, n in f.picks:
            per_zone[o.zone] += n
        cut = {z: k for z, n in per_zone.items() if (k := (held.get(z, 0) + n) % group)}
        if not cut:
            return f
        kept: dict[int, int] = {}
        for o, n in reversed(f.picks):  # the last (least preferred) picks of a zone go
            k = min(n, cut.get(o.zone, 0))
            if k:
                cut[o.zone] -= k
            kept[id(o)] = n - k
        whole = [(o, kept[id(o)]) for o, _ in f.picks]
        capped = {o.zone for o, _ in f.picks
                  if (held.get(o.zone, 0) + per_zone[o.zone]) % group}
        warm, cool = ([replace(o, available=kept.get(id(o), 0)) if o.zone in capped else o
                       for o in offs] for offs in (warm, cool))
        f = _fill_last(warm, cool, room, budget_left)
    # rounds used up (budget edges can make a refill pick less than a cap): the last
    # fill's whole groups, without refilling
    return _as_fill([o for o, _ in whole], [n for _, n in whole])


# Data transfer between zones of one region, USD per GB moved (list prices): AWS bills
# $0.01/GB out of the sending zone and $0.01/GB into the receiving one ("Data Transfer
# within the same AWS Region", EC2 on-demand pricing); GCP $0.01/GB between zones of a
# region (VPC network pricing, "VM-to-VM data transfer"). Local zones are emulated: $0.
CROSS_ZONE_USD_PER_GB = {"aws": 0.02, "gcp": 0.01, "local": 0.0}


def _cross_zone_note(spec: ClusterSpec, zones: Sequence[str], groups: int,
                     provider: str) -> tuple[str, float]:
    """The plan's word on replica groups spread over `zones`, and the $/h their syncs'
    traffic adds ([placement] cross_zone_gb_per_hour per group; 0 when unknown)."""
    rate = CROSS_ZONE_USD_PER_GB.get(provider, 0.0)
    gb = spec.placement.cross_zone_gb_per_hour
    what = (f"replica groups spread over zones {', '.join(zones)}: each group stays in its "
            f"zone, their syncs cross zones at {provider}'s ${rate:g}/GB between zones")
    if not gb:
        return (what + " (set [placement] cross_zone_gb_per_hour, one group's sync volume, "
                "to price it per hour)", 0.0)
    usd = gb * groups * rate
    return (what + f": {gb:g} GB/h x {groups} groups = {_money(usd)} on top of the nodes",
            usd)


# --- the plan --------------------------------------------------------------------------


def _money(x: float) -> str:
    return f"${x:.4g}/h"


def _launch_actions(fill: _Fill, have: int, lo: int, hi: int, label: str = "",
                    nodes: int = 0, group: int = 1) -> list[Action]:
    """The fill's launches. With replica groups of `group` nodes (torchft's
    nodes_per_replica), only whole groups: the last launches are cut so that the `nodes`
    there are and those launched make whole groups (a node of a group that is not full
    waits, paid for and training nothing)."""
    picks = list(fill.picks)
    extra = (nodes + sum(n for _, n in picks)) % group if group > 1 else 0
    while extra and picks:
        o, n = picks.pop()
        if n > extra:
            picks.append((o, n - extra))
        extra = max(0, extra - n)
    out: list[Action] = []
    for o, n in picks:
        after = have + n * o.gpus
        why = label or ("restore minimum" if have < lo else "grow toward maximum")
        out.append(
            Action(
                "launch",
                f"{why}: {have}->{after} of {lo}..{hi} GPUs with {n}x {o.instance_type} "
                f"in {o.zone} at ${o.price_per_gpu_hour:.4g}/GPU-h",
                o,
                n,
            )
        )
        have = after
    return out


def _home(observed: Observed, by_zone: bool) -> tuple[str, str]:
    """Where the job lives, (place, region): the place (zone when `by_zone`, else region)
    with the most live GPUs; else where it last ran. ("", "") for a new cluster."""
    weight: dict[tuple[str, str], int] = {}
    for n in observed.live or observed.nodes:
        k = (n.zone if by_zone else n.region, n.region)
        weight[k] = weight.get(k, 0) + n.gpus
    if not weight:
        return "", ""
    return min(weight, key=lambda r: (-weight[r], r))


def _shed_units(observed: Observed, group: int) -> list[tuple[ObservedNode, ...]]:
    """What a shed takes out together. One node per group: each node. Replica groups of
    `group` nodes: a whole group (draining one of its nodes stops the others anyway, and
    they would wait, paid for), and first any node of a group that is not full (it trains
    nothing)."""
    if group <= 1:
        return [(n,) for n in observed.live]
    by_group: dict[str, list[ObservedNode]] = {}
    units: list[tuple[ObservedNode, ...]] = []
    for n in observed.live:
        if n.group:
            by_group.setdefault(n.group, []).append(n)
        else:
            units.append((n,))
    for members in by_group.values():
        if len(members) >= group:
            units.append(tuple(members))
        else:
            units.extend((n,) for n in members)
    return units


def _shed(
    observed: Observed, have: int, cost: float, lo: int, hi: int, cap: float, group: int = 1
) -> Action | None:
    over_max = have > hi

    def rank(u: tuple[ObservedNode, ...]) -> tuple[Any, ...]:
        gpus = sum(n.gpus for n in u)
        price = math.fsum(n.price for n in u)
        return (len(u) >= group > 1, any(n.state != "pending" for n in u),
                -(price / gpus if gpus else 0), -gpus, min(n.id for n in u))

    for u in sorted(_shed_units(observed, group), key=rank):
        gpus = sum(n.gpus for n in u)
        price = math.fsum(n.price for n in u)
        if have - gpus < lo:
            continue
        why = (
            f"above maximum ({have} > {hi} GPUs)"
            if over_max
            else f"above budget ({_money(cost)} > {_money(cap)})"
        )
        ids = tuple(sorted(n.id for n in u))
        what = (f"replica group {u[0].group} ({', '.join(ids)})" if len(u) > 1
                else ids[0])
        return Action(
            "terminate",
            f"{why}: drain {what} ({gpus} GPUs, {_money(price)}); "
            f"{have}->{have - gpus} GPUs, never below minimum {lo}",
            node_ids=ids,
            drain=any(n.state != "pending" for n in u),
        )
    return None


def _replace(
    spec: ClusterSpec,
    observed: Observed,
    ranked: Sequence[Offer],
    have: int,
    cost: float,
    cap: float,
) -> Action | None:
    """Best single replacement: most $/h saved, with at least the node's GPUs."""
    pct = spec.rebalance.replace_saving_pct
    hi = spec.gpus.max
    by_size: dict[int, list[Offer]] = {}
    for o in ranked:
        by_size.setdefault(o.gpus, []).append(o)
    best: tuple[Any, ...] | None = None
    choice: tuple[ObservedNode, Offer, int] | None = None
    for n in sorted(observed.live, key=lambda n: n.id):
        if n.state != "running" or n.gpus <= 0 or n.price <= 0:
            continue
        limit = n.price * (1 - pct / 100.0)
        for size, lst in sorted(by_size.items()):
            k = -(-n.gpus // size)
            if have - n.gpus + k * size > hi:
                continue
            for o in lst:  # same size, so cheapest first
                new = k * o.spot_price
                if new > limit + EPS or new >= n.price - EPS:
                    break  # every later offer of this size costs at least as much
                if o.available is not None and o.available < k:
                    continue
                after = cost - n.price + new
                if after > max(cap, cost) + EPS:
                    continue
                key = (-(n.price - new), n.id, _total_rank(o))
                if best is None or key < best:
                    best, choice = key, (n, o, k)
                break
    if choice is None:
        return None
    n, o, k = choice
    new = k * o.spot_price
    saved = 100.0 * (1 - new / n.price)
    return Action(
        "replace",
        f"{n.id} ({n.instance_type} in {n.zone}, {_money(n.price)}) -> {k}x {o.instance_type} "
        f"in {o.zone} ({_money(new)}): saves {saved:.1f}% >= {pct:g}%; launch first, then "
        "drain the old node",
        o,
        k,
        node_ids=(n.id,),
        drain=True,
    )


def plan(
    spec: ClusterSpec,
    observed: Observed,
    offers: Sequence[Offer],
    blocked: Mapping[str, float],
    now: float,
    cooling: Mapping[str, float] | None = None,
) -> Plan:
    """Decide what to do toward [min, max] GPUs. `blocked` maps zone -> end of its launch
    back-off; `cooling` maps zone -> end of its cool-down (ranked last until then).

    A cluster runs one GPU model (`gpu_name`) unless `[placement] mix_gpus` says
    otherwise: a data-parallel step waits for its slowest replica. On the torchft engine
    every node is one replica group, and the groups must be of one size (the global batch
    is split by replica rank times the group's size): the plan uses nodes of one GPU count
    only. Either choice is that of the nodes running (the most-held one, if a cluster
    mixes them), else the one whose plan reaches the most GPUs, then costs least."""
    by_zone = spec.provider != "ssh" and not spec.placement.spread_zones
    offers = with_placements(offers)

    def sized(offs: Sequence[Offer]) -> Plan:
        def one(g: int) -> Plan:
            return _plan(spec, observed, [o for o in offs if o.gpus == g], blocked, now,
                         cooling, by_zone)

        if spec.train.engine != "torchft":
            return _plan(spec, observed, offs, blocked, now, cooling, by_zone)
        return _one_kind(spec, observed, offs, lambda o: o.gpus, lambda n: n.gpus, one,
                         lambda g, run: f"torchft: {g}-GPU nodes only"
                         f"{', the size of those running' if run else ''} (every replica "
                         "group the same size)")

    if spec.placement.mix_gpus:
        return sized(offers)
    # A node's GPU model, from the offers of its instance type ("" when none is offered
    # now: such a node does not decide the cluster's model).
    model = {o.instance_type: o.gpu_name for o in sorted(offers, key=_total_rank)}
    return _one_kind(
        spec, observed, offers, lambda o: o.gpu_name,
        lambda n: n.gpu_name or model.get(n.instance_type, ""),
        lambda m: sized([o for o in offers if o.gpu_name == m]),
        lambda m, run: f"{m} nodes only{', the model of those running' if run else ''} "
        "(one GPU model per cluster; [placement] mix_gpus = true mixes them)")


def _one_kind(
    spec: ClusterSpec,
    observed: Observed,
    offers: Sequence[Offer],
    of_offer: Callable[[Offer], Any],
    of_node: Callable[[ObservedNode], Any],
    plan_for: Callable[[Any], Plan],
    note: Callable[[Any, bool], str],
) -> Plan:
    """The plan that keeps to one kind of node (`of_offer`/`of_node` say which kind):
    that of the nodes running, else the kind whose plan reaches the most GPUs, then
    costs least."""
    held: Counter[Any] = Counter()
    for n in observed.live:
        if n.gpus > 0 and of_node(n) != "":
            held[of_node(n)] += n.gpus
    kinds = sorted({of_offer(o) for o in offers if o.gpus > 0})
    if held:
        kind = min(held, key=lambda k: (-held[k], k))
        out = plan_for(kind)
    elif len(kinds) <= 1:
        return plan_for(kinds[0] if kinds else None)
    else:
        plans = {k: plan_for(k) for k in kinds}
        kind = min(plans, key=lambda k: (-min(plans[k].gpus_after, spec.gpus.max),
                                         plans[k].usd_per_hour_after, k))
        out = plans[kind]
    if any(k != kind for k in kinds):
        out.notes.append(note(kind, bool(held)))
    return out


def _plan(
    spec: ClusterSpec,
    observed: Observed,
    offers: Sequence[Offer],
    blocked: Mapping[str, float],
    now: float,
    cooling: Mapping[str, float] | None = None,
    by_zone: bool = False,
) -> Plan:
    """One place for the job: one zone when `by_zone` (a new cluster picks the zone; a
    cluster grows and is repaired in its own), else one region whose zones it mixes.
    Leaving the place is a move through a committed checkpoint, as between regions."""
    lo, hi = spec.gpus.min, spec.gpus.max
    cap = spec.budget.max_usd_per_hour or math.inf
    have, cost = observed.gpus, observed.cost_per_hour
    # torchft replica groups of several nodes: launches come in whole groups
    group = spec.train.nodes_per_replica if spec.train.engine == "torchft" else 1
    nodes = len(observed.live)
    home, home_region = _home(observed, by_zone)
    word = "zone" if by_zone else "region"
    held = Counter(n.zone for n in observed.live)

    def fill_from(warm: Sequence[Offer], cool: Sequence[Offer], room: int,
                  budget: float, start: Mapping[str, int]) -> _Fill:
        # zones spread over, groups of several nodes: whole groups in each zone
        if not by_zone and group > 1 and spec.provider != "ssh":
            return _zone_whole(warm, cool, room, budget, group, start)
        return _fill_last(warm, cool, room, budget)

    def place(o: Offer | ObservedNode) -> str:
        return o.zone if by_zone else o.region

    out = Plan(
        region=home_region,
        gpus_before=have,
        gpus_after=have,
        usd_per_hour_before=cost,
        usd_per_hour_after=cost,
    )
    draining = observed.draining

    lost = tuple(sorted(n.id for n in observed.nodes if n.state == "lost"))
    if lost:
        out.actions.append(
            Action("terminate", f"{len(lost)} node(s) declared lost: release them", node_ids=lost)
        )
    strays = sorted({place(n) for n in observed.live} - {home})
    if strays:
        out.notes.append(f"live nodes outside {word} {home} ({', '.join(strays)}) left alone")

    # 2. Shed above the maximum or the budget, one drain at a time, never below minimum.
    if have > hi or (cost > cap + EPS and have > lo):
        if draining:
            out.notes.append("above maximum or budget; waiting for the drain in progress")
            return out
        act = _shed(observed, have, cost, lo, hi, cap, group)
        if act is None:
            out.notes.append(f"above maximum or budget, but shedding would go below {lo} GPUs")
            return out
        out.actions.append(act)
        gone = [n for n in observed.live if n.id in act.node_ids]
        out.gpus_after = have - sum(n.gpus for n in gone)
        out.usd_per_hour_after = cost - math.fsum(n.price for n in gone)
        return out

    usable = _usable(offers, blocked, now)
    cool_zones = {z for z, t in (cooling or {}).items() if t > now}
    regions: dict[str, list[Offer]] = {}  # warm offers per region, best first
    cooled: dict[str, list[Offer]] = {}  # cooling ones, tried after every warm one
    for o in usable:
        (cooled if o.zone in cool_zones else regions).setdefault(place(o), []).append(o)
    for r in cooled:
        regions.setdefault(r, [])
    budget_left = max(cap - cost, 0.0)

    # 3./4. Restore the minimum and grow, in one region; move when it cannot hold the minimum.
    if have >= hi:
        out.notes.append(f"at maximum ({have}/{hi} GPUs)")
    else:
        if home:
            fill = fill_from(regions.get(home, []), cooled.get(home, []), hi - have,
                             budget_left, held)
        else:
            fill = _Fill()
        if home and have + fill.gpus >= lo:
            out.actions += _launch_actions(fill, have, lo, hi, nodes=nodes, group=group)
        else:
            # The home region (if any) cannot hold the minimum: pick the region that can,
            # starting from scratch there (old nodes leave, so the whole budget is free).
            best: tuple[tuple[int, bool, float, str], str, _Fill] | None = None
            for r in sorted(regions):
                if r == home:
                    continue
                f = fill_from(regions[r], cooled.get(r, []), hi, cap, {})
                # a cooling zone only when no other zone reaches as many GPUs (one place
                # per region holds both, so a region is never "cooling" as a whole)
                key = (-f.gpus, by_zone and r in cool_zones, f.cost, r)
                if f.gpus >= lo and (best is None or key < best[0]):
                    best = (key, r, f)
            if best is None:
                # Nowhere holds the minimum: take what home offers (better than nothing).
                if home:
                    out.actions += _launch_actions(fill, have, lo, hi, nodes=nodes,
                                                   group=group)
                if not home or fill.gpus == 0:
                    out.notes.append(
                        "no usable offer (all zones blocked, none offered, or over budget)"
                    )
                out.notes.append(f"cannot reach minimum {lo} GPUs in any region")
            else:
                _, target, f = best
                target_region = f.picks[0][0].region
                if not home:
                    out.region = target_region
                    out.actions += _launch_actions(f, 0, lo, hi, group=group)
                elif draining and observed.live:
                    out.notes.append(
                        f"{word} {home} cannot hold {lo} GPUs; move to {target} "
                        "waits for the drain in progress"
                    )
                else:
                    old = tuple(sorted(n.id for n in observed.live))
                    prov = f.picks[0][0].provider
                    sub = tuple(_launch_actions(f, 0, lo, hi, label=f"move to {target}",
                                                group=group))
                    out.actions.append(
                        Action(
                            "move",
                            f"{word} {home} can hold only {have + fill.gpus} of minimum {lo} "
                            f"GPUs; {target} ({prov}) holds {f.gpus} for {_money(f.cost)}: "
                            "commit a checkpoint, drain the old nodes, resume there",
                            node_ids=old,
                            drain=bool(old),
                            launches=sub,
                            region=target_region,
                            provider=prov,
                            from_region=home_region,
                        )
                    )
                    out.region = target_region
                    out.gpus_after, out.usd_per_hour_after = f.gpus, f.cost
                    return out
        for a in out.launches:
            lo_ = a.offer
            if lo_ is not None and lo_.placement and _placement_rank(lo_) > 0:
                o, first = lo_, lo_.placements[0]
                out.notes.append(
                    f"placement {first} in {o.zone} is backing off after capacity errors: "
                    f"{o.instance_type} launches with placement {o.placement} instead, and "
                    f"back in {first} once its back-off ends")
        late = sorted(
            {a.offer.zone for a in out.launches if a.offer and a.offer.zone in cool_zones}
        )
        if late:
            out.notes.append(
                f"zone(s) {', '.join(late)} cooling down (recent preemption or capacity error): "
                + ("used anyway, it is the cluster's zone (one zone per cluster)" if by_zone
                   else "tried last, since no other offer reaches the target")
            )
        reach = have + sum(a.gpus_added for a in out.launches)
        if lo <= reach < hi:
            limit = f"budget {_money(cap)} or " if cap < math.inf else ""
            out.notes.append(f"{reach}/{hi} GPUs after this plan: {limit}offers allow no more")
        if by_zone and home and reach < hi:
            # say so only when another zone of the region could give more now
            spent = math.fsum(a.usd_per_hour_added for a in out.launches)
            near = [o for o in usable if o.region == home_region and o.zone != home]
            extra = _fill(near, hi - reach, max(budget_left - spent, 0.0))
            others = sorted({o.zone for o, _ in extra.picks})
            if others:
                why = (
                    "launches held back after a capacity error"
                    if blocked.get(home, -math.inf) > now
                    else "no more capacity offered there"
                )
                out.notes.append(
                    f"zone {home} is out of capacity ({why}): waiting there, not spreading "
                    f"to {', '.join(others)} (one zone per cluster; [placement] "
                    "spread_zones = true spreads)"
                )

    if not by_zone and spec.provider != "ssh":
        zones = sorted({n.zone for n in observed.live}
                       | {a.offer.zone for a in out.launches if a.offer})
        if len(zones) > 1:
            launched = sum(a.count for a in out.launches)
            prov = next((a.offer.provider for a in out.launches if a.offer), spec.provider)
            note, out.transfer_usd_per_hour = _cross_zone_note(
                spec, zones, (nodes + launched) // max(group, 1), prov)
            out.notes.append(note)

    # 5. Replace a node by a much cheaper offer, only when the cluster is otherwise settled.
    pending = any(n.state == "pending" for n in observed.live)
    if not out.launches and home and have >= lo:
        if draining:
            out.notes.append("a drain is in progress: no replacement this time")
        elif not pending:
            act = _replace(spec, observed, regions.get(home, []), have, cost, cap)
            if act is not None:
                out.actions.append(act)
                prev = next(n for n in observed.live if n.id == act.node_ids[0])
                out.gpus_after = have - prev.gpus + act.gpus_added
                out.usd_per_hour_after = cost - prev.price + act.usd_per_hour_added
                return out
    out.gpus_after = have + sum(a.gpus_added for a in out.launches)
    out.usd_per_hour_after = math.fsum([cost, *(a.usd_per_hour_added for a in out.launches)])
    return out
