"""Issue 62, the first hour, the parts that need no cluster (typer CliRunner and the pure
pieces): init's name and kept script, spec typos, flags blamed as flags, `status` per run,
`events` whole in a pipe, `up`'s watch on a crash-looping node, Ctrl-C in `up`, `preempt`
on a node that is not there, the job mark beside a cluster. On a real cluster:
tests/e2e/test_first_hour.py and tests/e2e/test_cli_no_name.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from spotctl.cli import cmd_up, up_progress
from spotctl.cli.app import app, main
from spotctl.cli.cmd_init import cluster_name_for
from spotctl.control import jobmark
from spotctl.errors import NotFoundError, SpecError
from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("SPOTCTL_HOME", str(h))
    monkeypatch.chdir(tmp_path)
    return h


def run(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("folder,name", [
    ("ddp-port", "ddp-port"), ("My_Project 2", "my-project-2"), ("2024__runs", "runs"),
    ("___", "demo"), ("a" * 60, "a" * 40), ("x--y", "x-y"), ("ünï", "n")])
def test_init_names_the_cluster_after_its_folder(tmp_path: Path, folder: str, name: str) -> None:
    got = cluster_name_for(tmp_path / folder)
    assert got == name and ClusterSpec(name=got).name == got  # always a valid name


def test_init_keeps_the_folders_script_and_points_the_spec_at_it(home: Path, tmp_path: Path,
                                                                 capsys: Any) -> None:
    proj = tmp_path / "my_run"
    proj.mkdir()
    (proj / "finetune.py").write_text("print('mine')\n")
    code, out, err = run(["init", str(proj)], capsys)
    assert code == 0, err
    assert out.splitlines() == [f"wrote {proj / 'spotctl.toml'} (cluster my-run)",
                                f"kept {proj / 'finetune.py'}: spotctl.toml runs it "
                                "([train] script)"]
    assert not (proj / "train.py").exists()
    from spotctl.spec import load_spec

    spec = load_spec(proj / "spotctl.toml")
    assert spec.name == "my-run" and spec.train.script == str((proj / "finetune.py").resolve())
    # --force rewrites spotctl.toml only; the user's script is never written over
    (proj / "train.py").write_text("# mine too\n")
    code, out, err = run(["init", str(proj), "--force", "--name", "exp-1"], capsys)
    assert code == 0, err
    assert (proj / "train.py").read_text() == "# mine too\n"
    assert (proj / "finetune.py").read_text() == "print('mine')\n"
    assert load_spec(proj / "spotctl.toml").name == "exp-1"
    code, out, err = run(["init", str(tmp_path / "q"), "--name", "Bad_Name"], capsys)
    assert code == 2 and err.strip().startswith("error: --name: 'Bad_Name' is not a valid")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("toml,line", [
    ('name = "x"\ngpu = "2"\n', "error: spotctl.toml: gpu: unknown key (did you mean 'gpus'?)"),
    ('name = "x"\n[train]\nscrpt = "t.py"\n',
     "error: spotctl.toml: train.scrpt: unknown key (did you mean 'script'?)"),
    ('name = "x"\nzzz = 1\n', "error: spotctl.toml: zzz: unknown key"),
])
def test_a_key_typo_gets_a_did_you_mean(home: Path, tmp_path: Path, capsys: Any, toml: str,
                                        line: str) -> None:
    (tmp_path / "spotctl.toml").write_text(toml)
    (tmp_path / "t.py").write_text("")
    code, out, err = run(["up", "--dry-run"], capsys)
    assert code == 2 and err.strip().splitlines() == [line]


def test_a_bad_flag_value_is_blamed_on_the_flag(home: Path, tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "spotctl.toml").write_text('name = "x"\n[train]\nscript = "t.py"\n')
    (tmp_path / "t.py").write_text("")
    code, out, err = run(["up", "--gpus", "8..2", "--dry-run"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: --gpus: range 8..2 is inverted (MIN must be <= MAX)"]
    (tmp_path / "spotctl.toml").write_text('name = "x"\ngpus = "8..2"\n[train]\nscript = "t.py"\n')
    code, out, err = run(["up", "--dry-run"], capsys)
    assert err.strip().splitlines() == [
        "error: spotctl.toml: gpus: range 8..2 is inverted (MIN must be <= MAX)"]


def _node(cluster: str, nid: str, at: float, ended: float | None = None) -> NodeRow:
    return NodeRow(id=nid, cluster=cluster, provider="local", zone="local-a",
                   instance_type="local", gpus=1, state="terminated" if ended else "running",
                   price=0.0, on_demand_price=0.0, launched_at=at, ended_at=ended,
                   request_id="r", address="")


def test_status_shows_the_current_runs_nodes_and_all_of_them_with_all(home: Path) -> None:
    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "down")
    now = time.time()
    store.upsert_node(_node("c", "n1", now - 100, now - 90))
    store.add_event("c", "down", {"leaks": []}, ts=now - 80)
    store.upsert_node(_node("c", "n2", now - 50, now - 20))
    store.add_event("c", "down", {"leaks": []}, ts=now - 10)
    ids = lambda *a: [n["id"] for n in json.loads(  # noqa: E731
        CliRunner().invoke(app, ["status", "--json", *a]).output)["nodes"]]
    assert ids() == ["n2"]  # the run the last `down` ended
    assert ids("--all") == ["n1", "n2"]
    out = CliRunner().invoke(app, ["status", "--once"]).output
    assert " n2 " in out and " n1 " not in out


def test_events_in_a_pipe_keep_every_detail(home: Path) -> None:
    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "down")
    long = "RuntimeError: " + "x" * 400
    store.add_event("c", "crashed", {"node": "n1", "error": long})
    # a longer type and node on another row widen those columns (seen: a plan-launch row)
    store.add_event("c", "launch-intent-corrupt", {"nodes": ["n10", "n11", "n12"],
                                                   "error": "y" * 380})
    res = CliRunner().invoke(app, ["events"])  # CliRunner's stdout is no terminal
    assert res.exit_code == 0 and f"error {long}" in res.output, res.output
    assert "y" * 380 in res.output and "…" not in res.output


def test_up_watch_ends_on_a_crashed_node_with_its_line(home: Path) -> None:
    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "starting")
    store.upsert_node(_node("c", "n1", time.time()))
    store.upsert_node(_node("c", "n2", time.time()))
    hb = {"state": "running", "heartbeat_age_s": 0.1, "step": None}
    st = {"nodes": {"n1": hb, "n2": dict(hb, state="crashed", error="ValueError: x")}}
    seen: list[dict[str, Any]] = []
    with pytest.raises(up_progress.JobCrashed) as e:
        up_progress.watch(store, "c", 60, seen.append, status=lambda: st)
    assert str(e.value) == ("n2: the training script failed repeatedly with the same error, "
                            "not restarted: ValueError: x (`spotctl logs n2`; `spotctl down` "
                            "stops the cluster)")
    assert e.value.exit_code == 1 and seen[-1]["phase"] == "crashed"


def test_a_live_line_moves_while_a_pipe_gets_one_line_per_change(capsys: Any) -> None:
    live: list[str] = []
    rep = up_progress.Reporter(False, live.append, None)
    p = {"phase": "nodes", "by_phase": {"booting": [], "joining": ["n1"], "training": []},
         "slowest": {"node": "n1", "phase": "joining", "for_s": 0.0}}
    rep(p)
    rep(dict(p, slowest={"node": "n1", "phase": "joining", "for_s": 7.0}, repeat=True))
    assert live == ["joining n1  (slowest: n1, joining 0s)",
                    "joining n1  (slowest: n1, joining 7s)"]
    pipe = up_progress.Reporter(False)
    pipe(p)
    pipe(dict(p, repeat=True))
    assert capsys.readouterr().err == "up: joining n1  (slowest: n1, joining 0s)\n"
    assert up_progress.describe(up_progress.reconcile_phase("checking the head")) == (
        "checking the head")


def test_ctrl_c_in_up_says_what_goes_on_and_a_second_one_stops_it(
        home: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from spotctl.control import reconcile

    stopped: list[str] = []
    monkeypatch.setattr(reconcile, "teardown", lambda store, name: stopped.append(name) or
                        reconcile.DownResult(name, [], False, None))
    with pytest.raises(cmd_up.Interrupted) as e:
        cmd_up.interrupted(None, "c", was_up=True)
    assert e.value.exit_code == 130 and stopped == []
    assert capsys.readouterr().err.strip() == (
        "up: interrupted; cluster c was up before and goes on (`spotctl down` stops it)")

    def second_ctrl_c(s: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", second_ctrl_c)
    with pytest.raises(cmd_up.Interrupted) as e:
        cmd_up.interrupted(None, "c", was_up=False)
    assert stopped == ["c"] and str(e.value) == "interrupted: cluster c stopped"
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "up: stopping cluster c", "up: cluster c is down (checkpoints kept)"]
    monkeypatch.setattr(time, "sleep", lambda s: None)  # no second Ctrl-C: it goes on
    with pytest.raises(cmd_up.Interrupted) as e:
        cmd_up.interrupted(None, "c", was_up=False)
    assert stopped == ["c"] and "still starting" in str(e.value)


def test_preempt_of_a_node_not_running_names_those_that_are(home: Path) -> None:
    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "running")
    store.upsert_node(_node("c", "n1", 1.0, 2.0))
    store.upsert_node(_node("c", "n6", 3.0))
    res = CliRunner().invoke(app, ["preempt", "n2"])
    assert isinstance(res.exception, NotFoundError)
    assert str(res.exception) == ("node n2 is not running in cluster c; its nodes now: n6 "
                                  "(`spotctl status`)")


def test_the_job_mark_refuses_another_scripts_checkpoints(home: Path, tmp_path: Path) -> None:
    store = Store(home)
    a = ClusterSpec(name="c", train={"script": str(tmp_path / "a" / "train.py")})
    b = ClusterSpec(name="c", train={"script": str(tmp_path / "b" / "train.py")})
    cdir = store.cluster_dir("c")
    jobmark.check(b, cdir)  # nothing recorded: nothing to refuse
    jobmark.mark(a, cdir)
    jobmark.check(b, cdir)  # no committed checkpoint yet: b may start
    step = cdir.checkpoints / "step-00000040"
    step.mkdir(parents=True)
    (cdir.checkpoints / "step-00000060").mkdir()  # not committed: not counted
    jobmark.check(b, cdir)
    (step / "COMMIT").write_text("{}")
    jobmark.check(a, cdir)  # its own job resumes
    with pytest.raises(SpecError, match=r"^cluster c has checkpoints \(step 40\) in .* from "
                       r"another job \(.*/a/train.py\), not this one's .*/b/train.py: "):
        jobmark.check(b, cdir)
    other = ClusterSpec(name="c", train={"script": str(tmp_path / "b" / "train.py"),
                                         "checkpoint_dir": str(tmp_path / "mine")})
    jobmark.check(other, cdir)  # other checkpoints: not the ones recorded


def test_preempt_on_a_finished_job_says_so(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotctl.control import reconcile

    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "running")
    store.upsert_node(_node("c", "n1", 1.0))
    head = {"nodes": {"n1": {"state": "finished", "step": 3000}}}
    monkeypatch.setattr(reconcile, "head_client", lambda *a, **k: type(
        "Head", (), {"status": lambda self: head})())
    res = CliRunner().invoke(app, ["preempt", "n1"])
    assert res.exit_code != 0 and str(res.exception) == (
        "the job on n1 already finished (step 3000): nothing to preempt")
    assert "notice sent" not in res.output
