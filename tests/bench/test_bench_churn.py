"""scripts/bench churn, short: a real local cluster of 3 replica groups on the torchft
engine, a notice and a hard kill within a minute, the head's own loop replacing both
nodes. Judged from the replicas' own step records (never the head's events): the
committed share of attempted steps, no step lost at the notice, both victims gone from
the records after their failure, and new processes committing in a full quorum again.
Generous bounds only (a shared 2-core machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import churn  # noqa: E402
from bench_lib.core import Context  # noqa: E402


def test_plan_is_seeded_with_exponential_gaps() -> None:
    a = churn.plan(7, ("notice", "kill"), 15.0, 3600.0)
    assert a == churn.plan(7, ("notice", "kill"), 15.0, 3600.0) != churn.plan(8, ("kill",),
                                                                              15.0, 3600.0)
    gaps = [y - x for (x, _), (y, _) in zip(a, a[1:], strict=False)]
    assert 10.0 < sum(gaps) / len(gaps) < 20.0 and {k for _, k in a} == {"notice", "kill"}
    assert all(t < 3595.0 for t, _ in a)


def test_redone_counts_steps_a_later_quorum_ran_again() -> None:
    def c(q: str, step: int, t: float) -> dict[str, object]:
        return {"t": t, "pid": 1, "q": q, "step": step, "ok": True}

    recs = [c("a", 1, 0), c("a", 2, 1), c("a", 3, 2), c("b", 2, 3), c("b", 3, 4), c("b", 4, 5),
            c("c", 5, 6)]
    assert churn.redone(recs) == {("b", 2), ("b", 3)}


@pytest.mark.slow  # a 3-node local cluster for about a minute and a half
def test_short_churn_commits_and_loses_nothing_at_the_notice(tmp_path: Path) -> None:
    ctx = Context(repeat=1, work=tmp_path / "work", out=tmp_path / "out", quiet=True)
    groups = 3
    s = churn.run_spotctl(ctx, groups, [("short", [(5.0, "notice"), (20.0, "kill")])],
                          duration_s=40.0, ref_s=10.0, seed=1, settle_s=120.0)
    assert not s.error, s.error
    (ph,) = s.phases
    assert [f.kind for f in ph.failures] == ["notice", "kill"], ph
    f = churn.analyse(s.records, ph, churn.samples_per_s(s.records, *s.ref),
                      churn.step_time(s.records, *s.ref), groups)
    json.dumps(f)
    assert f["committed"] >= 50 and f["ratio"] >= 0.9, f
    assert f["lost_at_notices"] == 0, f
    # each victim's replica process logs nothing after its failure (+ the notice's own step)
    for x in ph.failures:
        late = [r for r in s.records if r["pid"] == x.pid and r["t"] > x.t + 5.0]
        assert not late, (x, late[:3])
    # the head's loop replaced what was lost: after the killed replica's last record, a
    # quorum of all groups with none of the victims and at least one new process (the
    # kill may have hit the notice's replacement: it is picked at random)
    assert s.full_again is not None
    victims = {x.pid for x in ph.failures}
    dead = max(r["t"] for r in s.records if r["pid"] == ph.failures[1].pid)
    start = {r["pid"] for r in s.records if r.get("start") and r["t"] > ph.failures[0].t}
    full = {r["pid"] for r in s.records if r.get("ok") and r["replicas"] == groups
            and r["t"] > dead}
    assert len(full) >= groups and full & start and not victims & full, (start, full)
    from spotctl.agent import proctree

    assert proctree.tagged_prefix(str(ctx.work) + "/") == []


def test_analyse_reads_pauses_failed_steps_joins_and_spurious_regroupings() -> None:
    """A synthetic record of 3 replicas, 0.1 s steps, 16 samples each: a notice (C leaves after committing,
    no gap), a kill (B: the step in flight fails, 2 s with no commit), a replacement D
    joining, then the same two members re-forming 30 s after any failure (spurious)."""
    recs: list[dict[str, object]] = []

    def steps(q: str, pids: list[int], first: int, last: int, t0: float) -> float:
        for i, s in enumerate(range(first, last + 1)):
            for j, p in enumerate(pids):  # the replicas' lines a millisecond apart
                recs.append({"t": t0 + 0.1 * i + 0.001 * j, "pid": p, "step": s, "ok": True, "q": q,
                             "replicas": len(pids), "samples": 16})
        return t0 + 0.1 * (last - first)

    for p in (1, 2, 3):
        recs.append({"t": -1.0, "pid": p, "start": True, "step": 0})
    steps("q1", [1, 2, 3], 1, 50, 0.1)  # C (3) noticed at 5.0, commits step 50 and leaves
    steps("q2", [1, 2], 51, 79, 5.1)  # B (2) killed at 8.0: step 80 fails for A
    recs.append({"t": 8.05, "pid": 1, "step": 80, "ok": False, "q": "q2", "replicas": 2,
                 "samples": 16})
    steps("q3", [1], 80, 99, 10.0)  # A alone after 2 s
    recs.append({"t": 11.0, "pid": 4, "start": True, "step": 0})
    steps("q4", [1, 4], 100, 379, 13.0)  # D joins: 1 s more while it heals
    steps("q5", [1, 4], 380, 410, 41.0)  # nothing happened for 30 s: spurious
    recs.sort(key=lambda r: float(r["t"]))  # type: ignore[arg-type]
    ph = churn.Phase("x", 0.0, 44.5, [churn.Failure(5.0, "notice", "n3", 3),
                                      churn.Failure(8.0, "kill", "n2", 2)])
    f = churn.analyse(recs, ph, ref_rate=480.0, step_s=0.1, groups=3)
    assert (f["committed"], f["attempted"]) == (410, 411)
    assert f["lost"] == 0 and f["lost_at_notices"] == 0
    assert f["pauses"] == pytest.approx([0.0, 2.1 - 0.1])
    assert f["regroupings"] == 4 and f["spurious"] == 1
    assert f["replacement_s"] == pytest.approx([13.001 - 5.0])
    w = f["where"]
    assert w["stalls_at_failures_s"] == pytest.approx(2.0) and w["failed_attempts_s"] == 0.1
    assert w["stalls_at_joins_s"] == pytest.approx(1.0) and w["other_stalls_s"] == 0.0
    # 16 samples a replica (bare torchft's way): steps 51..79 and 100..410 short of one
    # replica, 80..99 of two
    assert w["short_of_replicas_s"] == pytest.approx((29 * 16 + 20 * 32 + 311 * 16) / 480.0)
