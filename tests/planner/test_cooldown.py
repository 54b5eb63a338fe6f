"""Cool-downs rank, they do not forbid (issue 19): the shared journal -> cool-down code
and the planner's use of it."""

from __future__ import annotations

import pytest

from spotctl.control.cooldown import backoff_s, zone_cooldowns
from spotctl.control.planner import Observed, plan
from tests.planner.helpers import node, offer, spec

NOW = 10_000.0


def ev(t: float, typ: str, zone: str = "r1-a") -> dict[str, object]:
    return {"ts": t, "type": typ, "zone": zone}


def test_backoff_doubles_from_a_minute_up_to_the_cooldown() -> None:
    assert [backoff_s(k, 900) for k in range(1, 7)] == [60, 120, 240, 480, 900, 900]
    assert backoff_s(0, 900) == 0


def test_preemption_cools_a_zone_but_sets_no_backoff() -> None:
    cd = zone_cooldowns([ev(NOW - 10, "preempted")], 900, NOW)
    assert cd.cooling == {"r1-a": NOW - 10 + 900}
    assert cd.blocked == {}


def test_capacity_errors_back_off_doubling_and_a_launch_resets() -> None:
    errs = [ev(NOW - 300, "capacity-error"), ev(NOW - 200, "capacity-error"),
            ev(NOW - 10, "capacity-error")]
    cd = zone_cooldowns(errs, 900, NOW)
    assert cd.failures == {"r1-a": 3}
    assert cd.blocked == {"r1-a": NOW - 10 + 240}
    cd = zone_cooldowns([*errs, ev(NOW - 5, "launch")], 900, NOW)
    assert cd.blocked == {} and cd.failures == {}
    assert cd.cooling == {"r1-a": NOW - 10 + 900}  # still tried last
    # the next error after the reset starts again at a minute
    cd = zone_cooldowns([*errs, ev(NOW - 5, "launch"), ev(NOW - 1, "capacity-error")], 900, NOW)
    assert cd.blocked == {"r1-a": NOW - 1 + 60}


def test_events_after_now_and_other_zones_are_separate() -> None:
    cd = zone_cooldowns([ev(NOW + 5, "capacity-error"), ev(NOW - 1, "capacity-error", "r1-b")],
                        900, NOW)
    assert cd.blocked == {"r1-b": NOW - 1 + 60}


def test_single_zone_cooling_is_still_used_when_capacity_is_back() -> None:
    # the scenario: one zone, it just preempted, its capacity is back
    s = spec("2..3")
    obs = Observed((node("a"), node("b")))
    p = plan(s, obs, [offer("r1-a", available=1)], {}, NOW, cooling={"r1-a": NOW + 900})
    assert [(a.type, a.offer.zone, a.count) for a in p.launches] == [("launch", "r1-a", 1)]
    assert any("cooling down" in n for n in p.notes)
    # a back-off (capacity error a moment ago) does hold it back
    p = plan(s, obs, [offer("r1-a", available=1)], {"r1-a": NOW + 60}, NOW,
             cooling={"r1-a": NOW + 900})
    assert p.launches == []


def test_a_cooling_zone_is_tried_last() -> None:
    s = spec("2..4")
    obs = Observed((node("a"), node("b")))
    cheap_cool = offer("r1-a", price=0.5, available=5)
    dear_warm = offer("r1-b", price=1.0, available=5)
    p = plan(s, obs, [cheap_cool, dear_warm], {}, NOW, cooling={"r1-a": NOW + 1})
    assert [(a.offer.zone, a.count) for a in p.launches] == [("r1-b", 2)]
    # the warm zone falls short: the cooling one fills the rest
    dear_warm = offer("r1-b", price=1.0, available=1)
    p = plan(s, obs, [cheap_cool, dear_warm], {}, NOW, cooling={"r1-a": NOW + 1})
    assert sorted((a.offer.zone, a.count) for a in p.launches) == [("r1-a", 1), ("r1-b", 1)]
    # once the cool-down is over, price ranks again
    p = plan(s, obs, [cheap_cool, dear_warm], {}, NOW, cooling={"r1-a": NOW})
    assert [(a.offer.zone, a.count) for a in p.launches] == [("r1-a", 2)]


def test_a_replacement_never_targets_a_cooling_zone() -> None:
    s = spec("2..2", saving=30)
    obs = Observed((node("a", price=1.0), node("b", price=1.0)))
    cheap = offer("r1-c", price=0.1, available=5)
    assert [a.type for a in plan(s, obs, [cheap], {}, NOW).actions] == ["replace"]
    assert plan(s, obs, [cheap], {}, NOW, cooling={"r1-c": NOW + 1}).actions == []


@pytest.mark.parametrize("typ", ["node-gone", "terminate", "rescale"])
def test_other_events_change_nothing(typ: str) -> None:
    cd = zone_cooldowns([ev(NOW - 1, typ)], 900, NOW)
    assert cd.blocked == {} and cd.cooling == {}


