"""Engine invariants on small handmade traces and the shipped samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.errors import SpecError
from spotctl.simulate import SimModel, load_recovery_json, read_trace, resolve_prices, simulate
from spotctl.simulate.engine import Job, oracle_steps, run_policy
from spotctl.simulate.model import Prices, with_overrides
from spotctl.simulate.traces import Trace

DATA = Path(__file__).resolve().parents[2] / "spotctl" / "data" / "traces"
PRICES = Prices(spot=((0.0, 1.0),), on_demand=3.0, spot_source="test", on_demand_source="test")


def count_trace(tmp_path: Path, data: list[int], gap: float = 60.0, **extra: object) -> Trace:
    p = tmp_path / "t_v100_1.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": data, **extra}))
    return read_trace(p)


def steps(trace: Trace, model: SimModel, nodes: int, policy: str) -> float:
    return run_policy(policy, trace, model, PRICES, nodes).progress_steps


def test_job_commits_every_interval_and_rolls_back_to_it() -> None:
    m = SimModel(step_time_s=1.0, checkpoint_every=10, checkpoint_cost_s=2.0)
    job = Job(m, target_nodes=2, target_steps=None, world=2)
    job.advance(0.0, 12.0)  # one full cycle: 10 steps + 2 s save
    assert job.progress == pytest.approx(10.0) and job.committed == pytest.approx(10.0)
    job.advance(12.0, 17.0)
    assert job.progress == pytest.approx(15.0) and job.committed == pytest.approx(10.0)
    job.rollback(17.0, pause=3.0)
    assert job.progress == pytest.approx(10.0) and job.lost_steps == pytest.approx(5.0)
    job.world = 1  # half the nodes: half a full-size step per second
    job.advance(17.0, 24.0)  # 3 s paused, then 4 s stepping
    assert job.progress == pytest.approx(12.0)


def test_ondemand_is_never_preempted_and_costs_on_demand_price_times_hours() -> None:
    tr = read_trace(DATA / "aws-4node-08-03-2023_us-west-2c_v100_1.json")
    r = run_policy("ondemand", tr, SimModel(), PRICES, 4)
    assert r.preemptions == 0 and r.lost_steps == 0
    assert all(s.world == 4 for s in r.samples)
    assert r.cost_usd == pytest.approx(4 * PRICES.on_demand * tr.span_s / 3600)


@pytest.mark.parametrize(
    ("name", "nodes"),
    [
        ("aws-4node-08-03-2023_us-west-2c_v100_1.json", 4),
        ("aws-1node-04-22-2023-first48h_us-east-1c_v100_1.json", 1),
        ("g4dn-trace.csv", 8),
        ("p3-trace.csv", 16),
    ],
)
@pytest.mark.parametrize("notice_fraction", [1.0, 0.9])
def test_restart_never_beats_spotctl_on_traces_with_notices(
    name: str, nodes: int, notice_fraction: float
) -> None:
    tr = read_trace(DATA / name)
    m = SimModel(notice_fraction=notice_fraction)
    sp = run_policy("spotctl", tr, m, PRICES, nodes)
    rs = run_policy("restart", tr, m, PRICES, nodes)
    assert sp.preemptions > 0 and rs.preemptions > 0
    assert rs.progress_steps <= sp.progress_steps
    assert sp.progress_steps <= oracle_steps(tr, m, nodes)


def test_no_preemption_means_ideal_minus_checkpoint_overhead(tmp_path: Path) -> None:
    tr = count_trace(tmp_path, [3] * 600)  # 3 nodes for 10 h, never a drop
    m = SimModel(step_time_s=2.0, checkpoint_every=100, checkpoint_cost_s=5.0)
    sp = run_policy("spotctl", tr, m, PRICES, 3)
    period = m.checkpoint_every * m.step_time_s
    full, rest = divmod(tr.span_s, m.cycle_s)
    expected = full * m.checkpoint_every + min(rest, period) / m.step_time_s
    assert sp.progress_steps == pytest.approx(expected)
    assert sp.progress_steps < oracle_steps(tr, m, 3)
    assert sp.preemptions == 0 and sp.lost_steps == 0
    assert sp.cost_usd == pytest.approx(3 * 1.0 * 10)
    zero = with_overrides(m, {"checkpoint_cost_s": 0.0})
    assert run_policy("spotctl", tr, zero, PRICES, 3).progress_steps == pytest.approx(
        oracle_steps(tr, zero, 3)
    )


@pytest.mark.parametrize("policy", ["spotctl", "restart", "ondemand"])
def test_committed_progress_is_monotone(policy: str) -> None:
    tr = read_trace(DATA / "g4dn-trace.csv")
    r = run_policy(policy, tr, SimModel(notice_fraction=0.5), PRICES, 8)
    committed = [s.committed for s in r.samples]
    assert committed == sorted(committed)
    assert [s.t_s for s in r.samples] == sorted(s.t_s for s in r.samples)


def test_spotctl_with_notices_never_loses_a_step() -> None:
    tr = read_trace(DATA / "aws-4node-08-03-2023_us-west-2c_v100_1.json")
    r = run_policy("spotctl", tr, SimModel(notice_fraction=1.0), PRICES, 4)
    assert r.preemptions > 100 and r.notices == r.preemptions
    assert r.lost_steps == 0
    progress = [s.progress for s in r.samples]
    assert progress == sorted(progress)


def test_hard_losses_cost_at_most_one_checkpoint_interval_each() -> None:
    tr = read_trace(DATA / "aws-4node-08-03-2023_us-west-2c_v100_1.json")
    m = SimModel(notice_fraction=0.0)
    r = run_policy("spotctl", tr, m, PRICES, 4)
    assert r.notices == 0 and r.lost_steps > 0
    assert r.lost_steps <= r.preemptions * m.checkpoint_every


def test_torchft_loses_the_step_in_flight_not_the_interval_and_writes_no_drain_checkpoint(
    tmp_path: Path,
) -> None:
    # 4 nodes; one vanishes without notice after 1 h, another leaves with one at 2 h, and
    # both come back at 3 h (60 s ticks). torchrun rolls back to the last checkpoint;
    # torchft loses one step at 4 nodes (4/4 of a full-size step) and pays its pauses.
    tr = count_trace(tmp_path, [4] * 60 + [3] * 60 + [2] * 60 + [4] * 60)
    kw = dict(step_time_s=1.0, checkpoint_every=1000, checkpoint_cost_s=0.0, notice_fraction=0.5)
    ft = SimModel.for_engine("torchft", **kw)
    tr_ = SimModel.for_engine("torchrun", **kw)
    assert (ft.engine, ft.notice_recovery_s, ft.hard_recovery_s, ft.join_pause_s) == (
        "torchft", 0.3, 2.5, 0.2)
    assert SimModel.for_engine("torchrun") == SimModel()
    a = run_policy("spotctl", tr, ft, PRICES, 4)
    b = run_policy("spotctl", tr, tr_, PRICES, 4)
    assert (a.preemptions, a.notices) == (b.preemptions, b.notices) == (2, 1)
    # the second loss has no notice: torchft loses the one step in flight at 3 nodes (3/4
    # of a full-size step); torchrun goes back to its last checkpoint: its cycle restarted
    # at the drain, resumed at 3610 s, saved at 4610, 5610 and 6610: 590 s at 3/4 lost
    assert a.lost_steps == pytest.approx(0.75)
    assert b.lost_steps == pytest.approx((7200 - 6610) * 3 / 4)

    def after(r: object, t: float) -> object:
        return [s for s in r.samples if s.t_s <= t][-1]  # type: ignore[attr-defined]

    # the notice at 1 h: torchrun's drain commits a checkpoint, torchft writes none
    assert after(b, 3600).committed == after(b, 3600).progress == pytest.approx(3600)
    assert after(a, 3600).committed == pytest.approx(3000)
    assert a.progress_steps > b.progress_steps
    with pytest.raises(SpecError, match="engine"):
        SimModel.for_engine("horovod")


def test_spotctl_shrinks_and_grows_back_restart_waits_for_full_size(tmp_path: Path) -> None:
    # 2 nodes for 1 h, 1 node for 2 h, then 2 nodes for 3 h (60 s ticks).
    tr = count_trace(tmp_path, [2] * 60 + [1] * 120 + [2] * 180)
    m = SimModel()
    sp = run_policy("spotctl", tr, m, PRICES, 2)
    rs = run_policy("restart", tr, m, PRICES, 2)

    def world_at(r: object, t: float) -> int:
        samples = [s for s in r.samples if s.t_s <= t]  # type: ignore[attr-defined]
        return samples[-1].world

    assert world_at(sp, 2 * 3600) == 1  # survivors keep training
    assert world_at(rs, 2 * 3600) == 0  # restart waits for both nodes
    # The replacement comes from the planner once capacity is back: the next reconcile
    # tick (<= 300 s) plus provisioning (120 s).
    assert world_at(sp, 3 * 3600 + 300 + 120 + 1) == 2
    assert world_at(rs, 3 * 3600 + 60 + 120 + 1) == 2
    assert sp.progress_steps > rs.progress_steps


def test_time_to_finish(tmp_path: Path) -> None:
    tr = count_trace(tmp_path, [1] * 120)  # 2 h, always available
    m = SimModel(step_time_s=1.0, checkpoint_every=100, checkpoint_cost_s=0.0)
    res = simulate(tr, m, PRICES, target_steps=1800)
    rows = {r["policy"]: r for r in res.to_json()["policies"]}
    assert rows["spotctl"]["time_to_finish_h"] == pytest.approx(0.5)
    assert rows["ondemand"]["time_to_finish_h"] == pytest.approx(0.5)
    default = simulate(tr, m, PRICES)  # target = what on-demand does: done at the end
    rows = {r["policy"]: r for r in default.to_json()["policies"]}
    assert rows["ondemand"]["time_to_finish_h"] == pytest.approx(2.0)
    never = simulate(tr, m, PRICES, target_steps=10**9)
    assert all(r["time_to_finish_h"] is None for r in never.to_json()["policies"])


def test_trace_prices_are_integrated_over_time(tmp_path: Path) -> None:
    tr = count_trace(tmp_path, [1] * 120, prices=[1.0] * 60 + [2.0] * 60)
    prices = resolve_prices(SimModel(on_demand_price=3.0), tr.prices, "", "")
    assert prices.spot_source == "trace"
    r = run_policy("spotctl", tr, SimModel(), prices, 1)
    assert r.cost_usd == pytest.approx(1.0 * 1 + 2.0 * 1)
    flagged = resolve_prices(SimModel(spot_price=0.5, on_demand_price=3.0), tr.prices, "", "")
    assert flagged.spot_source == "flag" and flagged.spot == ((0.0, 0.5),)


def test_replay_is_deterministic() -> None:
    tr = read_trace(DATA / "p3-trace.csv")
    a = simulate(tr, SimModel(), PRICES, nodes=16).to_json()
    b = simulate(tr, SimModel(), PRICES, nodes=16).to_json()
    assert a == b


def test_recovery_json_overrides_known_fields(tmp_path: Path) -> None:
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"sim_model": {"notice_recovery_s": 7.5, "unrelated": "x"}}))
    assert load_recovery_json(p) == {"notice_recovery_s": 7.5}
    p.write_text(json.dumps({"hard_recovery_s": "fast"}))
    with pytest.raises(SpecError, match="hard_recovery_s"):
        load_recovery_json(p)
    p.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(SpecError, match="no known field"):
        load_recovery_json(p)


def test_model_rejects_nonsense() -> None:
    with pytest.raises(SpecError, match="notice_fraction"):
        SimModel(notice_fraction=1.5)
    with pytest.raises(SpecError, match="step_time_s"):
        SimModel(step_time_s=0)
