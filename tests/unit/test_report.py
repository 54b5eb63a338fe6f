"""`spotctl report`: totals and a plot from a journal and the head's samples, and the
sample file staying bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.control import report as rp
from spotctl.head.samples import SAMPLES_FILE, SampleLog, read_samples, sample_of
from spotctl.state import NodeRow, Store

T0 = 1_800_000_000.0


def node(i: int, start: float, end: float | None, gpus: int = 1, price: float = 0.5) -> NodeRow:
    return NodeRow(id=f"n{i}", cluster="r", provider="local", zone="local-a",
                   instance_type="local", gpus=gpus, state="running" if end is None else "preempted",
                   price=price, on_demand_price=2.0, launched_at=T0 + start,
                   ended_at=None if end is None else T0 + end, request_id="q", address="")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "home")
    s.upsert_cluster("r", "local", {"name": "r"}, "down")
    for n in (node(1, 0, 600), node(2, 0, 200), node(3, 0, 600), node(4, 400, 600)):
        s.upsert_node(n)
    evs = [
        (10, "train-start", {"world_size": 3, "resume_step": 0}),
        (150, "notice", {"node": "n2", "source": "aws-imds", "deadline": T0 + 270}),
        (160, "drain-committed", {"gen": 1, "step": 140}),
        (165, "rescale", {"from_world_size": 3, "to_world_size": 2, "reason": "notice",
                          "checkpoint_step": 140, "lost_steps": 0, "notice_to_resume_s": 5.0}),
        (200, "preempted", {"node": "n2", "zone": "local-a", "state": "preempted"}),
        (250, "node-unresponsive", {"node": "n1", "silent_s": 10}),  # slow, not lost
        (255, "node-back", {"node": "n1"}),
        (300, "node-unresponsive", {"node": "n3", "silent_s": 10}),
        (310, "rescale", {"from_world_size": 2, "to_world_size": 1, "reason": "failure",
                          "checkpoint_step": 250, "lost_steps": 7, "notice_to_resume_s": 6.0}),
        (420, "join", {"node": "n4"}),
        (430, "rescale", {"from_world_size": 1, "to_world_size": 2, "reason": "join",
                          "checkpoint_step": 380, "lost_steps": 0, "notice_to_resume_s": 4.0}),
        (600, "down", {"leaks": []}),
    ]
    for ts, typ, data in evs:
        s.add_event("r", typ, data, ts=T0 + ts)
    head = s.cluster_dir("r").head_dir
    head.mkdir(parents=True)
    with open(head / SAMPLES_FILE, "w") as f:
        for k in range(0, 600, 10):
            w = 3 if k < 160 else 2 if k < 305 else 1 if k < 430 else 2
            f.write(json.dumps({"ts": T0 + k, "world_size": w, "step": k, "throughput": 50.0 * w,
                                "checkpoint_step": 0, "nodes": w}) + "\n")
    return s


def test_totals_from_journal_and_samples(store: Store) -> None:
    rep = rp.build(store, "r", now=T0 + 10_000)
    t = rep.totals
    assert rep.start == T0 and rep.end == T0 + 600  # a finished run ends at its `down`
    assert t.hours == round(600 / 3600, 4)
    assert t.steps == 590 and t.lost_steps == 7 and t.pauses == 3 and t.pause_s == 15.0
    assert t.notices == 1 and t.hard_losses == 1  # n2 had a notice: it is not a hard loss
    assert t.spent_usd == pytest.approx((600 + 200 + 600 + 200) * 0.5 / 3600, abs=1e-6)
    assert t.on_demand_usd == pytest.approx(1600 * 2.0 / 3600, abs=1e-6)
    assert t.gpu_hours_offered == pytest.approx(1600 / 3600, abs=1e-6)
    # training GPU-time: sample intervals whose step advanced, times the world size
    assert 0 < t.gpu_hours_training < t.gpu_hours_offered
    assert t.goodput_pct == pytest.approx(100 * t.gpu_hours_training / t.gpu_hours_offered, abs=0.1)
    assert [w for _, w in rep.world] == [3, 0, 2, 0, 1, 0, 2, 0]


def test_plot_marks_match_the_events(store: Store, tmp_path: Path) -> None:
    rep = rp.build(store, "r")
    out = tmp_path / "run.png"
    drawn = rp.write_plot(rep, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 200_000
    evs = store.events("r")

    def rel(*types: str) -> list[float]:
        return [round(e["ts"] - T0, 3) for e in evs if e["type"] in types]

    assert drawn["notice"] == rel("notice")
    assert drawn["rescale"] == rel("rescale")
    assert drawn["join"] == rel("join")
    # n2's loss came with a notice; n1 was slow and came back; n3 is the one hard loss
    assert drawn["hard-loss"] == [300.0]


def test_plot_to_an_unwritable_path_is_one_error(store: Store, tmp_path: Path) -> None:
    from spotctl.errors import SpecError

    with pytest.raises(SpecError, match="cannot write"):
        rp.write_plot(rp.build(store, "r"), tmp_path / "no-such-dir" / "x.png")


def test_sample_file_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / SAMPLES_FILE
    log = SampleLog(path, interval_s=1.0, max_samples=100)
    for k in range(1000):
        log.add(sample_of({"world_size": 2, "step": k, "throughput": 3.0, "nodes": {}}, T0 + k))
    got = read_samples(path)
    assert 50 <= len(got) < 100
    assert log.interval_s >= 8  # thinned (and slowed) at least three times
    # an even picture of the whole run survives, oldest to newest
    assert got[0]["step"] == 0 and got[-1]["step"] >= 990
    gaps = {b["step"] - a["step"] for a, b in zip(got, got[1:], strict=False)}
    assert max(gaps) <= 2 * min(gaps)
    # a restarted head keeps the pace the file reached
    assert SampleLog(path, interval_s=1.0, max_samples=100).interval_s > 1.0


def test_head_serves_its_samples_to_the_controller_only(tmp_path: Path) -> None:
    import threading
    import urllib.error
    import urllib.request

    from spotctl.head.auth import node_token
    from spotctl.head.client import HeadClient
    from spotctl.head.server import HeadServer

    srv = HeadServer(tmp_path, "s3cret", with_store=False)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        assert HeadClient(srv.url, "s3cret").samples() == []
        log = SampleLog(tmp_path / SAMPLES_FILE)
        for k in range(3):
            log.add(sample_of({"world_size": 2, "step": k, "nodes": {}}, T0 + 10 * k))
        got = HeadClient(srv.url, "s3cret").samples()
        assert [s["step"] for s in got] == [0, 1, 2]
        req = urllib.request.Request(srv.url + "/api/samples")
        req.add_header("Authorization", "Bearer " + node_token("s3cret", "n1"))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code in (401, 403)
    finally:
        srv.stop()
        t.join(5)


def test_a_cloud_heads_samples_are_copied_for_later_reports(tmp_path: Path) -> None:
    import threading

    from spotctl.head.server import HeadServer

    store = Store(tmp_path / "home")
    store.upsert_cluster("cl", "aws", {"name": "cl"}, "running")
    token = store.cluster_dir("cl").ensure().token(create=True)
    vm = tmp_path / "head-vm"  # the head's own folder, elsewhere (on its VM)
    vm.mkdir()
    srv = HeadServer(vm, token, with_store=False)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        store.set_head("cl", {"url": srv.url})
        log = SampleLog(vm / SAMPLES_FILE)
        for k in range(4):
            log.add(sample_of({"world_size": 1, "step": k, "nodes": {}}, T0 + 10 * k))
        assert rp.fetch_samples(store, "cl") == 4
        local = store.cluster_dir("cl").head_dir / SAMPLES_FILE
        assert [s["step"] for s in read_samples(local)] == [0, 1, 2, 3]
    finally:
        srv.stop()
        t.join(5)
    store.set_cluster_state("cl", "down")
    assert rp.fetch_samples(store, "cl") == 0  # a finished cluster keeps its copy
    assert len(read_samples(store.cluster_dir("cl").head_dir / SAMPLES_FILE)) == 4


def test_totals_count_regroups_lost_steps_and_no_unmeasured_or_negative_pause(
        store: Store) -> None:
    # torchft: a regroup of the same replicas that redid a step, a rescale whose pause the
    # head could not measure (null), and one an older head journaled negative
    for ts, typ, data in [
        (440, "regroup", {"world_size": 2, "reason": "redo", "lost_steps": 1}),
        (450, "rescale", {"from_world_size": 2, "to_world_size": 1, "reason": "failure",
                          "lost_steps": 1, "notice_to_resume_s": None}),
        (460, "rescale", {"from_world_size": 1, "to_world_size": 2, "reason": "restart",
                          "lost_steps": 0, "notice_to_resume_s": -0.2}),
    ]:
        store.add_event("r", typ, data, ts=T0 + ts)
    t = rp.build(store, "r", now=T0 + 10_000).totals
    assert t.lost_steps == 7 + 1 + 1 and t.pauses == 5
    assert t.pause_s == 15.0 and t.pauses_unmeasured == 2