def test_a_refused_multi_instance_launch_halves_instead_of_backing_off() -> None:
    errs = [{"ts": NOW - 2, "type": "capacity-error", "zone": "r1-a", "count": 8}]
    cd = zone_cooldowns(errs, 900, NOW)
    assert cd.caps == {"r1-a": 4} and cd.blocked == {}
    cd = zone_cooldowns([*errs, {**errs[0], "ts": NOW - 1, "count": 4}], 900, NOW)
    assert cd.caps == {"r1-a": 2} and cd.blocked == {}
    assert [o.available for o in cd.offers([offer("r1-a"), offer("r1-b", available=9)])] == [2, 9]
    # a refused single instance backs off; a launch clears cap and back-off
    one = {"ts": NOW - 0.5, "type": "capacity-error", "zone": "r1-a", "count": 1}
    assert zone_cooldowns([*errs, one], 900, NOW).blocked == {"r1-a": NOW - 0.5 + 60}
    cd = zone_cooldowns([*errs, one, ev(NOW - 0.1, "launch")], 900, NOW)
    assert cd.caps == {} and cd.blocked == {}


def test_errors_older_than_the_cooldown_no_longer_count() -> None:
    """The window is `cooldown_s` after the last bad event: the journal's clock (`now`) is
    handed in, so expiry is tested by moving `now`, never by sleeping."""
    old = [ev(NOW - 5000, "capacity-error"), ev(NOW - 4900, "capacity-error"),
           ev(NOW - 4800, "capacity-error"), ev(NOW - 4700, "preempted", "r1-b")]
    # inside the window they count: three in a row back off 60 -> 120 -> 240 s
    then = NOW - 4790
    cd = zone_cooldowns(old, 900, then)
    assert cd.failures == {"r1-a": 3} and cd.blocked == {"r1-a": NOW - 4800 + 240}
    # 900 s after the last of them, nothing is left: no cooling, no back-off, no count
    cd = zone_cooldowns(old, 900, NOW)
    assert (cd.blocked, cd.cooling, cd.failures, cd.caps) == ({}, {}, {}, {})
    # exactly at the end of the window it has run out (cooling means "until", not "through")
    cd = zone_cooldowns(old, 900, NOW - 4800 + 900)
    assert "r1-a" not in cd.cooling and cd.failures == {}
    # a new error after the window starts the back-off afresh at a minute, not at 480 s
    cd = zone_cooldowns([*old, ev(NOW - 1, "capacity-error")], 900, NOW)
    assert cd.failures == {"r1-a": 1} and cd.blocked == {"r1-a": NOW - 1 + 60}
    assert cd.cooling == {"r1-a": NOW - 1 + 900}


def test_an_expired_multi_instance_cap_is_forgotten() -> None:
    # a refusal of 2 long ago capped the zone at 1; a refusal of 8 now caps it at 4, not 0
    errs = [{"ts": NOW - 5000, "type": "capacity-error", "zone": "r1-a", "count": 2},
            {"ts": NOW - 1, "type": "capacity-error", "zone": "r1-a", "count": 8}]
    assert zone_cooldowns(errs[:1], 900, NOW - 4999).caps == {"r1-a": 1}
    assert zone_cooldowns(errs[:1], 900, NOW).caps == {}
    assert zone_cooldowns(errs, 900, NOW).caps == {"r1-a": 4}


# Found by mutmut (scripts/mutants --mutmut --module spotctl/control/cooldown.py): what the
# tests above left open

def test_a_zero_cooldown_never_backs_off() -> None:
    # `[rebalance] cooldown_s = 0`: a refused zone is tried again at once
    assert backoff_s(1, 0) == 0 and backoff_s(5, 0) == 0
    cd = zone_cooldowns([ev(NOW - 1, "capacity-error")], 0, NOW)
    assert cd.blocked == {} and cd.cooling == {}


def test_the_back_off_starts_at_start_s() -> None:
    cd = zone_cooldowns([ev(NOW - 1, "capacity-error")], 900, NOW, start_s=10)
    assert cd.blocked == {"r1-a": NOW - 1 + 10}


def test_an_event_at_now_counts() -> None:
    cd = zone_cooldowns([ev(NOW, "preempted")], 900, NOW)
    assert cd.cooling == {"r1-a": NOW + 900}


def test_events_without_a_zone_are_skipped_not_the_end() -> None:
    evs = [{"ts": NOW - 20, "type": "rescale"}, ev(NOW - 10, "preempted")]
    assert zone_cooldowns(evs, 900, NOW).cooling == {"r1-a": NOW - 10 + 900}


def test_a_launch_in_a_zone_that_never_failed() -> None:
    cd = zone_cooldowns([ev(NOW - 10, "launch"), ev(NOW - 5, "launch", "r1-b")], 900, NOW)
    assert (cd.blocked, cd.cooling, cd.failures, cd.caps) == ({}, {}, {}, {})


