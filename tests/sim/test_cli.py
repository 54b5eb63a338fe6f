"""`spotctl simulate` through the real typer app."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from spotctl.cli.app import app
from spotctl.errors import SpecError

DATA = Path(__file__).resolve().parents[2] / "spotctl" / "data" / "traces"
KEYS = {
    "policy",
    "cost_usd",
    "progress_steps",
    "cost_per_progress_vs_on_demand",
    "goodput_vs_oracle",
    "time_to_finish_h",
}


def test_json_shape() -> None:
    res = CliRunner().invoke(
        app, ["simulate", "--trace", str(DATA / "g4dn-trace.csv"), "--nodes", "8", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert set(doc) >= {"policies", "trace", "model"}
    assert [p["policy"] for p in doc["policies"]] == ["spotctl", "restart", "ondemand"]
    for p in doc["policies"]:
        assert KEYS <= set(p)
    od = doc["policies"][2]
    assert od["cost_per_progress_vs_on_demand"] == 1.0
    assert od["time_to_finish_h"] == doc["trace"]["span_h"]
    assert doc["trace"]["format"] == "bamboo" and doc["model"]["nodes"] == 8
    # the default engine's model (torchft): sub-second pauses, a vanished VM's timeout
    m = doc["model"]
    assert (m["engine"], m["notice_recovery_s"], m["join_pause_s"], m["hard_recovery_s"]) == (
        "torchft", 0.3, 0.2, 2.5)


def test_engine_flag_picks_the_model_and_a_bad_one_is_refused() -> None:
    args = ["simulate", "--trace", str(DATA / "g4dn-trace.csv"), "--nodes", "8", "--json",
            "--policy", "spotctl"]
    res = CliRunner().invoke(app, [*args, "--engine", "torchrun", "--join-pause", "3"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.output)["model"]
    assert (m["engine"], m["notice_recovery_s"], m["join_pause_s"]) == ("torchrun", 10.0, 3.0)
    res = CliRunner().invoke(app, [*args, "--engine", "horovod"])
    assert isinstance(res.exception, SpecError) and "--engine 'horovod'" in str(res.exception)


def test_one_policy_hours_flags_and_recovery_json(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"notice_recovery_s": 4.0, "hard_recovery_s": 12.0}))
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--trace",
            "aws-4node-08-03-2023_us-west-2c_v100_1",  # a shipped trace, by name
            "--policy",
            "restart",
            "--hours",
            "24",
            "--recovery-json",
            str(bench),
            "--hard-recovery",
            "20",
            "--spot-price",
            "1.5",
            "--on-demand-price",
            "4",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [p["policy"] for p in doc["policies"]] == ["restart"]
    assert doc["trace"]["span_h"] == 24.0
    m = doc["model"]
    assert (m["notice_recovery_s"], m["hard_recovery_s"]) == (4.0, 20.0)  # flag beats file
    assert m["spot_source"] == "flag" and m["on_demand_usd_per_node_hour"] == 4.0


def test_table_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    res = CliRunner().invoke(
        app, ["simulate", "--trace", str(DATA / "p3-trace.csv"), "--nodes", "8", "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    for word in ("spotctl", "restart", "ondemand", "goodput", "torchft"):
        assert word in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_bad_input_is_a_spec_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,n1\n5,jump,n1\n")
    for args in (
        ["--trace", str(bad)],
        ["--trace", str(DATA / "p3-trace.csv"), "--policy", "spot"],
        ["--trace", str(tmp_path / "missing.json")],
        ["--trace", str(DATA / "p3-trace.csv"), "--nodes", "0"],
    ):
        res = CliRunner().invoke(app, ["simulate", *args])
        assert isinstance(res.exception, SpecError), (args, res.output)
