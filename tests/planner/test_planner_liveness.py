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
