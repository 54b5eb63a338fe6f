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
    # the head's loop replaced both: new processes committed in a quorum of all groups
    assert s.full_again is not None
    victims = {x.pid for x in ph.failures}
    start = {r["pid"] for r in s.records if r.get("start") and r["t"] > ph.failures[0].t}
    full = {r["pid"] for r in s.records if r.get("ok") and r["replicas"] == groups
            and r["t"] > ph.failures[1].t}
    assert len(start & full) >= 2 and not victims & full, (start, full)
    from spotctl.agent import proctree

    assert proctree.tagged_prefix(str(ctx.work) + "/") == []