def test_halving_an_odd_refusal_rounds_down_and_keeps_the_smaller_cap() -> None:
    err = {"ts": NOW - 3, "type": "capacity-error", "zone": "r1-a", "count": 5}
    cd = zone_cooldowns([err], 900, NOW)
    assert cd.caps == {"r1-a": 2} and isinstance(cd.caps["r1-a"], int)
    # a larger request refused after that halves the cap already learnt, not the request
    cd = zone_cooldowns([err, {**err, "ts": NOW - 1, "count": 16}], 900, NOW)
    assert cd.caps == {"r1-a": 1}


def test_back_off_and_cap_hold_until_their_end_not_through_it() -> None:
    cd = zone_cooldowns([ev(NOW - 60, "capacity-error")], 900, NOW)
    assert cd.blocked == {}  # blocked until NOW - 60 + 60: over at NOW
    cap = {"ts": NOW - 900, "type": "capacity-error", "zone": "r1-a", "count": 4}
    assert zone_cooldowns([cap], 900, NOW).caps == {}
    # a new refusal after the old cool-down ended starts afresh: 8 -> 4, not 2 -> 1
    again = {**cap, "ts": NOW + 1, "count": 8}
    assert zone_cooldowns([cap, again], 900, NOW + 1).caps == {"r1-a": 4}
    # a capacity error cooldown_s after the last back-off ended counts from 1 again
    first = ev(NOW - 1000, "capacity-error")  # backs off until NOW - 940
    cd = zone_cooldowns([first, ev(NOW - 40, "capacity-error")], 900, NOW)
    assert cd.failures == {"r1-a": 1} and cd.blocked == {"r1-a": NOW - 40 + 60}


def test_to_json_sorts_zones_and_rounds_times() -> None:
    # journaled c, b, a: listed a, b, c
    evs = [{"ts": NOW - 3, "type": "capacity-error", "zone": "r1-c", "count": 6},
           ev(NOW - 2.23456, "capacity-error", "r1-b"), ev(NOW - 1, "preempted", "r1-a")]
    out = zone_cooldowns(evs, 900, NOW).to_json()
    assert out == {"blocked": {"r1-b": round(NOW - 2.23456 + 60, 3)},
                   "cooling": {"r1-a": NOW - 1 + 900, "r1-b": round(NOW - 2.23456 + 900, 3),
                               "r1-c": NOW - 3 + 900},
                   "failures": {"r1-b": 1}, "caps": {"r1-c": 3}}
    assert list(out["cooling"]) == ["r1-a", "r1-b", "r1-c"]


def test_a_refusal_at_the_very_end_of_a_cool_down_still_halves_its_cap() -> None:
    """The boundary `cool.get(zone, ts) < ts` (was an accepted survivor): a refusal of 8
    leaves a cap of 4 for the cool-down; one that comes at its last instant halves that
    cap (2), one a second later starts afresh (8 // 2)."""
    first = {"ts": NOW - 900, "type": "capacity-error", "zone": "r1-a", "count": 8}
    at_end = {"ts": NOW, "type": "capacity-error", "zone": "r1-a", "count": 8}
    assert zone_cooldowns([first], 900, NOW - 900).caps == {"r1-a": 4}
    assert zone_cooldowns([first, at_end], 900, NOW).caps == {"r1-a": 2}
    after = {**at_end, "ts": NOW + 1}
    assert zone_cooldowns([first, after], 900, NOW + 1).caps == {"r1-a": 4}


def test_a_placement_group_backs_off_and_is_capped_alone() -> None:
    """kills: cooldown.py `if ev.get("placement")` / `zone = f"{zone}/{ev['placement']}"`
    mutated (the event kept under the zone) and `self.caps.get(o.slot,
    self.caps.get(o.zone))` with either key or the zone fallback dropped (mutmut
    2026-12-07: 10 survivors; only tests/aws/test_placement_fallback.py, 40 s on moto,
    reached them)."""
    from dataclasses import replace

    def pev(t: float, typ: str, placement: str, count: int = 1) -> dict[str, object]:
        return {**ev(t, typ), "placement": placement, "count": count}

    cd = zone_cooldowns([pev(NOW - 10, "capacity-error", "group-1"),
                         pev(NOW - 5, "capacity-error", "group-2", count=6)], 900, NOW)
    # the refused single instance backs off group-1 alone; the refused 6 cap group-2 at 3
    assert cd.blocked == {"r1-a/group-1": NOW - 10 + 60}
    assert cd.caps == {"r1-a/group-2": 3}
    assert set(cd.cooling) == {"r1-a/group-1", "r1-a/group-2"}
    both = replace(offer("r1-a", available=10), placements=("group-1", "group-2"))
    got = {o.placement: o.available for o in cd.offers([both])}
    assert got == {"group-1": 10, "group-2": 3}
    # a cap on the zone itself (a launch without a placement) holds for every placement
    # that has none of its own
    cd = zone_cooldowns([ev(NOW - 5, "capacity-error") | {"count": 4},
                         pev(NOW - 4, "capacity-error", "group-2", count=6)], 900, NOW)
    assert cd.caps == {"r1-a": 2, "r1-a/group-2": 3}
    got = {o.placement: o.available for o in cd.offers([both])}
    assert got == {"group-1": 2, "group-2": 3}
