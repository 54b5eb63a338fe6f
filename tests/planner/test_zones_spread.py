"""Issue 61, placement across zones: with `[placement] spread_zones = true` the torchft
engine's replica groups may live in different zones, each group inside one zone, and the
plan prices the groups' cross-zone sync traffic. Without the opt-in the job waits in its
zone as before."""

from __future__ import annotations

from collections import Counter

import pytest

from spotctl.control.planner import CROSS_ZONE_USD_PER_GB, Observed, Plan, plan
from spotctl.spec import ClusterSpec

from .helpers import launched, node, offer

pytestmark = pytest.mark.planner

NOW = 5_000.0


def ft_spec(spread: bool, per_replica: int = 1, gb_per_hour: float = 0.0) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": "t", "gpus": f"{2 * per_replica}..{6 * per_replica}",
        "train": {"engine": "torchft", "nodes_per_replica": per_replica},
        "placement": {"spread_zones": spread, "cross_zone_gb_per_hour": gb_per_hour}})


def launches(p: Plan) -> Counter[str]:
    c: Counter[str] = Counter()
    for act in p.actions:
        for a in launched(act):
            assert a.offer is not None
            c[a.offer.zone] += a.count
    return c


def test_a_dry_zone_grows_the_job_in_another_only_with_the_opt_in() -> None:
    # the job runs 2 one-node groups in r1-a, which has no capacity left; r1-b has 4
    running = Observed((node("n1", "r1-a"), node("n2", "r1-a")))
    offers = [offer("r1-a", available=0), offer("r1-b", available=4)]

    waits = plan(ft_spec(spread=False), running, offers, {}, NOW)
    assert launches(waits) == Counter()
    assert any("waiting there, not spreading to r1-b" in n for n in waits.notes), waits.notes
    assert waits.transfer_usd_per_hour == 0

    grows = plan(ft_spec(spread=True, gb_per_hour=50.0), running, offers, {}, NOW)
    assert launches(grows) == Counter({"r1-b": 4})
    assert grows.gpus_after == 6
    # 6 groups x 50 GB/h each at AWS's $0.02/GB between zones (out of one, into the other)
    assert grows.transfer_usd_per_hour == pytest.approx(6 * 50 * CROSS_ZONE_USD_PER_GB["aws"])
    note = next(n for n in grows.notes if "replica groups spread over zones" in n)
    assert "r1-a, r1-b" in note and "$0.02/GB" in note and "$6/h" in note, note
    assert grows.to_json()["transfer_usd_per_hour"] == pytest.approx(6.0)


def test_each_replica_group_stays_inside_one_zone() -> None:
    # groups of 2 nodes; r1-a holds 1 more node, r1-b 5: a group straddling both would
    # run its inner all-reduce across zones. Only r1-b's two whole groups are launched.
    offers = [offer("r1-a", available=1), offer("r1-b", available=5)]
    p = plan(ft_spec(spread=True, per_replica=2), Observed(), offers, {}, NOW)
    assert launches(p) == Counter({"r1-b": 4})
    assert not any("spread over zones" in n for n in p.notes)  # one zone: no cross traffic

    # a running group in r1-a (n1, n2): r1-a's one spare node cannot make a group, r1-b's
    # three make one, and the plan names the cross-zone price without a volume
    running = Observed((node("n1", "r1-a"), node("n2", "r1-a")))
    offers = [offer("r1-a", available=1), offer("r1-b", available=3)]
    p = plan(ft_spec(spread=True, per_replica=2), running, offers, {}, NOW)
    assert launches(p) == Counter({"r1-b": 2})
    assert p.transfer_usd_per_hour == 0
    assert any("set [placement] cross_zone_gb_per_hour" in n for n in p.notes), p.notes

    # room in both: each zone gets whole groups (r1-a's third spare node would be half
    # of one), and the rest comes from r1-b
    offers = [offer("r1-a", available=3), offer("r1-b", available=5)]
    p = plan(ft_spec(spread=True, per_replica=2), running, offers, {}, NOW)
    assert launches(p) == Counter({"r1-a": 2, "r1-b": 4})
