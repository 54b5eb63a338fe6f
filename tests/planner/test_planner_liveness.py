"""No false recoveries: when a node is declared lost, and when it is not."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotctl.control.liveness import LossDetector, Verdict

pytestmark = pytest.mark.planner


def test_planner_liveness_one_flaky_reply_never_declares_lost() -> None:
    d = LossDetector(lost_after_observations=3, lost_after_s=60)
    t = 0.0
    for _ in range(50):
        assert d.observe("n", seen=True, provider_gone=False, now=t) == Verdict.OK
        t += 300
        assert d.observe("n", seen=False, provider_gone=False, now=t) == Verdict.SUSPECT
        t += 300
    assert d.lost() == []


def test_planner_liveness_needs_both_count_and_span() -> None:
    d = LossDetector(lost_after_observations=3, lost_after_s=60)
    # Many misses within a few seconds (e.g. cron runs piling up): not enough time.
    for i in range(10):
        assert d.observe("n", False, False, 100.0 + i) == Verdict.SUSPECT
    # Long enough, but a new run after a sighting restarts the count.
    assert d.observe("n", True, False, 200.0) == Verdict.OK
    assert d.observe("n", False, False, 300.0) == Verdict.SUSPECT
    assert d.observe("n", False, False, 400.0) == Verdict.SUSPECT
    assert d.observe("n", False, False, 460.0) == Verdict.LOST  # 3 misses over 160 s
    assert "3 consecutive" in d.reason("n")


def test_planner_liveness_provider_gone_is_immediate_and_sticky() -> None:
    d = LossDetector(5, 600)
    assert d.observe("n", seen=True, provider_gone=True, now=0) == Verdict.LOST
    assert d.observe("n", seen=True, provider_gone=False, now=1) == Verdict.LOST
    assert d.lost() == ["n"] and "provider" in d.reason("n")
    d.forget("n")
    assert d.verdict("n") == Verdict.OK and d.lost() == []


def test_planner_liveness_survives_persistence_between_cron_runs() -> None:
    d = LossDetector(3, 60)
    d.observe("a", False, False, 0)
    d.observe("a", False, False, 30)
    d.observe("b", True, False, 30)
    saved = json.loads(json.dumps(d.to_dict()))  # what the reconciler writes to disk
    d2 = LossDetector.from_dict(saved)
    assert d2.verdict("a") == Verdict.SUSPECT
    assert d2.observe("a", False, False, 61) == Verdict.LOST
    # The spec's current thresholds win over the saved ones.
    d3 = LossDetector.from_dict(saved, lost_after_observations=10, lost_after_s=1)
    assert d3.observe("a", False, False, 61) == Verdict.SUSPECT


@pytest.mark.parametrize(
    "junk",
    [
        None,
        "text",
        {"nodes": "x"},
        {"nodes": {"a": "x"}},
        {"nodes": {"a": {"misses": "3", "first_miss": 0}}},
        {"nodes": {"a": {"misses": 99, "first_miss": "yesterday"}}},
        {"nodes": {"a": {"misses": 99}}},
        {"lost_after_observations": "x", "lost_after_s": None, "nodes": {}},
    ],
)
def test_planner_liveness_corrupt_state_delays_instead_of_declaring(junk: object) -> None:
    d = LossDetector.from_dict(junk)  # type: ignore[arg-type]
    assert d.lost() == []
    assert d.observe("a", False, False, 10_000) == Verdict.SUSPECT


def test_planner_liveness_prune_drops_untracked_nodes() -> None:
    d = LossDetector(1, 0)
    d.observe("a", False, True, 0)
    d.observe("b", False, False, 0)
    d.prune({"b"})
    assert d.lost() == ["b"]  # 1 observation over 0 s is enough for this config
    assert "a" not in d.to_dict()["nodes"]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 5),
    span=st.floats(0, 600, allow_nan=False),
    events=st.lists(
        st.tuples(st.booleans(), st.floats(0, 400, allow_nan=False)), min_size=1, max_size=30
    ),
)
def test_planner_liveness_lost_only_on_sufficient_evidence(
    n: int, span: float, events: list[tuple[bool, float]]
) -> None:
    d = LossDetector(n, span)
    now, run_start, run = 0.0, None, 0
    for seen, dt in events:
        now += dt
        v = d.observe("x", seen, False, now)
        if seen:
            run_start, run = None, 0
        else:
            run_start = now if run_start is None else run_start
            run += 1
        if v == Verdict.LOST:
            # Evidence: at least n consecutive misses spanning at least `span` seconds.
            assert run >= n and now - run_start >= span
            return
        assert v == (Verdict.OK if seen else Verdict.SUSPECT)
        assert not (run >= n and run_start is not None and now - run_start >= span)


# Found by mutmut (scripts/mutants --mutmut --module spotctl/control/liveness.py)

def test_planner_liveness_defaults_and_bad_thresholds() -> None:
    d = LossDetector()
    assert (d.lost_after_observations, d.lost_after_s) == (3, 60.0)
    with pytest.raises(ValueError, match="^lost_after_observations must be at least 1$"):
        LossDetector(0)
    with pytest.raises(ValueError, match="^lost_after_s must not be negative$"):
        LossDetector(3, -1)
    # a saved detector without thresholds takes the same defaults; zero/negative are raised
    assert LossDetector.from_dict({}).to_dict()["lost_after_observations"] == 3
    assert LossDetector.from_dict({}).to_dict()["lost_after_s"] == 60.0
    d = LossDetector.from_dict({"lost_after_observations": 0, "lost_after_s": -5})
    assert (d.lost_after_observations, d.lost_after_s) == (1, 0.0)
    d = LossDetector.from_dict({"lost_after_observations": 5, "lost_after_s": 7.5}, 2, 1.0)
    assert (d.lost_after_observations, d.lost_after_s) == (2, 1.0)  # the spec's win
    d = LossDetector.from_dict({"lost_after_observations": 5, "lost_after_s": 7.5})
    assert (d.lost_after_observations, d.lost_after_s) == (5, 7.5)


def test_planner_liveness_state_round_trips_exactly() -> None:
    d = LossDetector(2, 10.0)
    d.observe("gone", seen=False, provider_gone=True, now=1.0)
    d.observe("sus", seen=False, provider_gone=False, now=5.0)
    d.observe("ok", seen=True, provider_gone=False, now=5.0)
    d.observe("lost", seen=False, provider_gone=False, now=1.0)
    d.observe("lost", seen=False, provider_gone=False, now=20.0)
    saved = json.loads(json.dumps(d.to_dict()))
    assert saved == {"lost_after_observations": 2, "lost_after_s": 10.0, "nodes": {
        "gone": {"misses": 0, "first_miss": None, "lost": True,
                 "why": "the provider reports the instance gone"},
        "lost": {"misses": 2, "first_miss": 1.0, "lost": True,
                 "why": "no heartbeat in 2 consecutive observations over 19s"},
        "ok": {"misses": 0, "first_miss": None, "lost": False, "why": ""},
        "sus": {"misses": 1, "first_miss": 5.0, "lost": False, "why": ""}}}
    back = LossDetector.from_dict(saved)
    assert back.to_dict() == saved
    assert [back.verdict(n) for n in ("gone", "lost", "ok", "sus", "new")] == [
        Verdict.LOST, Verdict.LOST, Verdict.OK, Verdict.SUSPECT, Verdict.OK]
    assert back.reason("gone") == "the provider reports the instance gone"
    assert back.reason("sus") == "" and back.reason("new") == ""
    # one more miss of "sus" 10 s after its first: lost (the saved first miss counted)
    assert back.observe("sus", seen=False, provider_gone=False, now=15.0) is Verdict.LOST
    back.forget("nobody")  # forgetting an unknown node is no error
    back.forget("gone")
    assert back.lost() == ["lost", "sus"]


def test_planner_liveness_malformed_saved_nodes_restart_their_evidence() -> None:
    saved = {"nodes": {
        "a": "junk",  # skipped, the rest still read
        "b": {"misses": 2, "first_miss": "x", "lost": 1, "why": "w"},  # bad time, lost not True
        "c": {"misses": 2},  # misses without a first miss
        "c1": {"misses": 1},
        "d": {"misses": True, "first_miss": 3},  # a bool is no count
        "e": {"misses": 1, "first_miss": 4, "lost": True},  # lost without why
        "f": {"misses": -3, "first_miss": 4}}}
    d = LossDetector.from_dict(saved).to_dict()["nodes"]
    assert "a" not in d
    assert d["b"] == {"misses": 0, "first_miss": None, "lost": False, "why": ""}
    assert d["c"] == {"misses": 0, "first_miss": None, "lost": False, "why": ""}
    assert d["c1"] == d["c"]
    assert d["d"] == {"misses": 0, "first_miss": 3.0, "lost": False, "why": ""}
    assert d["e"] == {"misses": 1, "first_miss": 4.0, "lost": True, "why": ""}
    assert d["f"] == {"misses": 0, "first_miss": 4.0, "lost": False, "why": ""}
    assert set(d) == {"b", "c", "c1", "d", "e", "f"}
