"""One zone and one GPU model per cluster (the default spec), and the opt-outs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotctl.control.planner import Observed, Plan, plan
from spotctl.spec import ClusterSpec

from .helpers import end_state, launched, node, offer, spec
from .test_planner_properties import COMMON, blockeds, is_blocked, observeds, offer_lists, specs
from .test_planner_properties import NOW as PNOW

pytestmark = pytest.mark.planner

NOW = 5_000.0


def zones(p: Plan) -> list[tuple[str, int]]:
    return [(a.offer.zone, a.count) for act in p.actions for a in launched(act)
            if a.offer is not None]


def one_zone(gpus: str, **kw) -> ClusterSpec:
    return spec(gpus, spread=False, **kw)


def test_a_new_cluster_takes_the_cheapest_zone_that_holds_the_plan_alone() -> None:
    offers = [offer("r1-a", 1.0, available=2), offer("r1-b", 1.2, available=9),
              offer("r2-a", 0.1, available=3)]
    p = plan(one_zone("5..5"), Observed(), offers, {}, NOW)
    assert zones(p) == [("r1-b", 5)], p.to_json()
    assert p.region == "r1"
    # spreading (the opt-in) mixes the region's zones for the cheapest $/GPU-h
    p = plan(spec("5..5", spread=True), Observed(), offers, {}, NOW)
    assert zones(p) == [("r1-a", 2), ("r1-b", 3)], p.to_json()


def test_growth_and_repair_stay_in_the_zone_the_nodes_run_in() -> None:
    nodes = (node("a", "r1-b"), node("b", "r1-b"), node("c", "r1-b", state="lost"))
    offers = [offer("r1-a", 0.5), offer("r1-b", 1.0)]
    p = plan(one_zone("4..6"), Observed(nodes), offers, {}, NOW)
    assert [a.type for a in p.actions] == ["terminate", "launch"]
    assert zones(p) == [("r1-b", 4)], p.to_json()


def test_a_replacement_never_leaves_the_zone() -> None:
    nodes = (node("a", "r1-a", price=1.0),)
    p = plan(one_zone("1..1"), Observed(nodes), [offer("r1-b", 0.1)], {}, NOW)
    assert not p.actions, p.to_json()
    p = plan(one_zone("1..1"), Observed(nodes), [offer("r1-b", 0.1), offer("r1-a", 0.5)], {},
             NOW)
    assert [a.type for a in p.actions] == ["replace"] and zones(p) == [("r1-a", 1)]


def test_an_out_of_capacity_zone_waits_and_says_so_instead_of_spreading() -> None:
    nodes = (node("a", "r1-a"), node("b", "r1-a"))
    offers = [offer("r1-a", 0.5), offer("r1-b", 1.0)]
    # launches held back after a capacity error there
    p = plan(one_zone("2..4"), Observed(nodes), offers, {"r1-a": NOW + 60}, NOW)
    assert not p.actions, p.to_json()
    (n,) = [n for n in p.notes if "out of capacity" in n]
    assert "zone r1-a" in n and "capacity error" in n and "r1-b" in n and "spread_zones" in n
    # the zone offers no more instances
    p = plan(one_zone("2..4"), Observed(nodes), [offer("r1-a", 0.5, available=1),
                                                 offer("r1-b", 1.0)], {}, NOW)
    assert zones(p) == [("r1-a", 1)]
    assert any("zone r1-a is out of capacity (no more capacity offered" in n for n in p.notes)
    # nothing to say when no other zone could give more either (here: the budget)
    p = plan(one_zone("2..4", budget=2.0), Observed(nodes), offers, {}, NOW)
    assert not p.launches and not any("out of capacity" in n for n in p.notes), p.notes


def test_a_cooling_zone_is_still_the_clusters_zone() -> None:
    nodes = (node("a", "r1-a"),)
    p = plan(one_zone("2..2"), Observed(nodes), [offer("r1-a", 1.0), offer("r1-b", 0.5)], {},
             NOW, cooling={"r1-a": NOW + 600})
    assert zones(p) == [("r1-a", 1)], p.to_json()
    assert any("r1-a cooling down" in n and "the cluster's zone" in n for n in p.notes), p.notes


def test_below_the_minimum_with_the_zone_out_of_capacity_the_whole_cluster_moves() -> None:
    nodes = (node("a", "r1-a"), node("b", "r1-a", state="lost"))
    p = plan(one_zone("2..2"), Observed(nodes), [offer("r1-a", 0.5), offer("r1-b", 1.0)],
             {"r1-a": NOW + 60}, NOW)
    assert [a.type for a in p.actions] == ["terminate", "move"], p.to_json()
    m = p.actions[1]
    assert m.node_ids == ("a",) and m.drain and "checkpoint" in m.reason
    assert m.reason.startswith("zone r1-a can hold only 1 of minimum 2")
    assert zones(p) == [("r1-b", 2)]
    assert m.to_json()["region"] == m.to_json()["from_region"] == "r1" == p.region


def test_a_new_cluster_prefers_a_zone_that_is_not_cooling() -> None:
    offers = [offer("r1-a", 0.5), offer("r1-b", 1.0)]
    p = plan(one_zone("2..2"), Observed(), offers, {}, NOW, cooling={"r1-a": NOW + 600})
    assert zones(p) == [("r1-b", 2)]
    # ...unless only the cooling zone holds the plan
    p = plan(one_zone("2..2"), Observed(), [offer("r1-a", 0.5), offer("r1-b", 1.0, available=1)],
             {}, NOW, cooling={"r1-a": NOW + 600})
    assert zones(p) == [("r1-a", 2)]


def test_ssh_hosts_are_not_zones() -> None:
    # each ssh host is offered as its own "zone": a cluster of hosts uses them all
    s = ClusterSpec.model_validate({"name": "t", "provider": "ssh", "gpus": "2..2",
                                    "train": {"engine": "torchrun"},
                                    "ssh": {"hosts": [{"address": "h1"}, {"address": "h2"}],
                                            "trusted_network": True}})
    offers = [offer("ssh-h1", 0.0, available=1, provider="ssh"),
              offer("ssh-h2", 0.0, available=1, provider="ssh")]
    assert sorted(zones(plan(s, Observed(), offers, {}, NOW))) == [("ssh-h1", 1), ("ssh-h2", 1)]


# --- one GPU model ---------------------------------------------------------------------


def test_a_new_cluster_takes_one_gpu_model() -> None:
    offers = [offer("r1-a", 1.0, available=2, gpu="A10G", itype="g5"),
              offer("r1-a", 1.5, available=9, gpu="L4", itype="g6")]
    p = plan(one_zone("4..4"), Observed(), offers, {}, NOW)
    assert zones(p) == [("r1-a", 4)] and p.actions[0].offer.gpu_name == "L4", p.to_json()
    assert any("L4 nodes only" in n and "mix_gpus" in n for n in p.notes), p.notes
    mixed = ClusterSpec.model_validate({**one_zone("4..4").model_dump(),
                                        "placement": {"mix_gpus": True}})
    p = plan(mixed, Observed(), offers, {}, NOW)
    assert sorted(a.offer.gpu_name for a in p.launches) == ["A10G", "L4"], p.to_json()


def test_a_running_cluster_keeps_its_gpu_model() -> None:
    nodes = (node("a", itype="g5"), node("b", itype="g5"))
    offers = [offer("r1-a", 1.0, gpu="A10G", itype="g5"),
              offer("r1-a", 0.2, gpu="L4", itype="g6")]
    p = plan(one_zone("4..4"), Observed(nodes), offers, {}, NOW)
    assert [(a.offer.gpu_name, a.count) for a in p.launches] == [("A10G", 2)], p.to_json()
    assert any("A10G nodes only, the model of those running" in n for n in p.notes)
    # and a cheaper model is no replacement either
    p = plan(one_zone("2..2", saving=10.0), Observed(nodes), offers, {}, NOW)
    assert not p.actions, p.to_json()


def test_a_nodes_own_gpu_model_wins_over_its_machine_types() -> None:
    # GCP: n1-standard-8 takes a T4 or a V100; the node says which it has
    from dataclasses import replace

    nodes = tuple(replace(n, gpu_name="T4") for n in (node("a", itype="n1-standard-8"),
                                                      node("b", itype="n1-standard-8")))
    offers = [offer("r1-a", 0.3, gpu="T4", itype="n1-standard-8"),
              offer("r1-a", 1.0, gpu="V100", itype="n1-standard-8")]
    p = plan(one_zone("3..3"), Observed(nodes), offers, {}, NOW)
    assert [(a.offer.gpu_name, a.count) for a in p.launches] == [("T4", 1)], p.to_json()


# --- properties ------------------------------------------------------------------------


@st.composite
def two_model_offers(draw: st.DrawFn) -> list:
    out = draw(offer_lists())
    return [offer(o.zone, o.spot_price, o.gpus, o.interruption_band, o.available,
                  gpu=m, itype=f"{m}-{o.gpus}")
            for o, m in zip(out, draw(st.lists(st.sampled_from(["A10G", "L4"]),
                                               min_size=len(out), max_size=len(out))),
                            strict=True)]


@settings(**COMMON)
@given(specs(), observeds(), two_model_offers(), blockeds())
def test_every_plan_keeps_one_gpu_model_and_one_zone(
    s: ClusterSpec, obs: Observed, offers: list, blocked: dict[str, float]
) -> None:
    s = s.model_copy(update={"placement": s.placement.model_copy(update={"spread_zones": False})})
    model = {o.instance_type: o.gpu_name for o in offers}
    p = plan(s, obs, offers, blocked, PNOW)
    got = [a.offer for act in p.actions for a in launched(act) if a.offer is not None]
    assert len({o.gpu_name for o in got}) <= 1, p.to_json()
    assert len({o.zone for o in got}) <= 1, p.to_json()
    assert not [o for o in got if is_blocked(blocked, o.zone)]
    held: Counter[str] = Counter()
    for n in obs.live:
        if n.instance_type in model:
            held[model[n.instance_type]] += n.gpus
    if held and got:
        assert {o.gpu_name for o in got} == {min(held, key=lambda m: (-held[m], m))}
    end = end_state(obs, p)
    cap = s.budget.max_usd_per_hour or math.inf
    if obs.cost_per_hour <= cap:
        assert end.cost <= cap + 1e-6


@pytest.mark.parametrize("key", ["spread_zones", "mix_gpus", "fast_network"])
def test_a_bad_placement_value_is_one_line_naming_the_key(tmp_path, key: str) -> None:
    from spotctl.errors import SpecError
    from spotctl.spec import load_spec

    (tmp_path / "train.py").write_text("")
    cfg = tmp_path / "spotctl.toml"
    for bad in ('"yes"', "1", "[true]"):
        cfg.write_text(f"[placement]\n{key} = {bad}\n")
        with pytest.raises(SpecError) as e:
            load_spec(cfg)
        msg = str(e.value)
        assert msg.startswith(f"spotctl.toml: placement.{key}: ") and "\n" not in msg, msg
    cfg.write_text(f"[placement]\n{key} = true\n")
    assert getattr(load_spec(cfg).placement, key) is True
