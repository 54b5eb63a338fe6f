"""Placement groups that fill up: after capacity errors in the zone's cluster placement
group, the planner launches into a second group (then none), says so in the plan and in
each node's network (status), and goes back to the first group once its back-off ends.

The whole path is real: the AWS provider's offers, the pure planner over the journal's
back-offs (spotctl/control/cooldown.py), the reconciler's launch and journal, and the moto
stand-in, whose placement groups hold only `GROUP_ROOM` live instances and answer
InsufficientInstanceCapacity beyond (EC2 User Guide, "Placement groups": adding instances
to a cluster placement group later often meets an insufficient capacity error)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spotctl.control import reconcile, status
from spotctl.control.cooldown import zone_cooldowns
from spotctl.control.planner import Observed, ObservedNode, Plan, plan
from spotctl.providers.aws.provider import AwsProvider
from spotctl.state import Store

from . import ec2_placement

pytestmark = pytest.mark.aws

ZONE = "us-east-1a"


class _LaunchOnly:
    """The provider as the reconciler's launch sees it, without bootstrap (no SSH here)."""

    def __init__(self, p: AwsProvider):
        self.launch = p.launch


@pytest.fixture
def room() -> Iterator[dict[str, int]]:
    yield ec2_placement.GROUP_ROOM
    ec2_placement.GROUP_ROOM.clear()


def test_a_full_placement_group_falls_back_then_comes_back(
    make_provider: Callable[..., AwsProvider], home: Any, ec2: Any, room: dict[str, int]
) -> None:
    p = make_provider(instance_types=["p4d.24xlarge"], zones=[ZONE])
    spec = p.ctx.spec.model_copy(update={"gpus": p.ctx.spec.gpus.model_copy(
        update={"min": 16, "max": 16})})
    name = spec.name
    store = Store()
    store.upsert_cluster(name, "aws", spec.model_dump(mode="json"), "up")
    first, second = f"spotctl-{name}-{ZONE}", f"spotctl-{name}-{ZONE}-2"
    room[first] = 1  # the first group takes one node, then EC2 says no

    def plan_at(t: float) -> Plan:
        obs = Observed(tuple(
            ObservedNode(i.id, i.zone, "us-east-1", i.instance_type, i.gpus, i.price, i.state)
            for i in p.list(name)))
        cd = zone_cooldowns(store.events(name), spec.rebalance.cooldown_s, t)
        return plan(spec, obs, cd.offers(p.offers()), cd.blocked, t, cooling=cd.cooling)

    def run(pl: Plan) -> list[bool]:
        res = reconcile.ReconcileResult(cluster=name, plan=pl)
        return [reconcile._launch(store, spec, _LaunchOnly(p), a, None, res,
                                  lambda *_: None) for a in pl.launches]

    # 1. two nodes into the first group: refused whole (room for one)
    pl = plan_at(time.time())
    assert [(a.count, a.offer.placement) for a in pl.launches] == [(2, "group-1")]
    assert pl.to_json()["actions"][0]["placement"] == "group-1"
    assert run(pl) == [False]
    (err,) = [e for e in store.events(name) if e["type"] == "capacity-error"]
    assert err["placement"] == "group-1" and "InsufficientInstanceCapacity" in err["error"]
    # 2. one into the first group (its room), one into the second: the plan says so
    pl = plan_at(time.time() + 1)
    assert sorted((a.count, a.offer.placement) for a in pl.launches) == [
        (1, "group-1"), (1, "group-2")]
    assert any("launches with placement group-2 instead" in n for n in pl.notes), pl.notes
    assert run(pl) == [True, True]
    placed = {str(r["Placement"].get("GroupName", "")) for r in _raw(ec2, p, name)}
    assert placed == {first, second}
    # ... and status says which node is where
    for inst in p.list(name):
        store.upsert_node(reconcile._row(inst, name, "aws"))
    nets = sorted(n["network"] for n in status.collect(store, name)["nodes"])
    assert nets == ["efa4", "efa4, second placement group"]
    # 3. the second group's node goes; its replacement tries the first group (full now),
    # is refused, and the back-off sends the next try to the second group
    (gone,) = [i.id for i in p.list(name) if "second" in i.meta["network"]]
    p.terminate([gone])
    pl = plan_at(time.time() + 2)
    assert [(a.count, a.offer.placement) for a in pl.launches] == [(1, "group-1")]
    assert run(pl) == [False]
    t = time.time() + 3
    pl = plan_at(t)
    assert [(a.count, a.offer.placement) for a in pl.launches] == [(1, "group-2")]
    assert any("placement group-1 in us-east-1a is backing off" in n for n in pl.notes)
    # 4. capacity returns to the first group: once its back-off ends, launches go back
    room[first] = 2
    later = t + 120
    pl = plan_at(later)
    assert [(a.count, a.offer.placement) for a in pl.launches] == [(1, "group-1")]
    assert not any("backing off" in n for n in pl.notes)
    assert run(pl) == [True]
    assert sorted(str(r["Placement"].get("GroupName", "")) for r in _raw(ec2, p, name)) == [
        first, first]
    assert p.cleanup() == []


def _raw(ec2: Any, p: AwsProvider, name: str) -> list[dict[str, Any]]:
    ids = [i.id for i in p.list(name)]
    return [i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"]
            for i in r["Instances"]]
