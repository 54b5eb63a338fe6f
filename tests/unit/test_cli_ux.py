"""Issue 15: --name defaulting, --version, completion, the preempt line, honest prices and
`up` phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from spotctl.cli import up_progress
from spotctl.cli.app import app
from spotctl.cli.cmd_preempt import notice_line
from spotctl.cli.common import resolve_name
from spotctl.errors import NotFoundError
from spotctl.state import NodeRow, Store


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("SPOTCTL_HOME", str(h))
    monkeypatch.chdir(tmp_path)
    return h


def test_name_from_spec_file_then_only_cluster_then_a_list(home: Path, tmp_path: Path) -> None:
    store = Store(home)
    with pytest.raises(NotFoundError, match=r"no clusters yet \(`spotctl up` starts one\)"):
        resolve_name(store, None)
    store.upsert_cluster("alpha", "local", {}, "running")
    assert resolve_name(store, None) == "alpha"  # the only one
    assert resolve_name(store, "given") == "given"  # --name wins
    store.upsert_cluster("beta", "local", {}, "down")
    with pytest.raises(NotFoundError, match="which cluster. pass --name, one of: alpha, beta"):
        resolve_name(store, None)
    (tmp_path / "spotctl.toml").write_text('name = "beta"\nprovider = "local"\n')
    assert resolve_name(store, None) == "beta"
    (tmp_path / "spotctl.toml").write_text('provider = "local"\n')
    assert resolve_name(store, None) == "spotctl"  # the spec's default name
    (tmp_path / "spotctl.toml").write_text("not = [toml")
    with pytest.raises(NotFoundError, match="one of: alpha, beta"):
        resolve_name(store, None)


def test_commands_use_the_default_name(home: Path, tmp_path: Path) -> None:
    store = Store(home)
    store.upsert_cluster("only", "local", {"name": "only"}, "down")
    store.add_event("only", "launch", {"node": "n1", "zone": "local-a", "instance_type": "local",
                                       "gpus": 1, "price": 0.0, "reason": "below minimum"})
    res = CliRunner().invoke(app, ["events"])
    assert res.exit_code == 0, res.output
    assert "launch" in res.output and "local in local-a, 1 GPU: below minimum" in res.output
    res = CliRunner().invoke(app, ["status", "--json"])
    out = json.loads(res.output)
    assert res.exit_code == 0 and out["cluster"] == "only" and out["engine"] == "torchft"
    (tmp_path / "spotctl.toml").write_text('name = "other"\n')
    res = CliRunner().invoke(app, ["events"])
    assert isinstance(res.exception, NotFoundError) and "other" in str(res.exception)


def test_version_and_completion(home: Path) -> None:
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("spotctl ")
    env = dict(os.environ, _SPOTCTL_COMPLETE="complete_bash", COMP_WORDS="spotctl rep",
               COMP_CWORD="1")
    spotctl = Path(sys.executable).parent / "spotctl"
    out = subprocess.run([str(spotctl)], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["report"], out.stderr
    res = CliRunner().invoke(app, ["--show-completion", "bash"])
    assert res.exit_code == 0 and "_spotctl_completion" in res.output


def test_preempt_line_says_lead_time_and_clock_time() -> None:
    now = time.time()
    line = notice_line("n2", "aws", now + 120, now)
    at = time.strftime("%H:%M:%S", time.localtime(now + 120))
    assert line == f"notice sent to n2 (aws): hard stop in 120 s, at {at} (local time)"
    assert "no hard stop" in notice_line("n2", "gcp", None, now)


def test_prices_without_aws_credentials_fall_back_to_the_catalog(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    res = CliRunner().invoke(app, ["prices", "--provider", "aws", "--gpu", "A10G"])
    assert res.exit_code == 0, res.output
    assert res.stderr.count("\n") == 1 and "no usable aws credentials" in res.stderr
    assert "catalog" in res.stderr and "not live" in res.stderr
    assert "aws spot offers (catalog)" in res.stdout and "g5.xlarge" in res.stdout
    assert "spot and on-demand $/h: the catalog shipped with spotctl" in res.stdout
    res = CliRunner().invoke(app, ["prices", "--provider", "aws", "--gpu", "A10G", "--json"])
    rows = json.loads(res.stdout)
    assert rows and all(r["price_source"] == {"spot": "catalog", "on_demand": "catalog"}
                        for r in rows)


def test_gcp_prices_are_labelled_catalog_not_live(home: Path) -> None:
    res = CliRunner().invoke(app, ["prices", "--provider", "gcp", "--gpu", "T4"])
    assert res.exit_code == 0, res.output
    assert "gcp spot offers (catalog)" in res.stdout and "live" not in res.stdout.split("\n")[0]
    assert "not fetched live" in res.stdout


def test_reconcile_messages_become_phases() -> None:
    assert up_progress.reconcile_phase("launching 2 x g5.xlarge in us-east-1a") == {
        "phase": "launching", "count": 2, "instance_type": "g5.xlarge", "zone": "us-east-1a"}
    p = up_progress.reconcile_phase("bootstrapped n3 in 41.2s (2/3, ok)", 0.66)
    assert p == {"phase": "bootstrapped", "node": "n3", "seconds": 41.2, "done": 2, "total": 3,
                 "ok": True}
    assert up_progress.describe(p) == "bootstrapped n3 in 41.2s (2/3)"
    # what the bootstrap says of a node (here: a Python older than the pins allow) is shown
    p = up_progress.reconcile_phase("bootstrapped n4 in 50.0s (3/3, ok; its Python is older "
                                    "than some of this controller's pins allow: it took ...)")
    assert p["ok"] and p["note"].startswith("its Python is older"), p
    assert up_progress.describe(p) == ("bootstrapped n4 in 50.0s (3/3): its Python is older "
                                       "than some of this controller's pins allow: it took ...")
    p = up_progress.reconcile_phase("bootstrapped n5 in 1.0s (3/3, failed: a; b)")
    assert not p["ok"] and "note" not in p
    assert up_progress.reconcile_phase("something new")["phase"] == "reconcile"


def test_watch_follows_nodes_to_the_first_step(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    store.upsert_cluster("c", "local", {}, "running")
    for i in (1, 2):
        store.upsert_node(NodeRow(id=f"n{i}", cluster="c", provider="local", zone="z",
                                  instance_type="local", gpus=1, state="running", price=0.0,
                                  on_demand_price=0.0, launched_at=0.0, ended_at=None,
                                  request_id="r", address=""))
    head_seq: list[dict[str, Any]] = [
        {"nodes": {}},
        {"nodes": {"n1": {"state": "waiting", "heartbeat_age_s": 0.1}}},
        {"nodes": {"n1": {"state": "waiting", "heartbeat_age_s": 0.1},
                   "n2": {"state": "waiting", "heartbeat_age_s": 0.1}}},
        {"world_size": 2, "step": 1,
         "nodes": {"n1": {"state": "running", "step": 1, "heartbeat_age_s": 0.1},
                   "n2": {"state": "running", "step": 1, "heartbeat_age_s": 0.1}}},
    ]
    calls = {"n": 0}

    def status() -> dict[str, Any]:
        st = head_seq[min(calls["n"], len(head_seq) - 1)]
        calls["n"] += 1
        return st

    ticks = iter(range(1000))
    out: list[dict[str, Any]] = []
    seen, want, training = up_progress.watch(store, "c", 60, out.append, 2, status=status,
                                             clock=lambda: float(next(ticks)))
    assert (seen, want, training) == (2, 2, True)
    nodes = [p for p in out if p["phase"] == "nodes"]
    assert [p["by_phase"] for p in nodes] == [
        {"booting": ["n1", "n2"], "joining": [], "training": []},
        {"booting": ["n2"], "joining": ["n1"], "training": []},
        {"booting": [], "joining": ["n1", "n2"], "training": []},
        {"booting": [], "joining": [], "training": ["n1", "n2"]},
    ]
    assert nodes[1]["slowest"]["node"] == "n2" and nodes[1]["slowest"]["phase"] == "booting"
    assert out[-1]["phase"] == "first-step" and out[-1]["step"] == 1


def test_a_heartbeat_of_age_zero_is_fresh() -> None:
    """The head rounds a heartbeat's age to 10 ms: 0.0 is the freshest, not a missing one
    (the demo showed a training node as joining while its heartbeat read 0.0)."""
    from spotctl.control.reconcile import heartbeat_fresh

    node = {"state": "running", "step": 7, "heartbeat_age_s": 0.0}
    assert heartbeat_fresh(node) and up_progress.node_phase(node) == "training"
    assert up_progress.node_phase({**node, "heartbeat_age_s": 5.0}) == "joining"
    assert up_progress.node_phase({**node, "heartbeat_age_s": None}) == "joining"
    # a node whose GPU gate closed never trains: `up` does not wait for it
    assert up_progress.node_phase({**node, "state": "failed"}) is None
    assert not heartbeat_fresh({"state": "running"}) and not heartbeat_fresh(None)


def _one_node_store(tmp_path: Path) -> Store:
    """A state dir with cluster "c" and its one 1-GPU node n1."""
    store = Store(tmp_path / "home")
    store.upsert_cluster("c", "local", {}, "running")
    store.upsert_node(NodeRow(id="n1", cluster="c", provider="local", zone="z",
                              instance_type="local", gpus=1, state="running", price=0.0,
                              on_demand_price=0.0, launched_at=0.0, ended_at=None,
                              request_id="r", address=""))
    return store


def test_watch_stops_when_capacity_is_below_the_minimum(tmp_path: Path) -> None:
    store = _one_node_store(tmp_path)
    out: list[dict[str, Any]] = []
    res = up_progress.watch(store, "c", 60, out.append, 2,
                            status=lambda: {"nodes": {"n1": {"state": "waiting",
                                                             "heartbeat_age_s": 0.1}}})
    assert res == (1, 1, False)
    assert "below the minimum 2" in out[-1]["message"]


def test_watch_waits_for_a_step_as_long_as_the_knob_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node reports, no step comes: `up` waits SPOTCTL_UP_STEP_WAIT_S (default 60)."""
    store = _one_node_store(tmp_path)
    reporting = {"nodes": {"n1": {"state": "waiting", "heartbeat_age_s": 0.1}}}
    for knob, waited in ((None, 60), ("7.5", 8)):
        if knob is None:
            monkeypatch.delenv("SPOTCTL_UP_STEP_WAIT_S", raising=False)
        else:
            monkeypatch.setenv("SPOTCTL_UP_STEP_WAIT_S", knob)
        monkeypatch.setattr(up_progress.time, "sleep", lambda s: None)
        ticks = iter(range(1000))
        out: list[dict[str, Any]] = []
        res = up_progress.watch(store, "c", 600, out.append, 1, status=lambda: reporting,
                                clock=lambda t=ticks: float(next(t)))  # type: ignore[misc]
        assert res == (1, 1, False)
        assert out[-1]["message"] == (f"every node reports; no step after {float(knob or 60):.0f}s"
                                      " (`spotctl logs --all`)")
        # one clock tick per loop: the first report at tick 1, given up `waited` ticks later
        assert next(ticks) == 1 + waited + 1


