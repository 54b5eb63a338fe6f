"""Property tests: the planner's invariants over random specs, nodes, offers and cool-downs."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spotctl.control.planner import Observed, ObservedNode, Plan, plan
from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec

from .helpers import end_state, launched, node, offer, spec

pytestmark = pytest.mark.planner

NOW = 1_000.0
ZONES = ["r1-a", "r1-b", "r2-a", "r2-b", "r3-a"]
SIZES = [1, 2, 3, 4, 8]


@st.composite
def specs(draw: st.DrawFn) -> ClusterSpec:
    lo = draw(st.integers(1, 16))
    hi = draw(st.integers(lo, 24))
    budget = draw(st.one_of(st.just(0.0), st.floats(0.5, 60, allow_nan=False)))
    saving = draw(st.sampled_from([0.0, 10.0, 30.0, 60.0]))
    # both placements: one zone (the default spec's) and zones spread over the region
    return spec(f"{lo}..{hi}", budget, saving, spread=draw(st.booleans()))


def place(s: ClusterSpec, o: Offer | ObservedNode) -> str:
    """Where a spec keeps its job: one zone, or one region when it spreads."""
    return o.region if s.placement.spread_zones else o.zone


@st.composite
def offer_lists(draw: st.DrawFn) -> list[Offer]:
    out = []
    for _ in range(draw(st.integers(0, 8))):
        g = draw(st.sampled_from(SIZES))
        out.append(
            offer(
                zone=draw(st.sampled_from(ZONES)),
                price=round(g * draw(st.floats(0.0, 3.0, allow_nan=False)), 3),
                gpus=g,
                band=draw(st.one_of(st.none(), st.integers(0, 4))),
                available=draw(st.one_of(st.none(), st.integers(0, 4))),
            )
        )
    return out


@st.composite
def observeds(draw: st.DrawFn) -> Observed:
    # Live nodes share one region, as the planner keeps them; lost/draining ones may not.
    region_zones = draw(st.sampled_from([["r1-a", "r1-b"], ["r2-a", "r2-b"], ["r3-a"]]))
    nodes = []
    for i in range(draw(st.integers(0, 6))):
        state = draw(st.sampled_from(["running"] * 5 + ["pending", "draining", "lost"]))
        zones = region_zones if state in ("running", "pending") else ZONES
        g = draw(st.sampled_from(SIZES))
        nodes.append(
            node(
                f"n{i}",
                zone=draw(st.sampled_from(zones)),
                gpus=g,
                price=round(g * draw(st.floats(0.0, 3.0, allow_nan=False)), 3),
                state=state,
            )
        )
    return Observed(tuple(nodes), drain_in_progress=draw(st.sampled_from([False] * 3 + [True])))


@st.composite
def blockeds(draw: st.DrawFn) -> dict[str, float]:
    zones = draw(st.lists(st.sampled_from(ZONES), unique=True, max_size=len(ZONES)))
    return {z: NOW + draw(st.sampled_from([-100.0, 0.0, 0.5, 100.0])) for z in zones}


def is_blocked(blocked: dict[str, float], zone: str) -> bool:
    return blocked.get(zone, -math.inf) > NOW


def max_gpus(offers: list[Offer], room: int, budget: float) -> int:
    """Oracle: most GPUs (<= room) any mix of these offers buys within the budget.
    Written independently of the planner: a dict of reachable GPU totals -> cheapest cost."""
    best = {0: 0.0}
    for o in offers:
        limit = room // o.gpus if o.available is None else min(o.available, room // o.gpus)
        nxt = dict(best)
        for g0, c0 in best.items():
            for k in range(1, limit + 1):
                g, c = g0 + k * o.gpus, c0 + k * o.spot_price
                if g > room or c > budget + 1e-9:
                    break
                if c < nxt.get(g, math.inf):
                    nxt[g] = c
        best = nxt
    return max(best)


def usable(
    offers: list[Offer], blocked: dict[str, float], region: str, s: ClusterSpec | None = None
) -> list[Offer]:
    """Offers launchable in `region`, or in the place `region` names under spec `s`."""
    return [o for o in offers if (o.region if s is None else place(s, o)) == region
            and not is_blocked(blocked, o.zone)]


# 200 examples each: the branch counters below show every branch is reached well within
# that, and the fast suite (-m "not slow") stays fast
COMMON = dict(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(**COMMON)
@given(specs(), observeds(), offer_lists(), blockeds())
def test_planner_invariants(s: ClusterSpec, obs: Observed, offers: list[Offer], blocked) -> None:
    p = plan(s, obs, offers, blocked, NOW)
    lo, hi = s.gpus.min, s.gpus.max
    cap = s.budget.max_usd_per_hour or math.inf
    have, cost = obs.gpus, obs.cost_per_hour
    end = end_state(obs, p)

    # The plan's own summary agrees with an independent replay of its actions.
    assert p.gpus_after == end.gpus
    assert p.usd_per_hour_after == pytest.approx(end.cost, abs=1e-6)
    # Never exceed the maximum (and only ever shrink toward it when above).
    assert end.gpus <= max(hi, have)
    if have > hi:
        assert end.gpus < have or not p.actions or all(a.type == "terminate" for a in p.actions)
    # Never exceed the budget when within it before.
    if cost <= cap:
        assert end.cost <= cap + 1e-6
    # Never launch in a zone that is cooling down.
    assert not [z for z in end.launch_zones if is_blocked(blocked, z)]
    # At most one drain, none while one is in progress.
    assert end.drains <= 1
    if obs.draining:
        assert end.drains == 0
    assert sum(1 for a in p.actions if a.type in ("replace", "move")) <= 1
    # No plain launch at (or above) the maximum.
    if have >= hi:
        assert not p.launches
    # Never shrink below the minimum (to save money or otherwise).
    if have >= lo:
        assert end.gpus >= lo
    # One region: every launch in one region, the home region unless moving.
    assert len(end.launch_regions) <= 1
    live_regions = {n.region for n in obs.live}
    if end.launch_regions and live_regions and not any(a.type == "move" for a in p.actions):
        assert end.launch_regions == live_regions
    if not s.placement.spread_zones:
        # One zone: every launch in one zone, the home zone (most live GPUs) unless moving.
        assert len(set(end.launch_zones)) <= 1, p.to_json()
        weight: Counter[str] = Counter()
        for n in obs.live:
            weight[n.zone] += n.gpus
        if end.launch_zones and weight and not any(a.type == "move" for a in p.actions):
            assert set(end.launch_zones) == {min(weight, key=lambda z: (-weight[z], z))}
    # Lost nodes are released without a drain.
    lost = {n.id for n in obs.nodes if n.state == "lost"}
    assert lost <= end.removed
    for a in p.actions:
        assert a.reason
        if a.type == "terminate" and set(a.node_ids) & lost:
            assert not a.drain
        if a.type == "replace":
            old = next(n for n in obs.live if n.id == a.node_ids[0])
            assert (
                a.usd_per_hour_added
                <= old.price * (1 - s.rebalance.replace_saving_pct / 100) + 1e-9
            )
            assert a.usd_per_hour_added < old.price
            assert a.gpus_added >= old.gpus
        if a.type == "move":
            assert a.reason and "checkpoint" in a.reason
            assert a.to_json()["via"] == "committed-checkpoint"
            assert set(a.node_ids) == {n.id for n in obs.live}


def test_planner_restores_minimum_when_offers_allow() -> None:
    reached: Counter[str] = Counter()
    _restores_minimum(reached)
    # Both branches below are exercised, not skipped by the generator.
    assert reached["stay"] >= 20 and reached["move"] >= 5, reached


@settings(**COMMON)
@given(specs(), observeds(), offer_lists(), blockeds())
def _restores_minimum(
    reached: Counter[str], s: ClusterSpec, obs: Observed, offers: list[Offer], blocked
) -> None:
    lo, hi = s.gpus.min, s.gpus.max
    cap = s.budget.max_usd_per_hour or math.inf
    have, cost = obs.gpus, obs.cost_per_hour
    assume(not (have > hi or (cost > cap and have > lo)))  # shedding: see the invariants
    p = plan(s, obs, offers, blocked, NOW)
    end = end_state(obs, p)
    # Home: the place (zone, or region when spreading) with the most live GPUs, else
    # where the job last ran (ties: name).
    weight: dict[str, int] = {}
    for n in obs.live or obs.nodes:
        weight[place(s, n)] = weight.get(place(s, n), 0) + n.gpus
    home = {min(weight, key=lambda r: (-weight[r], r))} if weight else set()
    home_best = max(
        (max_gpus(usable(offers, blocked, r, s), hi - have, max(cap - cost, 0.0)) for r in home),
        default=0,
    )
    if have < hi and home and have + home_best >= lo:
        # The home region can hold the minimum: stay, and grow as far as the budget allows.
        assert not any(a.type == "move" for a in p.actions)
        added = sum(a.gpus_added for a in p.launches)
        assert have + added == have + home_best
        reached["stay"] += 1
        return
    elsewhere = [
        r
        for r in sorted({place(s, o) for o in offers} - home)
        if max_gpus(usable(offers, blocked, r, s), hi, cap) >= lo
    ]
    if have < lo and elsewhere and not (obs.draining and obs.live):
        assert end.gpus >= lo, p.to_json()
        went = end.launch_regions if s.placement.spread_zones else set(end.launch_zones)
        assert went and went <= set(elsewhere)
        if home:
            assert [a.type for a in p.actions if a.type != "terminate"] == ["move"]
        reached["move"] += 1


@settings(max_examples=150, deadline=None)
@given(specs(), observeds(), offer_lists(), blockeds(), st.randoms(use_true_random=False))
def test_planner_is_deterministic(
    s: ClusterSpec, obs: Observed, offers: list[Offer], blocked, rnd: random.Random
) -> None:
    first = plan(s, obs, offers, blocked, NOW).to_json()
    assert plan(s, obs, offers, blocked, NOW).to_json() == first
    # Input order does not matter either.
    shuffled_offers = list(offers)
    rnd.shuffle(shuffled_offers)
    nodes = list(obs.nodes)
    rnd.shuffle(nodes)
    again = plan(s, Observed(tuple(nodes), obs.drain_in_progress), shuffled_offers, blocked, NOW)
    assert again.to_json() == first


def test_planner_every_plan_is_json_serialisable() -> None:
    import json

    p: Plan = plan(spec("2..4"), Observed(), [offer(price=0.5)], {}, NOW)
    assert json.loads(json.dumps(p.to_json()))["actions"][0]["type"] == "launch"
    assert launched(p.actions[0]) == [p.actions[0]]


@st.composite
def settled(draw: st.DrawFn) -> tuple[ClusterSpec, Observed]:
    """A cluster at its maximum with every node running in r1: only a replace can happen."""
    nodes = []
    for i in range(draw(st.integers(1, 4))):
        g = draw(st.sampled_from(SIZES))
        price = round(g * draw(st.floats(0.0, 3.0, allow_nan=False)), 3)
        nodes.append(
            node(f"n{i}", zone=draw(st.sampled_from(["r1-a", "r1-b"])), gpus=g, price=price)
        )
    have = sum(n.gpus for n in nodes)
    budget = draw(st.one_of(st.just(0.0), st.floats(0.5, 60, allow_nan=False)))
    saving = draw(st.sampled_from([0.0, 10.0, 30.0, 60.0]))
    return spec(f"{draw(st.integers(1, have))}..{have}", budget, saving), Observed(tuple(nodes))


def test_rebalance_replaces_only_for_the_threshold_and_finds_the_best() -> None:
    reached: Counter[str] = Counter()
    _replaces_for_threshold(reached)
    # The replace branch is reached in a good share of the examples, not just once.
    assert reached["replace"] >= 15 and reached["no_saving"] >= 15, reached


@settings(**COMMON)
@given(settled(), offer_lists(), blockeds())
def _replaces_for_threshold(
    reached: Counter[str], sv: tuple[ClusterSpec, Observed], offers: list[Offer], blocked
) -> None:
    s, obs = sv
    cap = s.budget.max_usd_per_hour or math.inf
    have, cost = obs.gpus, obs.cost_per_hour
    pct = s.rebalance.replace_saving_pct
    assume(cost <= cap)  # over budget: shedding, covered by the invariants
    savings = []
    for n in obs.live:
        for o in usable(offers, blocked, "r1"):
            k = -(-n.gpus // o.gpus)
            new = k * o.spot_price
            if (
                have - n.gpus + k * o.gpus <= s.gpus.max
                and (o.available is None or o.available >= k)
                and new <= n.price * (1 - pct / 100) + 1e-9
                and new < n.price - 1e-9
                and cost - n.price + new <= cap + 1e-9
            ):
                savings.append(n.price - new)
    p = plan(s, obs, offers, blocked, NOW)
    replaces = [a for a in p.actions if a.type == "replace"]
    assert [a.type for a in p.actions] == [a.type for a in replaces]
    if not savings:
        assert not replaces
        reached["no_saving"] += 1
        return
    reached["replace"] += 1
    assert len(replaces) == 1
    a = replaces[0]
    old = next(n for n in obs.live if n.id == a.node_ids[0])
    assert old.price - a.usd_per_hour_added == pytest.approx(max(savings))
    assert a.drain and a.offer is not None and not is_blocked(blocked, a.offer.zone)
    # With a drain in progress, or a node still pending, the same cluster waits.
    assert not plan(s, Observed(obs.nodes, True), offers, blocked, NOW).actions
    pending = Observed((*obs.nodes, node("p", zone="r1-a", gpus=1, state="pending")))
    s2 = spec(
        f"{s.gpus.min}..{have + 1}", s.budget.max_usd_per_hour + (1 if cap < math.inf else 0), pct
    )
    assert not plan(s2, pending, offers, blocked, NOW).actions


# --- the torchft engine: every node one replica group, every group the same size -------


def _torchft(s: ClusterSpec) -> ClusterSpec:
    return s.model_copy(update={"train": s.train.model_copy(update={"engine": "torchft"})})


@settings(**COMMON)
@given(specs(), observeds(), offer_lists(), blockeds())
def test_torchft_plans_launch_one_node_size(
    s: ClusterSpec, obs: Observed, offers: list[Offer], blocked
) -> None:
    """Every launch a torchft plan implies (launch, replace, a move's) has one GPU count:
    with nodes running, theirs (the most-held count when they mix, ties to the smaller)."""
    p = plan(_torchft(s), obs, offers, blocked, NOW)
    sizes = {a.offer.gpus for act in p.actions for a in launched(act) if a.offer is not None}
    assert len(sizes) <= 1, p.to_json()
    held: Counter[int] = Counter()
    for n in obs.live:
        if n.gpus > 0:
            held[n.gpus] += n.gpus
    if held and sizes:
        top = max(held.values())
        assert sizes == {min(g for g in held if held[g] == top)}, (dict(held), p.to_json())


@settings(**COMMON)
@given(specs(), offer_lists(), blockeds())
def test_torchft_new_cluster_gets_the_most_gpus_one_size_allows(
    s: ClusterSpec, offers: list[Offer], blocked
) -> None:
    """A new torchft cluster reaches the minimum whenever offers of one size in one
    place (zone, or region when spreading) can, and then as many GPUs (up to the
    maximum) as the best such size allows."""
    s = _torchft(s)
    lo, hi = s.gpus.min, s.gpus.max
    cap = s.budget.max_usd_per_hour or math.inf
    p = plan(s, Observed(), offers, blocked, NOW)
    end = end_state(Observed(), p)
    best = max((max_gpus([o for o in usable(offers, blocked, r, s) if o.gpus == g], hi, cap)
                for r in {place(s, o) for o in offers} for g in SIZES), default=0)
    if best >= lo:
        assert end.gpus == best, p.to_json()
    else:
        assert end.gpus == 0, p.to_json()
