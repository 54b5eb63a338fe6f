"""CLI behaviour without a cluster: init, bad input, unknown clusters (typer CliRunner)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from spotctl.cli.app import app, main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_init_writes_templates(home, capsys):
    r = CliRunner().invoke(app, ["init", str(home / "proj")])
    assert r.exit_code == 0, r.output
    assert "elastic.Run" in (home / "proj" / "train.py").read_text()
    spec = home / "proj" / "spotctl.toml"
    assert 'provider = "local"' in spec.read_text()
    spec.write_text(spec.read_text() + "# mine\n")
    # no silent overwrite: one line naming the file, exit 2, the user's file untouched
    code, out, err = run(["init", str(home / "proj")], capsys)
    assert code == 2, (code, out, err)
    assert err.strip().splitlines() == [f"error: {spec} already exists (use --force to overwrite)"]
    assert spec.read_text().endswith("# mine\n")


@pytest.mark.parametrize("engine", ["torchrun", "torchft"])
def test_init_engine_is_written_and_parsed(home, capsys, engine):
    from spotctl.spec import load_spec

    code, out, err = run(["init", str(home / "proj"), "--engine", engine], capsys)
    assert code == 0, err
    spec = home / "proj" / "spotctl.toml"
    assert load_spec(spec).train.engine == engine
    # the template's comment (the choices) stays
    line = next(x for x in spec.read_text().splitlines() if x.startswith("engine = "))
    assert line.startswith(f'engine = "{engine}"') and "| torchrun (restart" in line


def test_init_default_engine_is_torchft(home, capsys):
    from spotctl.spec import load_spec

    code, out, err = run(["init", str(home / "proj")], capsys)
    assert code == 0, err
    assert load_spec(home / "proj" / "spotctl.toml").train.engine == "torchft"


def test_init_unknown_engine_one_line_exit_2_nothing_written(home, capsys):
    code, out, err = run(["init", str(home / "proj"), "--engine", "horovod"], capsys)
    assert code == 2, (code, out, err)
    assert err.strip().splitlines() == [
        "error: --engine must be one of torchrun, torchft, got 'horovod'"]
    assert not (home / "proj").exists()


@pytest.mark.parametrize("argv,needle", [
    (["up", "--gpus", "4..2"], "gpus: range 4..2 is inverted"),
    (["up", "--gpus", "0"], "gpus: range 0..0 must be positive"),
    (["up", "--gpus", "x"], "gpus: expected MIN..MAX"),
    (["up", "--provider", "azure"], "provider:"),
    (["up", "--gpus", "2", "--script", "missing.py"], "train.script: training script"),
    (["up", "--name", "Bad_Name"], "name:"),
    # `--` would make one cluster's GCP worker names start like another's
    (["up", "--name", "team--a"], "name: 'team--a' is not a valid cluster name"),
    (["up", "--config", "nope.toml"], "config file nope.toml not found"),
])
def test_up_bad_input_one_line_exit_2_nothing_started(home, capsys, argv, needle):
    code, out, err = run(argv, capsys)
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error: ")
    assert "Traceback" not in err
    assert not (home / "home" / "clusters").exists()  # nothing was started


def test_up_default_engine_without_torchft_one_line_exit_2_nothing_started(
        home, capsys, monkeypatch):
    from spotctl.control.reconcile import check_engine
    from spotctl.spec import load_spec

    assert run(["init", "."], capsys)[0] == 0
    monkeypatch.setitem(sys.modules, "torchft", None)  # this controller has no torchft
    code, out, err = run(["up"], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert lines[0].startswith('error: train.engine = "torchft"') and "spotctl[train]" in lines[0]
    assert not (home / "home" / "clusters").exists()  # nothing was started
    spec = load_spec(home / "spotctl.toml")
    spec.train.engine = "torchrun"
    check_engine(spec)  # the other engine does not need it


@pytest.mark.parametrize("cmd", [["status"], ["down", "--yes"], ["events"], ["logs", "n1"],
                                 ["preempt", "n1"], ["rebalance"]])
def test_unknown_cluster(home, capsys, cmd):
    code, out, err = run([*cmd, "--name", "ghost"], capsys)
    assert code == 3 and "ghost" in err and len(err.strip().splitlines()) == 1


def test_list_json_empty(home, capsys):
    code, out, err = run(["list", "--json"], capsys)
    assert code == 0 and json.loads(out) == []


def test_usage_error_is_short(home, capsys):
    code, out, err = run(["status", "--bogus"], capsys)
    assert code == 2 and "No such option" in err and "Traceback" not in err


def test_up_dry_run_names_the_network_of_local_nodes(home):
    (home / "train.py").write_text("")
    r = CliRunner().invoke(app, ["up", "--dry-run", "--gpus", "2", "--name", "netdry"])
    assert r.exit_code == 0, r.output
    # (rich wraps the line at the terminal's width: compare words)
    assert "network loopback (a process tree on this machine)" in " ".join(r.stdout.split()), r.stdout
    r = CliRunner().invoke(app, ["up", "--dry-run", "--gpus", "2", "--name", "netdry", "--json"])
    assert r.exit_code == 0, r.output
    (a,) = json.loads(r.stdout)["actions"]
    assert a["network"].startswith("loopback") and a["zone"] == "local-a"


def test_the_cli_the_head_supervisor_and_the_agent_import_no_torch() -> None:
    """Importing torch costs about two CPU-seconds: the CLI, the head's supervisor (which
    only restarts the head) and the node agent must not pay it on every start."""
    import subprocess

    code = ("import sys, spotctl.cli.app, spotctl.cli.cmd_internal, spotctl.head.server, "
            "spotctl.agent.supervisor; print(sorted(m for m in sys.modules if m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"