def test_watch_ends_when_the_job_finished_before_a_step_was_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job shorter than a status poll (every node finished, no step at the head): `up`
    returns at once instead of waiting SPOTCTL_UP_STEP_WAIT_S for a step that never comes."""
    monkeypatch.setattr(up_progress.time, "sleep", lambda s: None)
    store = _one_node_store(tmp_path)
    out: list[dict[str, Any]] = []
    ticks = iter(range(1000))
    done = {"world_size": 0, "step": 0,
            "nodes": {"n1": {"state": "finished", "heartbeat_age_s": 0.1}}}
    res = up_progress.watch(store, "c", 600, out.append, 1, status=lambda: done,
                            clock=lambda: float(next(ticks)))
    assert res == (1, 1, True)
    assert out[-1]["phase"] == "finished" and next(ticks) == 2  # the first poll saw it
    assert up_progress.describe(out[-1]) == "the job already ran to its end"
    # one node finished, another still joining: not the end yet
    both = _one_node_store(tmp_path / "two")
    both.upsert_node(NodeRow(id="n2", cluster="c", provider="local", zone="z",
                             instance_type="local", gpus=1, state="running", price=0.0,
                             on_demand_price=0.0, launched_at=0.0, ended_at=None,
                             request_id="r", address=""))
    half = {"nodes": {**done["nodes"], "n2": {"state": "waiting", "heartbeat_age_s": 0.1}}}
    out.clear()
    res = up_progress.watch(both, "c", 5, out.append, 1, status=lambda: half,
                            clock=lambda t=iter(range(1000)): float(next(t)))  # type: ignore[misc]
    assert res == (2, 2, False) and "finished" not in [p["phase"] for p in out]


@pytest.mark.parametrize("bad", ["soon", "-1", "nan", "inf"])
def test_a_bad_step_wait_knob_is_one_line(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from spotctl.errors import SpecError

    monkeypatch.setenv("SPOTCTL_UP_STEP_WAIT_S", bad)
    with pytest.raises(SpecError, match=r"^SPOTCTL_UP_STEP_WAIT_S must be a number of seconds"):
        up_progress.first_step_wait_s()


def test_json_phases_are_lines_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    r = up_progress.Reporter(json_lines=True)
    r.reconcile("launching 1 x local in local-a")
    r({"phase": "first-step", "step": 3, "world_size": 2, "after_s": 1.0})
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = [json.loads(x) for x in cap.err.splitlines()]
    assert [x["phase"] for x in lines] == ["launching", "first-step"]


def test_bootstrap_names_the_slowest_node(capsys: pytest.CaptureFixture[str]) -> None:
    r = up_progress.Reporter(json_lines=False)
    r.reconcile("bootstrapping 3 node(s)")
    r.reconcile("bootstrapped i-b in 12.0s (1/3, ok)")
    r.reconcile("bootstrapped i-a in 41.5s (2/3, ok)")
    r.reconcile("bootstrapped i-c in 20.0s (3/3, failed: agent never heartbeat)")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "up: bootstrapping 3 node(s)",
        "up: bootstrapped i-b in 12.0s (1/3)",
        "up: bootstrapped i-a in 41.5s (2/3)",
        "up: bootstrapped i-c in 20.0s (3/3, failed)",
        "up: bootstrapped 3 node(s), 1 failed; slowest i-a (41.5s)",
    ]


def test_up_says_whether_the_head_runs_the_loop_the_spec_asks_for() -> None:
    from spotctl.cli.cmd_up import head_loop_note

    assert head_loop_note(True, True) == "the head replaces lost nodes itself ([rebalance] on_head)"
    assert head_loop_note(False, False) == ""
    assert head_loop_note(True, False).startswith(
        "note: this cluster's head does not run the reconcile loop, which [rebalance] on_head "
        "= true changes when the head starts again")
    assert "head runs the reconcile loop, which [rebalance] on_head = false" in head_loop_note(
        False, True)
