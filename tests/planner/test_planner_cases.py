"""Table tests: named situations and the plan each must produce."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from spotctl.control.planner import Observed, ObservedNode, Plan, plan
from spotctl.providers.base import Offer
from spotctl.spec import ClusterSpec

from .helpers import end_state, node, offer, spec

pytestmark = pytest.mark.planner

NOW = 5_000.0


@dataclass
class Case:
    name: str
    spec: ClusterSpec
    offers: list[Offer]
    nodes: tuple[ObservedNode, ...] = ()
    blocked: dict[str, float] = field(default_factory=dict)
    drain: bool = False
    # expected: action types in order, then (zone, count) of each launch-like action
    types: list[str] = field(default_factory=list)
    launches: list[tuple[str, int]] = field(default_factory=list)
    gpus_after: int | None = None
    note: str = ""  # a substring one of the notes must contain


def launch_pairs(p: Plan) -> list[tuple[str, int]]:
    out = []
    for a in p.actions:
        subs = a.launches if a.type == "move" else ((a,) if a.offer is not None else ())
        out += [(s.offer.zone, s.count) for s in subs if s.offer is not None]
    return out


CASES = [
    Case(
        "fresh cluster takes the cheapest $/GPU-h region and grows to max",
        spec("2..4"),
        [offer("r1-a", 2.0), offer("r2-a", 1.0), offer("r2-b", 1.5)],
        types=["launch"],
        launches=[("r2-a", 4)],
        gpus_after=4,
    ),
    Case(
        "restore minimum after a preemption, in the same region (not a cheaper one)",
        spec("4..4"),
        [offer("r1-a", 2.0), offer("r2-a", 0.5)],
        nodes=(node("a", "r1-a"), node("b", "r1-a"), node("c", "r1-a", state="lost")),
        types=["terminate", "launch"],
        launches=[("r1-a", 2)],
        gpus_after=4,
    ),
    Case(
        "cooling zone is avoided even when cheapest",
        spec("2..2"),
        [offer("r1-a", 0.5), offer("r1-b", 1.0)],
        nodes=(node("a", "r1-a"),),
        blocked={"r1-a": NOW + 1},
        types=["launch"],
        launches=[("r1-b", 1)],
    ),
    Case(
        "cool-down over: the zone is used again",
        spec("2..2"),
        [offer("r1-a", 0.5), offer("r1-b", 1.0)],
        nodes=(node("a", "r1-a"),),
        blocked={"r1-a": NOW},
        types=["launch"],
        launches=[("r1-a", 1)],
    ),
    Case(
        "budget caps growth above the minimum",
        spec("2..8", budget=3.0),
        [offer("r1-a", 1.0)],
        nodes=(node("a", "r1-a", price=1.0),),
        types=["launch"],
        launches=[("r1-a", 2)],
        gpus_after=3,
        note="budget",
    ),
    Case(
        "budget 0 means no cap",
        spec("2..8", budget=0.0),
        [offer("r1-a", 100.0)],
        types=["launch"],
        launches=[("r1-a", 8)],
    ),
    Case(
        "sizes that do not divide the range: 2x3 instead of greedy 1x4",
        spec("6..6"),
        [offer("r1-a", 2.0, gpus=4), offer("r1-a", 3.0, gpus=3)],
        types=["launch"],
        launches=[("r1-a", 2)],
        gpus_after=6,
    ),
    Case(
        "an 8-GPU offer never overshoots a max of 6",
        spec("1..6"),
        [offer("r1-a", 1.0, gpus=8), offer("r1-b", 1.0, gpus=2)],
        types=["launch"],
        launches=[("r1-b", 3)],
        gpus_after=6,
    ),
    Case(
        "one zone cannot fill the gap alone: mix zones of the region",
        spec("5..5"),
        [
            offer("r1-a", 1.0, available=2),
            offer("r1-b", 1.2, available=9),
            offer("r2-a", 0.1, available=3),
        ],
        types=["launch", "launch"],
        launches=[("r1-a", 2), ("r1-b", 3)],
        gpus_after=5,
    ),
    Case(
        "equal price: the lower interruption band wins",
        spec("1..1"),
        [offer("r1-a", 1.0, band=3), offer("r1-b", 1.0, band=0)],
        types=["launch"],
        launches=[("r1-b", 1)],
    ),
    Case(
        # price outranks band: a worse band never buys a dearer offer (and the band is
        # what breaks the tie above, so this case pins the order of the two keys)
        "cheaper $/GPU-h with a worse band beats dearer with a better band",
        spec("2..2"),
        [offer("r1-b", 1.2, band=0), offer("r1-a", 1.0, band=4)],
        types=["launch"],
        launches=[("r1-a", 2)],
    ),
    Case(
        "no launch at the maximum",
        spec("1..2"),
        [offer("r1-a", 1.0)],
        nodes=(node("a", "r1-a", price=1.0), node("b", "r1-a", price=1.0)),
        types=[],
        note="at maximum",
    ),
    Case(
        "replace a node when the saving passes the threshold",
        spec("1..1", saving=30.0),
        [offer("r1-b", 0.6)],
        nodes=(node("a", "r1-a", price=1.0),),
        types=["replace"],
        launches=[("r1-b", 1)],
        gpus_after=1,
    ),
    Case(
        "no replace when the saving is below the threshold",
        spec("1..1", saving=30.0),
        [offer("r1-b", 0.75)],
        nodes=(node("a", "r1-a", price=1.0),),
        types=[],
    ),
    Case(
        "no replace while a drain is in progress",
        spec("1..1", saving=30.0),
        [offer("r1-b", 0.1)],
        nodes=(node("a", "r1-a", price=1.0),),
        drain=True,
        types=[],
        note="drain",
    ),
    Case(
        "replace picks the node whose replacement saves the most",
        spec("2..2", saving=10.0),
        [offer("r1-b", 0.5)],
        nodes=(node("a", "r1-a", price=1.0), node("b", "r1-a", price=3.0)),
        types=["replace"],
        launches=[("r1-b", 1)],
    ),
    Case(
        "region fully cooling down: move through a checkpoint",
        spec("2..2"),
        [offer("r1-a", 0.5), offer("r2-a", 1.0)],
        nodes=(node("a", "r1-a"), node("b", "r1-a", state="lost")),
        blocked={"r1-a": NOW + 60},
        types=["terminate", "move"],
        launches=[("r2-a", 2)],
        gpus_after=2,
    ),
    Case(
        "region can hold the minimum: no move even if elsewhere is cheaper",
        spec("2..4"),
        [offer("r1-a", 2.0, available=1), offer("r2-a", 0.1)],
        nodes=(node("a", "r1-a"),),
        types=["launch"],
        launches=[("r1-a", 1)],
        gpus_after=2,
    ),
    Case(
        "move waits for a drain in progress",
        spec("2..2"),
        [offer("r2-a", 1.0)],
        nodes=(node("a", "r1-a"),),
        drain=True,
        types=[],
        note="waits for the drain",
    ),
    Case(
        "everything lost and home blocked: resume elsewhere from the last checkpoint",
        spec("1..1"),
        [offer("r1-a", 0.5), offer("r2-a", 1.0)],
        nodes=(node("a", "r1-a", state="lost"),),
        blocked={"r1-a": NOW + 60},
        types=["terminate", "move"],
        launches=[("r2-a", 1)],
    ),
    Case(
        "nowhere holds the minimum: take what home offers",
        spec("4..4"),
        [offer("r1-a", 1.0, available=1)],
        nodes=(node("a", "r1-a"),),
        types=["launch"],
        launches=[("r1-a", 1)],
        note="cannot reach minimum",
    ),
    Case(
        "above the maximum: shed one node, the most expensive per GPU",
        spec("1..2"),
        [],
        nodes=(node("a", "r1-a", price=1.0), node("b", "r1-a", price=3.0), node("c", "r1-a")),
        types=["terminate"],
        gpus_after=2,
    ),
    Case(
        "above budget at the minimum: never shrink below it to save money",
        spec("2..4", budget=1.0),
        [],
        nodes=(node("a", "r1-a", price=1.0), node("b", "r1-a", price=1.0)),
        types=[],
    ),
    Case(
        "above budget above the minimum: shed one node",
        spec("1..4", budget=1.5),
        [],
        nodes=(node("a", "r1-a", price=1.0), node("b", "r1-a", price=1.0)),
        types=["terminate"],
        gpus_after=1,
    ),
    Case(
        "budget too small for any offer: nothing, and say why",
        spec("1..4", budget=0.5),
        [offer("r1-a", 1.0)],
        types=[],
        note="cannot reach minimum",
    ),
]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_planner_case(c: Case) -> None:
    obs = Observed(c.nodes, c.drain)
    p = plan(c.spec, obs, c.offers, c.blocked, NOW)
    assert [a.type for a in p.actions] == c.types, p.to_json()
    assert launch_pairs(p) == c.launches, p.to_json()
    if c.gpus_after is not None:
        assert p.gpus_after == c.gpus_after == end_state(obs, p).gpus
    if c.note:
        assert any(c.note in n for n in p.notes) or any(c.note in a.reason for a in p.actions), (
            p.to_json()
        )
    for a in p.actions:
        assert a.reason


def test_planner_shed_picks_most_expensive_per_gpu() -> None:
    nodes = (node("a", price=1.0), node("b", price=3.0), node("c", price=2.0))
    p = plan(spec("1..2"), Observed(nodes), [], {}, NOW)
    assert p.actions[0].node_ids == ("b",) and p.actions[0].drain


def test_planner_launch_json_shape_is_stable() -> None:
    p = plan(spec("2..2"), Observed(), [offer("r1-a", 0.5, gpus=2, provider="local")], {}, NOW)
    (a,) = p.to_json()["actions"]
    assert a["type"] == "launch"
    assert (a["instance_type"], a["zone"], a["gpus"], a["count"], a["price"]) == (
        "g2",
        "r1-a",
        2,
        1,
        0.5,
    )
    assert a["provider"] == "local" and a["region"] == "r1" and a["reason"]
    json.dumps(p.to_json())


def test_planner_move_json_says_checkpoint_and_names_old_nodes() -> None:
    nodes = (node("a", "r1-a"), node("b", "r1-b"))
    blocked = {"r1-a": NOW + 1, "r1-b": NOW + 1}
    p = plan(
        spec("3..3"), Observed(nodes), [offer("r1-a"), offer("r2-a", provider="gcp")], blocked, NOW
    )
    (m,) = p.to_json()["actions"]
    assert m["type"] == "move" and m["via"] == "committed-checkpoint" and m["drain"]
    assert m["node_ids"] == ["a", "b"]
    assert (m["from_region"], m["region"], m["provider"]) == ("r1", "r2", "gcp")
    assert [(x["type"], x["zone"], x["count"]) for x in m["launches"]] == [("launch", "r2-a", 3)]
    assert p.region == "r2"


def test_planner_cooldown_reason_counts_real_blocked_zone() -> None:
    # A zone blocked until the far future stays avoided for every `now` before that.
    offers = [offer("r1-a", 0.1), offer("r1-b", 5.0)]
    for now in (0.0, NOW, NOW + 899.0):
        p = plan(spec("1..1"), Observed(), offers, {"r1-a": NOW + 900}, now)
        assert launch_pairs(p) == [("r1-b", 1)]
    # ...and the launch's reason names where it goes, not the blocked zone
    (a,) = p.actions
    assert "in r1-b" in a.reason and "r1-a" not in a.reason, a.reason
    p = plan(spec("1..1"), Observed(), offers, {"r1-a": NOW + 900}, NOW + 900)
    assert launch_pairs(p) == [("r1-a", 1)]
    assert "in r1-a" in p.actions[0].reason, p.actions[0].reason
    # every zone blocked: nothing launched, and the plan says why
    p = plan(spec("1..1"), Observed(), offers, {"r1-a": NOW + 900, "r1-b": NOW + 900}, NOW)
    assert not p.actions and any("blocked" in n for n in p.notes), p.notes


def test_planner_large_inputs_grow_to_max_with_the_cheapest_offer() -> None:
    # 1,000 nodes x 500 offers (scripts/bench control times it; no timing assert here).
    nodes = tuple(node(f"n{i}", f"r1-{'ab'[i % 2]}", price=1.0 + i % 7) for i in range(1000))
    offers = [
        offer(f"r{i % 5}-{'abc'[i % 3]}", 0.5 + (i % 11) / 10, gpus=[1, 2, 4, 8][i % 4])
        for i in range(500)
    ]
    p = plan(spec("500..2000", budget=5000.0), Observed(nodes), offers, {}, NOW)
    assert p.gpus_after <= 2000 and p.usd_per_hour_after <= 5000 + 1e-6
    # the budget allows the maximum: grow to it with the cheapest $/GPU-h offer of the
    # nodes' region, one launch
    best = min((o for o in offers if o.region == "r1"), key=lambda o: o.spot_price / o.gpus)
    have, cost = 1000, sum(n.price for n in nodes)
    ((z, count),) = launch_pairs(p)
    (a,) = p.launches
    assert a.offer is not None and a.offer.region == "r1"
    assert a.offer.spot_price / a.offer.gpus == pytest.approx(best.spot_price / best.gpus)
    assert count == (2000 - have) // best.gpus
    assert p.gpus_after == 2000
    assert p.usd_per_hour_after == pytest.approx(cost + count * best.spot_price)


def test_planner_launches_whole_replica_groups() -> None:
    """torchft with nodes_per_replica = 2: a node of a group that is not full trains
    nothing, so launches make whole groups (here 3 offered, 2 launched; with 3 nodes
    live, 2 offered, 1 launched)."""
    sp = ClusterSpec.model_validate({"name": "t", "gpus": "2..8", "train": {
        "engine": "torchft", "nodes_per_replica": 2}, "placement": {"spread_zones": True}})
    p = plan(sp, Observed(), [offer("r1-a", 1.0, available=3)], {}, NOW)
    assert launch_pairs(p) == [("r1-a", 2)], p.actions
    p = plan(sp, Observed(), [offer("r1-a", 1.0, available=2), offer("r1-b", 1.1, available=3)],
             {}, NOW)
    assert sum(n for _, n in launch_pairs(p)) == 4, p.actions
    live = tuple(node(f"n{i}") for i in range(3))  # a group's node is gone
    p = plan(sp, Observed(live), [offer("r1-a", 1.0)], {}, NOW)
    assert launch_pairs(p) == [("r1-a", 5)], p.actions  # to 8: whole
    p = plan(sp, Observed(live), [offer("r1-a", 1.0, available=2)], {}, NOW)
    assert launch_pairs(p) == [("r1-a", 1)], p.actions  # 4, not 5
    # the same offers on the default (one node per group): every node counts
    p = plan(spec("2..8", engine="torchft"), Observed(), [offer("r1-a", 1.0, available=3)],
             {}, NOW)
    assert launch_pairs(p) == [("r1-a", 3)], p.actions


def test_planner_sheds_whole_replica_groups() -> None:
    """Above the maximum with replica groups of 2 nodes: the shed drains a whole group (a
    drained node stops its partner, which would wait, paid for), and before that any node
    of a group that is not full (it trains nothing); never below the minimum."""
    sp = ClusterSpec.model_validate({"name": "t", "gpus": "2..4", "train": {
        "engine": "torchft", "nodes_per_replica": 2}})

    def grouped(nid: str, g: str, price: float = 1.0) -> ObservedNode:
        return dataclasses.replace(node(nid, price=price), group=g)

    six = (grouped("a", "g0"), grouped("b", "g0", 2.0), grouped("c", "g1"),
           grouped("d", "g1"), grouped("e", "g2"), grouped("f", "g2", 1.5))
    p = plan(sp, Observed(six), [offer("r1-a", 1.0)], {}, NOW)
    (a,) = p.actions
    # g0 holds the dearest GPUs per hour; its two nodes go in one drain
    assert a.type == "terminate" and a.drain and a.node_ids == ("a", "b"), p.actions
    assert "replica group g0" in a.reason
    assert (p.gpus_after, p.usd_per_hour_after) == (4, pytest.approx(4.5))
    # a node whose partner is gone (its group is not full) goes first, even if cheaper
    five = (grouped("a", "g0", 0.5),) + six[2:]
    p = plan(sp, Observed(five), [offer("r1-a", 1.0)], {}, NOW)
    assert [x.node_ids for x in p.actions] == [("a",)], p.actions
    # over budget: a whole group too, down to the minimum and no further
    sp2 = ClusterSpec.model_validate({"name": "t", "gpus": "2..4", "budget": {
        "max_usd_per_hour": 1.0}, "train": {"engine": "torchft", "nodes_per_replica": 2}})
    p = plan(sp2, Observed(six[2:]), [offer("r1-a", 1.0)], {}, NOW)
    assert [x.node_ids for x in p.actions] == [("e", "f")], p.actions
    p = plan(sp2, Observed(six[4:]), [offer("r1-a", 1.0)], {}, NOW)
    assert not any(x.type == "terminate" for x in p.actions), p.to_json()
    # one node per group (the default): a single node, as before
    p = plan(spec("2..4", engine="torchft"), Observed(six), [offer("r1-a", 1.0)], {}, NOW)
    assert [x.node_ids for x in p.actions] == [("b",)], p.actions
