"""`spotctl report`'s goodput and training GPU-hours against numbers worked out by hand
from a small journal in which the world size changes and the job stalls, so a report that
ignores the world size, counts a stalled interval or keeps a rescale's pause adds up to
something else. Both sources are pinned: the head's samples, and (without samples) the
journal's world-size steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotctl.control import report as rp
from spotctl.head.samples import SAMPLES_FILE
from spotctl.state import NodeRow, Store

T0 = 1_800_000_000.0


def _node(nid: str, start: float, end: float, gpus: int) -> NodeRow:
    return NodeRow(id=nid, cluster="g", provider="local", zone="local-a", instance_type="local",
                   gpus=gpus, state="preempted", price=1.0, on_demand_price=3.0,
                   launched_at=T0 + start, ended_at=T0 + end, request_id="q", address="")


def _journal(tmp_path: Path, samples: list[tuple[float, int, int]]) -> Store:
    """Two 2-GPU nodes from 0 s; one is preempted at 200 s; the cluster is down at 400 s.
    Offered: 2 GPUs x 400 s + 2 GPUs x 200 s = 1200 GPU-s."""
    s = Store(tmp_path / "home")
    s.upsert_cluster("g", "local", {"name": "g"}, "down")
    s.upsert_node(_node("a", 0, 400, 2))
    s.upsert_node(_node("b", 0, 200, 2))
    journal: list[tuple[float, str, dict[str, Any]]] = [
        (0, "train-start", {"world_size": 4, "resume_step": 0}),
        (200, "rescale", {"from_world_size": 4, "to_world_size": 2, "reason": "notice",
                          "lost_steps": 0, "notice_to_resume_s": 20.0}),
        (400, "down", {"leaks": []}),
    ]
    for ts, typ, data in journal:
        s.add_event("g", typ, data, ts=T0 + ts)
    if samples:
        head = s.cluster_dir("g").head_dir
        head.mkdir(parents=True)
        (head / SAMPLES_FILE).write_text("".join(
            json.dumps({"ts": T0 + t, "world_size": w, "step": step, "throughput": 1.0,
                        "checkpoint_step": 0, "nodes": w // 2}) + "\n"
            for t, w, step in samples))
    return s


def test_goodput_from_samples_weighs_by_world_size_and_skips_stalls(tmp_path: Path) -> None:
    # (t, world size, step): 0-100 and 100-200 train on 4 GPUs, 200-300 is stalled (the
    # step stays at 100) on 2, 300-400 trains on 2
    store = _journal(tmp_path, [(0, 4, 0), (100, 4, 50), (200, 2, 100), (300, 2, 100),
                                (400, 2, 150)])
    t = rp.build(store, "g").totals
    assert t.gpu_hours_offered == pytest.approx(1200 / 3600, abs=1e-6)
    # 4 x 100 + 4 x 100 + 0 (stalled) + 2 x 100 = 1000 GPU-s
    assert t.gpu_hours_training == pytest.approx(1000 / 3600, abs=1e-6)
    assert t.goodput_pct == 83.3  # 1000 / 1200


def test_goodput_from_the_journal_cuts_the_rescale_pause(tmp_path: Path) -> None:
    # no samples: 4 GPUs from 0 to 180 s (the rescale's 20 s pause ends at 200 s), none
    # while the group re-forms, 2 GPUs from 200 to 400 s
    t = rp.build(_journal(tmp_path, []), "g").totals
    assert t.gpu_hours_offered == pytest.approx(1200 / 3600, abs=1e-6)
    # 4 x 180 + 0 x 20 + 2 x 200 = 1120 GPU-s
    assert t.gpu_hours_training == pytest.approx(1120 / 3600, abs=1e-6)
    assert t.goodput_pct == 93.3  # 1120 / 1200


def test_a_run_that_starts_between_two_samples_counts_from_its_start(tmp_path: Path) -> None:
    """The head samples every 2 s: a short run can begin and reach its notice between two
    samples, the first of which saw no worker group (world size 0). That interval trained,
    from the journal's train-start on, at the second sample's size."""
    s = Store(tmp_path / "home")
    s.upsert_cluster("g", "local", {"name": "g"}, "down")
    s.upsert_node(_node("a", 0, 60, 2))
    s.upsert_node(_node("b", 0, 60, 2))
    s.add_event("g", "train-start", {"world_size": 4, "resume_step": 0}, ts=T0 + 10)
    s.add_event("g", "down", {"leaks": []}, ts=T0 + 60)
    head = s.cluster_dir("g").head_dir
    head.mkdir(parents=True)
    (head / SAMPLES_FILE).write_text("".join(
        json.dumps({"ts": T0 + t, "world_size": w, "step": step, "throughput": 1.0,
                    "checkpoint_step": 0, "nodes": 2}) + "\n"
        for t, w, step in [(0, 0, 0), (40, 4, 30), (50, 4, 30)]))
    t = rp.build(s, "g").totals
    # 4 GPUs from the start at 10 s to the sample at 40 s; 40-50 stalled
    assert t.gpu_hours_training == pytest.approx(4 * 30 / 3600, abs=1e-6)
    assert t.gpu_hours_offered == pytest.approx(4 * 60 / 3600, abs=1e-6)
