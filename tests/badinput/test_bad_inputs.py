"""Issues 9 and 14, bad input: every case goes through the real CLI entry point
(`spotctl.cli.app.main`, its error mapping and exit codes) and must exit 2 (spec and flag
errors; 3 for an unknown cluster or node), give exactly one line naming what is wrong
(`error: ...`, or click's usage block with one `Error: ...` line), no traceback, and start
nothing: no cluster row in the state journal, no process tagged with the test's
SPOTCTL_HOME, no cluster directory holding a head or nodes. Every case runs in this
process; a sample of them (SUBPROCESS) also as `python -m spotctl.cli.app`, where the exit
status and stderr are what a shell sees (120 interpreter starts were half the fast set's
CPU time)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from spotctl.agent import proctree
from tests.conftest import cli_main

SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]
ENV = {"NO_COLOR": "1", "COLUMNS": "200"}

HEAD = 'name = "bad"\nprovider = "local"\ngpus = "1..2"\n'
TRAIN = '\n[train]\nscript = "train.py"\n'
OK = HEAD + TRAIN


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    expect: str  # a fragment (case-insensitive) the error line must contain: the field named
    toml: str | None = OK  # ./spotctl.toml (None: no file)
    files: dict[str, str] = field(default_factory=dict)  # more files in the project dir
    no_train_py: bool = False
    existing_cluster: bool = False  # journal a (down) cluster "live" first
    rc: int = 2  # spec and flag errors exit 2; others name their class (errors.py)


def up(*extra: str) -> tuple[str, ...]:
    return ("up", "--wait", "5", *extra)


CASES: list[Case] = [
    # --- malformed spec files
    Case("toml-syntax", up(), "not valid TOML", toml='name = "bad"\ngpus = [1, \n'),
    Case("toml-unclosed-string", up(), "not valid TOML", toml='name = "bad\n'),
    Case("toml-duplicate-key", up(), "not valid TOML", toml=HEAD + 'name = "again"\n' + TRAIN),
    Case("toml-binary", up(), "UTF-8", toml=None, files={"spotctl.toml": "\udcff"}),
    Case("unknown-top-key", up(), "colour: unknown key", toml=OK + "colour = 1\n"),
    Case(
        "unknown-train-key",
        up(),
        "train.scirpt: unknown key",
        toml=HEAD + '[train]\nscirpt = "train.py"\n',
    ),
    Case("unknown-section", up(), "azure: unknown key", toml=OK + "[azure]\nregion = 'x'\n"),
    Case(
        "unknown-local-key",
        up(),
        "local.gpu_per_node: unknown key",
        toml=OK + "[local]\ngpu_per_node = 1\n",
    ),
    Case("train-not-table", up(), "train", toml=HEAD + 'train = "train.py"\n'),
    Case(
        "checkpoint-every-string",
        up(),
        "train.checkpoint_every",
        toml=HEAD + '[train]\nscript = "train.py"\ncheckpoint_every = "often"\n',
    ),
    Case(
        "checkpoint-every-zero",
        up(),
        "train.checkpoint_every",
        toml=HEAD + '[train]\nscript = "train.py"\ncheckpoint_every = 0\n',
    ),
    Case(
        "keep-last-zero",
        up(),
        "train.keep_last",
        toml=HEAD + '[train]\nscript = "train.py"\nkeep_last = 0\n',
    ),
    Case(
        "max-steps-negative",
        up(),
        "train.max_steps",
        toml=HEAD + '[train]\nscript = "train.py"\nmax_steps = -5\n',
    ),
    Case(
        "train-args-not-list",
        up(),
        "train.args",
        toml=HEAD + '[train]\nscript = "train.py"\nargs = "--lr 1"\n',
    ),
    Case(
        "train-env-not-strings",
        up(),
        "train.env",
        toml=HEAD + '[train]\nscript = "train.py"\nenv = { A = [1] }\n',
    ),
    Case(
        "provider-unknown-toml", up(), "provider", toml='name = "bad"\nprovider = "azure"\n' + TRAIN
    ),
    Case(
        "gpus-inverted-toml",
        up(),
        "gpus: range 4..2 is inverted",
        toml='name = "bad"\ngpus = "4..2"\n' + TRAIN,
    ),
    Case("gpus-bool-toml", up(), "gpus", toml='name = "bad"\ngpus = true\n' + TRAIN),
    Case("gpus-float-toml", up(), "gpus", toml='name = "bad"\ngpus = 2.5\n' + TRAIN),
    Case("name-uppercase-toml", up(), "name", toml='name = "BadName"\n' + TRAIN),
    Case("name-int-toml", up(), "name", toml="name = 7\n" + TRAIN),
    Case(
        "budget-negative-toml",
        up(),
        "budget.max_usd_per_hour",
        toml=OK + "[budget]\nmax_usd_per_hour = -1\n",
    ),
    Case(
        "budget-string-toml",
        up(),
        "budget.max_usd_per_hour",
        toml=OK + '[budget]\nmax_usd_per_hour = "cheap"\n',
    ),
    Case(
        "capacity-out-of-order",
        up(),
        "local.capacity",
        toml=OK + "[[local.capacity]]\nat_s = 10\nnodes = 2\n"
        "[[local.capacity]]\nat_s = 5\nnodes = 1\n",
    ),
    Case(
        "capacity-negative-nodes",
        up(),
        "local.capacity",
        toml=OK + "[[local.capacity]]\nat_s = 0\nnodes = -1\n",
    ),
    Case(
        "gpus-per-node-zero", up(), "local.gpus_per_node", toml=OK + "[local]\ngpus_per_node = 0\n"
    ),
    Case("local-zones-not-list", up(), "local.zones", toml=OK + '[local]\nzones = "a"\n'),
    Case("local-netns-and-private-network", up(), "private_network",
         toml=OK + "[local]\nnetns = true\nprivate_network = true\n"),
    # issue 61: the link model and placement beyond one region
    Case("local-link-without-netns", up(), "netns",
         toml=OK + '[local]\nlink_between_zones = "100mbit 40ms"\n'),
    Case("local-link-not-a-link", up(), "local.link_in_zone",
         toml=OK + '[local]\nnetns = true\nlink_in_zone = "fast"\n'),
    Case("placement-two-regions", up(), "encrypted and authenticated",
         toml=OK + '[placement]\nregions = ["local", "elsewhere"]\n'),
    Case("placement-two-providers", up(), "encrypted and authenticated",
         toml=OK + '[placement]\nproviders = ["aws", "gcp"]\n'),
    Case("ssh-without-hosts", up(), "ssh.hosts", toml='name = "bad"\nprovider = "ssh"\n' + TRAIN),
    Case(
        "ssh-host-bad-port",
        up(),
        "ssh.hosts",
        toml='name = "bad"\nprovider = "ssh"\n'
        + TRAIN
        + '[[ssh.hosts]]\naddress = "127.0.0.1"\nport = 70000\n',
    ),
    Case(
        "ssh-host-no-address",
        up(),
        "address",
        toml='name = "bad"\nprovider = "ssh"\n' + TRAIN + "[[ssh.hosts]]\nport = 22\n",
    ),
    Case(
        "ssh-key-missing",
        up(),
        "ssh.hosts.0.key",
        toml='name = "bad"\nprovider = "ssh"\n'
        + TRAIN
        + '[[ssh.hosts]]\naddress = "127.0.0.1"\nport = 1\nkey = "/nonexistent/id_ed25519"\n',
    ),
    Case(
        "rebalance-pct-over-100",
        up(),
        "rebalance.replace_saving_pct",
        toml=OK + "[rebalance]\nreplace_saving_pct = 150\n",
    ),
    Case(
        "rebalance-unknown-key",
        up(),
        "rebalance.interval: unknown key",
        toml=OK + "[rebalance]\ninterval = 5\n",
    ),
    # --- flags
    Case("gpus-inverted", up("--gpus", "8..4"), "gpus: range 8..4 is inverted"),
    Case("gpus-zero", up("--gpus", "0"), "gpus"),
    Case("gpus-zero-range", up("--gpus", "0..4"), "gpus"),
    Case("gpus-negative", up("--gpus", "-2"), "gpus"),
    Case("gpus-garbage", up("--gpus", "lots"), "gpus"),
    Case("gpus-three-dots", up("--gpus", "1...4"), "gpus"),
    Case("gpus-huge", up("--gpus", "1..99999"), "gpus"),
    Case("provider-unknown-flag", up("--provider", "azure"), "provider"),
    Case("name-bad-flag", up("--name", "Has Spaces"), "name"),
    Case("name-too-long", up("--name", "a" * 60), "name"),
    Case("name-trailing-dash", up("--name", "bad-"), "name"),
    Case("budget-negative-flag", up("--budget", "-3"), "--budget"),
    Case("budget-garbage-flag", up("--budget", "cheap"), "--budget"),
    Case("checkpoint-every-flag-zero", up("--checkpoint-every", "0"), "--checkpoint-every"),
    Case("max-steps-flag-negative", up("--max-steps", "-1"), "--max-steps"),
    Case("wait-negative", up("--wait", "-1"), "--wait"),
    Case("unknown-flag", up("--colour", "red"), "--colour"),
    # --- missing files
    Case("missing-config", up("--config", "nope.toml"), "nope.toml not found", toml=None),
    Case("missing-train-script", up(), "train.script", no_train_py=True),
    Case("missing-script-flag", up("--script", "nope.py"), "nope.py"),
    Case("config-is-dir", up("--config", "adir"), "adir", toml=None, files={"adir/x": ""}),
    # --- unknown names
    Case("status-unknown", ("status", "--name", "ghost", "--json"), "ghost", rc=3),
    Case("down-unknown", ("down", "--name", "ghost", "--yes"), "ghost", rc=3),
    Case("logs-unknown-cluster", ("logs", "n1", "--name", "ghost"), "ghost", rc=3),
    Case("preempt-unknown-cluster", ("preempt", "n1", "--name", "ghost"), "ghost", rc=3),
    Case("kill-unknown-cluster", ("kill", "n1", "--name", "ghost"), "ghost", rc=3),
    Case("events-unknown", ("events", "--name", "ghost"), "ghost", rc=3),
    Case("cost-unknown", ("cost", "--name", "ghost"), "ghost", rc=3),
    Case("cron-install-unknown", ("cron", "install", "--name", "ghost"), "ghost", rc=3),
    Case(
        "preempt-bad-style",
        ("preempt", "n1", "--name", "live", "--style", "bogus"),
        "--style",
        existing_cluster=True,
    ),
    Case("preempt-unknown-node", ("preempt", "n9", "--name", "live"), "n9", existing_cluster=True, rc=3),
    Case(
        "preempt-in-zero",
        ("preempt", "n1", "--name", "live", "--in", "0"),
        "--in",
        existing_cluster=True,
    ),
    Case("kill-unknown-node", ("kill", "n9", "--name", "live"), "n9", existing_cluster=True, rc=3),
    Case("logs-unknown-node", ("logs", "n9", "--name", "live"), "n9", existing_cluster=True, rc=3),
    Case(
        "logs-bad-kind",
        ("logs", "head", "--name", "live", "--log", "bogus"),
        "--log",
        existing_cluster=True,
    ),
    Case(
        "cron-every-bogus",
        ("cron", "install", "--name", "live", "--every", "bogus"),
        "--every",
        existing_cluster=True,
    ),
    Case(
        "cron-every-zero",
        ("cron", "install", "--name", "live", "--every", "0m"),
        "--every",
        existing_cluster=True,
    ),
    Case(
        "cron-every-too-many-hours",
        ("cron", "install", "--name", "live", "--every", "25h"),
        "--every",
        existing_cluster=True,
    ),
    Case(
        "status-interval-too-small",
        ("status", "--name", "live", "--interval", "0"),
        "--interval",
        existing_cluster=True,
    ),
    Case("unknown-command", ("teleport",), "teleport"),
    Case("simulate-missing-trace", ("simulate", "--trace", "nope.csv"), "--trace"),
    Case(
        "simulate-bad-policy", ("simulate", "--trace", "p3-trace", "--policy", "bogus"), "--policy"
    ),
    Case("simulate-zero-nodes", ("simulate", "--trace", "p3-trace", "--nodes", "0"), "--nodes"),
    Case("simulate-bad-engine", ("simulate", "--trace", "p3-trace", "--engine", "horovod"),
         "--engine"),
    Case("prices-unknown-provider", ("prices", "--provider", "azure"), "azure"),
    Case("init-exists", ("init", "."), "already exists"),
]


# Issue 14: classes of input that reach shells, unit files, crontabs or numbers
SSH = 'name = "bad"\nprovider = "ssh"\n' + TRAIN + "\n[[ssh.hosts]]\n"
CASES += [
    Case("name-newline-flag", up("--name", "demo\n"), "name"),
    Case("name-newline-toml", up(), "name", toml='name = "demo\\n"\n' + TRAIN),
    Case("name-cr-flag", up("--name", "demo\rx"), "name"),
    Case("gpus-arabic-indic-digit", up("--gpus", "\u0663"), "gpus"),
    Case("gpus-fullwidth-range", up("--gpus", "\uff11..\uff12"), "gpus"),
    Case("budget-inf-flag", up("--budget", "inf"), "budget"),
    Case("budget-nan-flag", up("--budget", "nan"), "budget"),
    Case("budget-inf-toml", up(), "budget", toml=OK + "[budget]\nmax_usd_per_hour = inf\n"),
    Case("budget-huge-toml", up(), "budget", toml=OK + "[budget]\nmax_usd_per_hour = 1e308\n"),
    Case("local-price-nan", up(), "local.price_per_node",
         toml=OK + "[local]\nprice_per_node = nan\n"),
    Case("capacity-at-inf", up(), "local.capacity",
         toml=OK + "[local]\ncapacity = [{at_s = inf, nodes = 1}]\n"),
    Case("cooldown-inf", up(), "rebalance.cooldown_s",
         toml=OK + "[rebalance]\ncooldown_s = inf\n"),
    Case("env-key-with-equals", up(), "train.env", toml=OK + '[train.env]\n"A=B" = "x"\n'),
    Case("env-key-empty", up(), "train.env", toml=OK + '[train.env]\n"" = "x"\n'),
    Case("env-key-newline", up(), "train.env", toml=OK + '[train.env]\n"A\\nB" = "x"\n'),
    Case("env-key-digit-first", up(), "train.env", toml=OK + '[train.env]\n"1A" = "x"\n'),
    Case("env-value-nul", up(), "train.env", toml=OK + '[train.env]\nA = "x\\u0000y"\n'),
    Case("train-python-newline", up(), "train.python",
         toml=HEAD + '[train]\nscript = "train.py"\npython = "python3\\nExecStartPre=/bin/sh"\n'),
    Case("train-args-newline", up(), "train.args",
         toml=HEAD + '[train]\nscript = "train.py"\nargs = ["--x\\ny"]\n'),
    Case("checkpoint-dir-newline", up(), "train.checkpoint_dir",
         toml=HEAD + '[train]\nscript = "train.py"\ncheckpoint_dir = "a\\nb"\n'),
    Case("ssh-address-is-an-option", up(), "ssh.hosts.0.address",
         toml=SSH + 'address = "-oProxyCommand=touch /tmp/pwned"\n'),
    Case("ssh-address-space", up(), "ssh.hosts.0.address", toml=SSH + 'address = "a b"\n'),
    Case("ssh-address-newline", up(), "ssh.hosts.0.address", toml=SSH + 'address = "a\\nb"\n'),
    Case("ssh-user-newline", up(), "ssh.hosts.0.user",
         toml=SSH + 'address = "10.0.0.1"\nuser = "root\\nExecStart=/bin/sh"\n'),
    Case("ssh-user-is-an-option", up(), "ssh.hosts.0.user",
         toml=SSH + 'address = "10.0.0.1"\nuser = "-oProxyCommand=x"\n'),
    Case("ssh-notice-file-newline", up(), "ssh.hosts.0.notice_file",
         toml=SSH + 'address = "10.0.0.1"\nnotice_file = "a\\nb"\n'),
    Case("dry-run-missing-script", up("--dry-run"), "train.script", no_train_py=True),
    Case("zones-newline", up(), "local.zones", toml=OK + '[local]\nzones = ["a\\nb"]\n'),
    Case("prices-catalog-unknown-region", ("prices", "--catalog", "--region", "mars-1"),
         "--region"),
    Case("prices-gcp-catalog-unknown-region",
         ("prices", "--provider", "gcp", "--catalog", "--region", "mars-1"), "--region"),
    Case("simulate-hours-nan", ("simulate", "--trace", "p3-trace", "--hours", "nan"), "--hours"),
    Case("simulate-reconcile-interval-tiny",
         ("simulate", "--trace", "p3-trace", "--reconcile-interval", "1e-9"),
         "--reconcile-interval"),
    Case("simulate-spot-price-huge", ("simulate", "--trace", "p3-trace", "--spot-price", "1e308"),
         "--spot-price"),
    Case("simulate-step-time-inf", ("simulate", "--trace", "p3-trace", "--step-time", "inf"),
         "--step-time"),
    Case("simulate-gap-huge", ("simulate", "--trace", "t.json"), "gap_seconds",
         files={"t.json": '{"metadata": {"gap_seconds": 1e308}, "data": [1, 2]}'}),
    Case("simulate-trace-price-huge", ("simulate", "--trace", "t.json"), "prices[0]",
         files={"t.json": '{"metadata": {"gap_seconds": 60}, "data": [1], "prices": [1e308]}'}),
    Case("simulate-csv-time-huge", ("simulate", "--trace", "t.csv"), "row 2",
         files={"t.csv": "0,add,a\n100000000000000000000000,add,b\n"}),
]

# Issue 31 (8): inputs that were accepted
CASES += [
    Case("max-steps-huge-int", up(), "train.max_steps",
         toml=HEAD + '[train]\nscript = "train.py"\nmax_steps = ' + "1" + "0" * 29 + "\n"),
    Case("max-steps-huge-flag", up("--max-steps", "1" + "0" * 29), "--max-steps"),
    Case("zone-200k-chars", up(), "local.zones",
         toml=OK + '[local]\nzones = ["' + "a" * 200_000 + '"]\n'),
    Case("aws-zone-200k-chars", up(), "aws.zones",
         toml=OK + '[aws]\nzones = ["' + "a" * 200_000 + '"]\n'),
    Case("arg-200k-chars", up(), "train.args",
         toml=HEAD + '[train]\nscript = "train.py"\nargs = ["' + "a" * 200_000 + '"]\n'),
    Case("aws-ssh-cidr-open-to-all", up(), "aws.ssh_cidr",
         toml=OK + '[aws]\nssh_cidr = "0.0.0.0/0"\n'),
    Case("gcp-ssh-cidr-open-to-all-v6", up(), "gcp.ssh_cidr", toml=OK + '[gcp]\nssh_cidr = "::/0"\n'),
    Case("gcp-ssh-cidr-not-a-cidr", up(), "gcp.ssh_cidr", toml=OK + '[gcp]\nssh_cidr = "anywhere"\n'),
    Case("preempt-in-inf", ("preempt", "n1", "--name", "live", "--in", "inf"), "--in",
         existing_cluster=True),
    # a training script that is not Python (it used to crash-loop while `up` exited 0)
    Case("script-etc-passwd", up(), "train.script",
         toml=HEAD + '[train]\nscript = "/etc/passwd"\n'),
    Case("script-not-python", up(), "not a Python file",
         toml=HEAD + '[train]\nscript = "run.sh"\n', files={"run.sh": "echo hi\n"}),
]


def _journal_cluster(home: Path, name: str) -> None:
    """A cluster that exists in the journal but runs nothing (as after `down`)."""
    from spotctl.state import Store

    old = os.environ.get("SPOTCTL_HOME")
    os.environ["SPOTCTL_HOME"] = str(home)
    try:
        Store().upsert_cluster(name, "local", {"name": name, "provider": "local"}, "down")
    finally:
        if old is None:
            os.environ.pop("SPOTCTL_HOME")
        else:
            os.environ["SPOTCTL_HOME"] = old


def _clusters(home: Path) -> list[str]:
    db = home / "state.db"
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT name FROM clusters")]
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("error:", "Error:"))]


def _project(case: Case, tmp_path: Path) -> tuple[Path, Path]:
    home, proj = tmp_path / "home", tmp_path / "proj"
    proj.mkdir()
    if case.toml is not None:
        (proj / "spotctl.toml").write_text(case.toml)
    if not case.no_train_py:
        (proj / "train.py").write_text("raise SystemExit('bad-input tests never train')\n")
    for rel, text in case.files.items():
        p = proj / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode("utf-8", "surrogateescape"))
    if case.existing_cluster:
        _journal_cluster(home, "live")
    return home, proj


def _check(case: Case, home: Path, before: set[str], rc: int, stdout: str, stderr: str) -> None:
    out = stdout + stderr
    assert rc == case.rc, f"exit {rc}, want {case.rc}:\n{out}"
    assert "Traceback" not in out, out
    lines = _error_lines(stderr)
    assert len(lines) == 1, f"want exactly one error line, got:\n{stderr}"
    assert case.expect.lower() in lines[0].lower(), f"{lines[0]!r} does not name {case.expect!r}"
    if lines[0].startswith("error:"):
        # a spotctl error is the only thing on stderr: one line, nothing else
        assert stderr.strip() == lines[0], stderr
    # nothing started
    assert set(_clusters(home)) == before
    assert proctree.tagged_prefix(str(home) + "/") == []
    cdirs = home / "clusters"
    if cdirs.exists():
        for d in cdirs.iterdir():
            assert not (d / "head" / "head.json").exists(), d
            assert not any((d / "nodes").glob("*/vm.json")), d


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    home, proj = _project(case, tmp_path)
    before = set(_clusters(home))
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SPOTCTL_HOME", str(home))
    monkeypatch.chdir(proj)
    rc, out, err = cli_main(capsys, *case.argv)
    _check(case, home, before, rc, out, err)


# one of each kind of failure, through a real interpreter: spec file, flags, click's own
# usage error, an unknown cluster and node (exit 3), a trace file, an existing cluster
SUBPROCESS = ["toml-syntax", "toml-binary", "unknown-train-key", "missing-script-flag",
              "gpus-fullwidth-range", "budget-inf-flag", "preempt-unknown-node", "cost-unknown",
              "logs-bad-kind", "simulate-csv-time-huge"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS],
                         ids=lambda c: c.id)  # fmt: skip
def test_bad_input_as_a_process(case: Case, tmp_path: Path) -> None:
    home, proj = _project(case, tmp_path)
    before = set(_clusters(home))
    env = dict(os.environ, SPOTCTL_HOME=str(home), **ENV)
    p = subprocess.run([*SPOTCTL, *case.argv], cwd=proj, env=env, text=True,
                       capture_output=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    _check(case, home, before, p.returncode, p.stdout, p.stderr)


def test_process_sample_names_real_cases() -> None:
    assert set(SUBPROCESS) <= {c.id for c in CASES}
    assert {c.rc for c in CASES if c.id in SUBPROCESS} == {c.rc for c in CASES}


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 50
    assert len({c.id for c in CASES}) == len(CASES)
