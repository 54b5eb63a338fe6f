"""`spotctl report`'s figures computed exactly from a small journal (spotctl.control.report.
build): the world-size series with pauses cut out, GPU-hours that trained (from the samples,
and from the journal without them), steps, pauses measured or not, and the plot's marks.
tests/unit/test_report.py has the same run's totals and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.control import report as rp
from spotctl.head.samples import SAMPLES_FILE
from spotctl.state import Store
from tests.unit.test_report import T0, node
from tests.unit.test_report import store as store  # noqa: F401  (the fixture)


def test_world_series_and_marks_whole(store: Store) -> None:  # noqa: F811
    rep = rp.build(store, "r", now=T0 + 10_000)
    assert rep.world == [(T0 + 10, 3), (T0 + 160, 0), (T0 + 165, 2), (T0 + 304, 0),
                         (T0 + 310, 1), (T0 + 426, 0), (T0 + 430, 2), (T0 + 600, 0)]  # fmt: skip
    assert rep.offered == [(T0, 3), (T0 + 200, 2), (T0 + 400, 3)]
    assert rep.usd_per_hour == [(T0, 1.5), (T0 + 200, 1.0), (T0 + 400, 1.5)]
    assert (rep.cluster, rep.provider, rep.state) == ("r", "local", "down")
    assert len(rep.samples) == 60
    assert rep.marks == {
        "notice": [{"ts": T0 + 150, "node": "n2"}],
        "hard-loss": [{"ts": T0 + 300, "node": "n3", "why": "node-unresponsive"}],
        "rescale": [
            {"ts": T0 + 165, "from": 3, "to": 2, "reason": "notice", "lost_steps": 0, "pause_s": 5.0},
            {"ts": T0 + 310, "from": 2, "to": 1, "reason": "failure", "lost_steps": 7, "pause_s": 6.0},
            {"ts": T0 + 430, "from": 1, "to": 2, "reason": "join", "lost_steps": 0, "pause_s": 4.0},
        ],
        "join": [{"ts": T0 + 420, "node": "n4"}],
    }  # fmt: skip


def test_gpu_hours_that_trained_from_samples_and_from_the_journal(store: Store) -> None:  # noqa: F811
    t = rp.build(store, "r").totals
    # samples every 10 s, the step advancing in each: 16 intervals at 3, 15 at 2, 12 at 1,
    # 16 at 2 (the world size of each interval's first sample)
    assert t.gpu_hours_training == round((16 * 3 + 15 * 2 + 12 * 1 + 16 * 2) * 10 / 3600, 6)
    assert t.gpu_hours_offered == round(1600 / 3600, 6)
    assert t.goodput_pct == round(100 * t.gpu_hours_training / t.gpu_hours_offered, 1)
    assert (t.steps, t.spent_usd) == (590, round(1600 * 0.5 / 3600, 6))
    # without samples: the journal's world series, pauses cut out
    (store.cluster_dir("r").head_dir / SAMPLES_FILE).unlink()
    t = rp.build(store, "r").totals
    trained = 3 * 150 + 2 * (304 - 165) + 1 * (426 - 310) + 2 * (600 - 430)
    assert t.gpu_hours_training == round(trained / 3600, 6)
    assert t.steps == 140  # the drain's committed step: the highest step the journal names


def small(tmp_path: Path, events: list[tuple[float, str, dict]], samples: list[dict],
          state: str = "down") -> Store:  # fmt: skip
    s = Store(tmp_path / "home")
    s.upsert_cluster("r", "local", {"name": "r"}, state)
    s.upsert_node(node(1, 0, None, gpus=2))
    for ts, typ, data in events:
        s.add_event("r", typ, data, ts=T0 + ts)
    head = s.cluster_dir("r").head_dir
    head.mkdir(parents=True)
    (head / SAMPLES_FILE).write_text(
        "".join(json.dumps({"ts": T0 + x.pop("t"), **x}) + "\n" for x in samples)
    )
    return s


def test_training_that_began_between_two_samples_counts_from_its_start(tmp_path: Path) -> None:
    s = small(tmp_path, [(0, "note", {}), (14, "train-start", {"world_size": 2, "resume_step": 0}),
                         (100, "down", {})],
              [{"t": 10, "world_size": 0, "step": 0}, {"t": 20, "world_size": 2, "step": 3},
               {"t": 30, "world_size": 2, "step": 3}, {"t": 40, "world_size": 2, "step": 9}])  # fmt: skip
    t = rp.build(s, "r").totals
    # from the start at 14 to 20 at the second sample's size, 20..30 did not advance,
    # 30..40 at 2
    assert t.gpu_hours_training == round((6 * 2 + 10 * 2) / 3600, 6)
    assert t.steps == 9


def test_a_running_cluster_ends_now_and_resume_steps_count(tmp_path: Path) -> None:
    s = small(tmp_path, [(5, "train-start", {"world_size": 2, "resume_step": 50}),
                         (20, "rescale", {"from_world_size": 2, "to_world_size": 2,
                                          "reason": "restart", "resume_step": 70,
                                          "lost_steps": 3, "notice_to_resume_s": 0.0}),
                         (30, "regroup", {"world_size": 2, "lost_steps": 2}),
                         (40, "rescale", {"from_world_size": 2, "to_world_size": 2,
                                          "reason": "failure", "notice_to_resume_s": -1.0}),
                         (50, "rescale", {"from_world_size": 2, "to_world_size": 2,
                                          "reason": "failure", "notice_to_resume_s": None})],
              [], state="running")  # fmt: skip
    rep = rp.build(s, "r", now=T0 + 65)
    t = rep.totals
    assert rep.end == T0 + 65 and rep.world[-1] == (T0 + 50, 2)  # not closed at `now`
    assert t.hours == round(65 / 3600, 4)
    assert t.steps == 70 and t.lost_steps == 5
    # a pause of 0 s was measured; a negative one and a null one were not
    assert (t.pauses, t.pause_s, t.pauses_unmeasured) == (3, 0.0, 2)
    assert t.gpu_hours_training == round(2 * 60 / 3600, 6)  # 5..65 at 2, no pause to cut
    assert t.gpu_hours_offered == round(2 * 65 / 3600, 6) and t.goodput_pct == 92.3


def test_a_local_or_finished_cluster_fetches_no_samples(tmp_path: Path) -> None:
    s = small(tmp_path, [(0, "down", {})], [])
    assert rp.fetch_samples(s, "r") == 0


def test_a_report_before_any_node_or_event_starts_at_creation(tmp_path: Path) -> None:
    s = Store(tmp_path / "home")
    s.upsert_cluster("r", "local", {"name": "r"}, "up")
    created = s.get_cluster("r").created_at
    rep = rp.build(s, "r", now=created + 36)
    assert (rep.start, rep.end, rep.world, rep.totals.goodput_pct) == (
        created,
        created + 36,
        [],
        None,
    )
    assert rep.totals.hours == 0.01


@pytest.mark.parametrize("pause, cut", [(5.0, True), (0.0, False), (100.0, False)])
def test_a_pause_is_cut_out_only_after_the_last_change(tmp_path: Path, pause: float,
                                                        cut: bool) -> None:  # fmt: skip
    s = small(tmp_path, [(10, "train-start", {"world_size": 2}),
                         (50, "rescale", {"to_world_size": 1, "notice_to_resume_s": pause}),
                         (60, "down", {})], [])  # fmt: skip
    want = (
        [(T0 + 10, 2), (T0 + 50 - pause, 0), (T0 + 50, 1), (T0 + 60, 0)]
        if cut
        else [(T0 + 10, 2), (T0 + 50, 1), (T0 + 60, 0)]
    )
    assert rp.build(s, "r").world == want
