"""`spotctl cron`: one tagged crontab line per cluster, through a fake `crontab` program
(and the real one when this machine has it)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.cli.app import main
from spotctl.control import cron
from spotctl.errors import NotFoundError, SpecError, SpotctlError
from spotctl.state import Store

pytestmark = pytest.mark.planner

FAKE_CRONTAB = """#!/bin/sh
f="${FAKE_CRONTAB_FILE:?}"
case "$1" in
  -l) [ -f "$f" ] || { echo "no crontab for $(id -un)" >&2; exit 1; }; cat "$f" ;;
  -) [ -n "$FAKE_CRONTAB_FAIL" ] && { echo "crontab: cannot write" >&2; exit 1; }; cat > "$f" ;;
  *) echo "usage: crontab [-l | -]" >&2; exit 2 ;;
esac
"""

OTHER = ["# my own jobs", "MAILTO=me@example.invalid", "0 3 * * * /usr/bin/backup --all % x"]


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTCTL_HOME", str(home))
    table = tmp_path / "crontab.txt"
    monkeypatch.setenv("SPOTCTL_CRONTAB", str(executable(tmp_path / "crontab", FAKE_CRONTAB)))
    monkeypatch.setenv("FAKE_CRONTAB_FILE", str(table))
    # The spotctl "in use": a stand-in that records how cron would call it.
    bindir = tmp_path / "bin dir"  # a space, to prove the quoting
    bindir.mkdir()
    fake = executable(
        bindir / "spotctl",
        '#!/bin/sh\necho "argv: $*"\necho "home: $SPOTCTL_HOME"\necho "path: $PATH"\n',
    )
    monkeypatch.setattr(sys, "argv", [str(fake), "cron", "install"])
    s = Store()
    for n in ("c1", "c11"):
        s.upsert_cluster(n, "local", {"name": n}, "running")
    s.close()
    return {"home": home, "table": table, "fake": fake, "tmp": tmp_path}


def table_lines(env: dict[str, Path]) -> list[str]:
    return env["table"].read_text().splitlines() if env["table"].exists() else []


@pytest.mark.parametrize(
    "every,schedule",
    [
        ("5m", "*/5 * * * *"),
        ("1m", "* * * * *"),
        ("59m", "*/59 * * * *"),
        ("60m", "0 * * * *"),
        ("1h", "0 * * * *"),
        ("6h", "0 */6 * * *"),
        ("24h", "0 0 * * *"),
        (" 10m ", "*/10 * * * *"),
    ],
)
def test_rebalance_cron_every(every: str, schedule: str) -> None:
    assert cron.parse_every(every) == schedule


@pytest.mark.parametrize(
    "bad", ["", "5", "0m", "61m", "90m", "25h", "0h", "5s", "m5", "-5m", "5 m x", "1.5h"]
)
def test_rebalance_cron_bad_every_is_one_line(bad: str) -> None:
    with pytest.raises(SpecError) as e:
        cron.parse_every(bad)
    assert str(e.value).startswith("--every:") and "\n" not in str(e.value)


def test_rebalance_cron_table_editing_is_exact() -> None:
    a = "*/5 * * * * x rebalance --name a # spotctl:a"
    ab = "*/5 * * * * x rebalance --name ab # spotctl:ab"
    lines = [*OTHER, ab, a, a]
    new = cron.with_entry(lines, "a", "*/9 * * * * y # spotctl:a")
    assert new == [*OTHER, ab, "*/9 * * * * y # spotctl:a"]  # duplicates collapse to one
    assert cron.without_entry(new, "a") == [*OTHER, ab]
    assert cron.with_entry(OTHER, "a", a) == [*OTHER, a]
    assert [e.cluster for e in cron.entries(lines)] == ["ab", "a", "a"]


def test_rebalance_cron_install_twice_one_line_others_untouched(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    env["table"].write_text("\n".join(OTHER) + "\n")
    main(["cron", "install", "--name", "c1", "--every", "10m"])
    main(["cron", "install", "--name", "c1", "--every", "5m"])
    main(["cron", "install", "--name", "c11"])
    lines = table_lines(env)
    assert lines[:3] == OTHER
    mine = [x for x in lines if x.endswith("# spotctl:c1")]
    assert len(mine) == 1 and len(lines) == 5
    line = mine[0]
    assert line.startswith("*/5 * * * * ")
    assert str(env["fake"].resolve()) in line and "rebalance --name c1 >>" in line
    log = env["home"] / "clusters" / "c1" / "rebalance.log"
    assert str(log) in line and f"SPOTCTL_HOME={env['home']}" in line
    capsys.readouterr()
    main(["cron", "show", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert [(e["cluster"], e["schedule"], e["log"]) for e in shown] == [
        ("c1", "*/5 * * * *", str(log)),
        ("c11", "*/5 * * * *", str(env["home"] / "clusters" / "c11" / "rebalance.log")),
    ]
    main(["cron", "remove", "--name", "c1"])
    assert "removed" in capsys.readouterr().out
    lines = table_lines(env)
    assert lines[:3] == OTHER and len(lines) == 4 and lines[3].endswith("# spotctl:c11")
    main(["cron", "remove", "--name", "c1"])
    assert "no crontab line" in capsys.readouterr().out
    assert len(table_lines(env)) == 4


def test_rebalance_cron_line_runs_in_a_bare_cron_environment(env: dict[str, Path]) -> None:
    (entry,) = [cron.install("c1", "5m", env["home"], env["home"] / "clusters" / "c1")]
    # cron runs the command with /bin/sh and next to no environment.
    r = subprocess.run(
        ["env", "-i", "HOME=/nonexistent", "/bin/sh", "-c", cron.cron_command(entry.line)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    out = Path(entry.log).read_text()
    assert "argv: rebalance --name c1" in out
    assert f"home: {env['home']}" in out
    assert str(env["fake"].parent) in out.split("path: ")[1]


def test_rebalance_cron_executable_falls_back_to_path_or_module(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, Path]
) -> None:
    monkeypatch.setattr(sys, "argv", ["/usr/lib/python3/pytest"])
    monkeypatch.setenv("PATH", str(env["fake"].parent))
    assert cron.spotctl_executable() == [str(env["fake"].resolve())]
    monkeypatch.setenv("PATH", str(env["tmp"] / "nowhere"))
    exe = cron.spotctl_executable()
    assert exe[1:] == ["-m", "spotctl.cli.app"] and Path(exe[0]).is_absolute()


def test_rebalance_cron_errors_are_one_line(
    env: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, code in [
        (["cron", "install", "--name", "c1", "--every", "7x"], SpecError.exit_code),
        (["cron", "install", "--name", "nope"], NotFoundError.exit_code),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == code
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
    assert not env["table"].exists()  # nothing was written
    monkeypatch.setenv("FAKE_CRONTAB_FAIL", "1")
    with pytest.raises(SpotctlError, match="crontab - failed: crontab: cannot write"):
        cron.install("c1", "5m", env["home"], env["home"])
    monkeypatch.setenv("SPOTCTL_CRONTAB", str(env["tmp"] / "missing-crontab"))
    with pytest.raises(SpotctlError, match="cannot run"):
        cron.show()


@pytest.mark.skipif(shutil.which("crontab") is None, reason="no crontab on this machine")
def test_rebalance_cron_real_crontab_roundtrip(
    env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPOTCTL_CRONTAB")
    real = cron.Crontab()
    assert real.program == shutil.which("crontab")
    before = real.read()
    try:
        e = cron.install("c1", "24h", env["home"], env["home"] / "clusters" / "c1")
        e2 = cron.install("c1", "24h", env["home"], env["home"] / "clusters" / "c1")
        after = real.read()
        assert after.count(e.line) == 1 and e.line == e2.line
        assert [x for x in after if x != e.line] == before
        assert cron.remove("c1") and real.read() == before
    finally:
        if real.read() != before:
            real.write(before)


def test_up_hint_names_cron_until_a_line_rebalances_the_cluster(
    env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` on a cloud says that nothing here replaces lost nodes until cron (or a watch)
    runs `rebalance` for the cluster; once `cron install` did, it says nothing. Without a
    crontab on this machine, it still says how."""
    hint = cron.replacement_hint("c1")
    assert "replaced only by `spotctl rebalance`" in hint and "--name c1" in hint
    assert "\n" not in hint
    main(["cron", "install", "--name", "c11"])
    assert cron.replacement_hint("c1")  # c11's line is not c1's
    main(["cron", "install", "--name", "c1"])
    assert cron.replacement_hint("c1") == ""
    monkeypatch.setenv("SPOTCTL_CRONTAB", str(env["tmp"] / "missing-crontab"))
    assert "--name c1" in cron.replacement_hint("c1")
