"""Cost accounting over a real Store in a temporary SPOTCTL_HOME, and `spotctl cost`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spotctl.cli.app import main
from spotctl.control.cost import cluster_cost, preemption_losses
from spotctl.errors import NotFoundError
from spotctl.state import NodeRow, Store

pytestmark = pytest.mark.planner

T0 = 1_700_000_000.0


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path / "home"))
    s = Store()
    s.upsert_cluster("c1", "local", {"name": "c1", "gpus": "1..3"}, "running")
    return s


def row(id: str, price: float, od: float, gpus: int, start: float, end: float | None) -> NodeRow:
    return NodeRow(
        id=id,
        cluster="c1",
        provider="local",
        zone="local-a",
        instance_type="local",
        gpus=gpus,
        state="running" if end is None else "preempted",
        price=price,
        on_demand_price=od,
        launched_at=start,
        ended_at=end,
        request_id="r",
        address="",
    )


def fill(s: Store) -> None:
    s.upsert_node(row("n1", 1.0, 3.0, 1, T0, T0 + 3600))  # 1 h, ended
    s.upsert_node(row("n2", 2.0, 0.0, 2, T0 + 1800, None))  # running, on-demand unknown
    s.upsert_node(row("n3", 0.5, 2.0, 1, T0 + 3600, None))  # running
    ev = s.add_event
    ev("c1", "train-start", {"world_size": 3, "resume_step": 0}, ts=T0 + 100)
    ev("c1", "preempted", {"node": "n1", "zone": "local-a"}, ts=T0 + 3600)
    # Graceful: nothing replayed, 40 s waiting with 2 survivors.
    ev(
        "c1",
        "rescale",
        {
            "from_world_size": 3,
            "to_world_size": 2,
            "reason": "notice",
            "checkpoint_step": 100,
            "resume_step": 100,
            "lost_steps": 0,
            "notice_to_resume_s": 40,
        },
        ts=T0 + 3700,
    )
    # Hard loss: 20 steps replayed at 10 s/step by 2 ranks, 100 s waiting with 1 survivor.
    ev("c1", "node-lost", {"node_ids": ["n9"]}, ts=T0 + 4900)
    ev(
        "c1",
        "rescale",
        {
            "from_world_size": 2,
            "to_world_size": 1,
            "reason": "failure",
            "checkpoint_step": 200,
            "resume_step": 200,
            "lost_steps": 20,
            "notice_to_resume_s": 100,
        },
        ts=T0 + 5000,
    )
    # Growth is not a preemption loss.
    ev(
        "c1",
        "rescale",
        {
            "from_world_size": 1,
            "to_world_size": 2,
            "reason": "join",
            "checkpoint_step": 300,
            "resume_step": 300,
            "lost_steps": 0,
            "notice_to_resume_s": 30,
        },
        ts=T0 + 6000,
    )
    ev("c1", "launch", {"node": "nX"}, ts=T0 + 6100)


def test_planner_cost_totals(store: Store) -> None:
    fill(store)
    r = cluster_cost(store, "c1", T0 + 7200)
    by = {n.id: n for n in r.nodes}
    assert by["n1"].hours == pytest.approx(1.0) and by["n1"].spent_usd == pytest.approx(1.0)
    assert by["n2"].spent_usd == pytest.approx(3.0) and by["n2"].on_demand_usd is None
    assert by["n3"].spent_usd == pytest.approx(0.5) and by["n3"].saved_usd == pytest.approx(1.5)
    assert r.spent_usd == pytest.approx(4.5)
    assert r.on_demand_usd == pytest.approx(3.0 + 2.0)
    assert r.saved_usd == pytest.approx(2.0 + 1.5)
    assert r.saved_pct == pytest.approx(70.0)
    assert r.on_demand_unknown_nodes == 1
    assert r.usd_per_hour == pytest.approx(2.5)
    assert r.gpu_hours == pytest.approx(1 + 3 + 1)
    assert r.preemptions == 2  # n1 (preempted) and n9 (lost)
    assert r.preemption_rescales == 2 and r.lost_steps == 20
    assert r.step_time_s == pytest.approx(10.0)
    assert r.replay_gpu_hours == pytest.approx(20 * 10 * 2 / 3600)
    assert r.downtime_gpu_hours == pytest.approx((40 * 2 + 100 * 1) / 3600)
    assert r.gpu_hours_lost == pytest.approx(r.replay_gpu_hours + r.downtime_gpu_hours)
    j = r.to_json()
    assert json.loads(json.dumps(j))["spent_usd"] == pytest.approx(4.5)
    assert len(j["nodes"]) == 3 and "saved" in r.header()


def test_planner_cost_grows_with_time_only_for_running_nodes(store: Store) -> None:
    fill(store)
    a = cluster_cost(store, "c1", T0 + 7200)
    b = cluster_cost(store, "c1", T0 + 7200 + 3600)
    assert b.spent_usd - a.spent_usd == pytest.approx(2.5)  # n2 + n3 for one more hour
    assert {n.id: n.spent_usd for n in b.nodes}["n1"] == pytest.approx(1.0)


def test_planner_cost_empty_cluster_and_unknown_cluster(store: Store) -> None:
    r = cluster_cost(store, "c1", T0)
    assert (r.spent_usd, r.saved_pct, r.gpu_hours_lost, r.step_time_s) == (0.0, None, 0.0, None)
    with pytest.raises(NotFoundError):
        cluster_cost(store, "nope", T0)


def test_planner_cost_step_time_sources() -> None:
    rescale = {
        "type": "rescale",
        "ts": 100.0,
        "reason": "notice",
        "from_world_size": 4,
        "to_world_size": 3,
        "resume_step": 50,
        "lost_steps": 6,
        "notice_to_resume_s": 0,
    }
    # No earlier incarnation: the caller's step time is used, else replay is unknown (0).
    assert preemption_losses([rescale])[2] == 0.0
    assert preemption_losses([rescale], step_time_s=3.0)[2] == pytest.approx(6 * 3 * 4 / 3600)
    # A step time carried by the event wins.
    with_st = dict(rescale, step_time_s=1.5)
    assert preemption_losses([with_st], 3.0)[2] == pytest.approx(6 * 1.5 * 4 / 3600)


def test_planner_cost_cli_json_and_table(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    main(["cost", "--name", "c1", "--json"])
    j = json.loads(capsys.readouterr().out)
    # Running nodes keep billing until `now` (the real clock here).
    expect = 1.0 + (time.time() - T0 - 1800) / 3600 * 2.0 + (time.time() - T0 - 3600) / 3600 * 0.5
    assert j["spent_usd"] == pytest.approx(expect, rel=1e-3)
    assert j["preemptions"] == 2 and j["lost_steps"] == 20
    assert {n["id"] for n in j["nodes"]} == {"n1", "n2", "n3"}
    main(["cost", "--name", "c1"])
    out = capsys.readouterr().out
    assert "n2" in out and "saved $" in out and "lost to preemptions" in out


def test_planner_cost_cli_unknown_cluster_is_one_line(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["cost", "--name", "nope"])
    assert e.value.code == NotFoundError.exit_code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
