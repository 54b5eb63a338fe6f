"""One crontab line per cluster that runs `spotctl rebalance` every few minutes.

The line carries a trailing tag `# spotctl:<name>` (the shell ignores it as a comment),
so install replaces exactly that line, remove deletes exactly that line, and every other
line of the user's crontab is left byte for byte. The command uses the absolute path of
the spotctl in use and pins SPOTCTL_HOME and PATH, since cron starts with a bare
environment. Output goes to `<cluster dir>/rebalance.log`.

The crontab is read and written with `crontab -l` / `crontab -`; SPOTCTL_CRONTAB names
another program with the same interface (tests use a fake that keeps the table in a file).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from spotctl.errors import SpecError, SpotctlError

TAG = "# spotctl:"
LOG_NAME = "rebalance.log"
_EVERY = re.compile(r"\s*(\d+)\s*([mh])\s*")


@dataclass(frozen=True)
class CronEntry:
    cluster: str
    schedule: str  # the five cron time fields
    line: str  # the whole crontab line, tag included
    log: str  # where its output goes

    def to_json(self) -> dict[str, str]:
        return {
            "cluster": self.cluster,
            "schedule": self.schedule,
            "line": self.line,
            "log": self.log,
        }


def parse_every(text: str) -> str:
    """`5m` -> `*/5 * * * *`, `2h` -> `0 */2 * * *`. Minutes 1-59 (or whole hours), hours
    1-24. Raises SpecError naming the flag."""
    m = _EVERY.fullmatch(text or "")
    bad = SpecError(
        f"--every: expected minutes or hours such as 5m or 1h (1-59m or 1-24h), got {text!r}"
    )
    if not m:
        raise bad
    n, unit = int(m.group(1)), m.group(2)
    if unit == "m" and n >= 60 and n % 60 == 0:
        n, unit = n // 60, "h"
    if unit == "m":
        if not 1 <= n <= 59:
            raise bad
        return "* * * * *" if n == 1 else f"*/{n} * * * *"
    if not 1 <= n <= 24:
        raise bad
    return "0 * * * *" if n == 1 else "0 0 * * *" if n == 24 else f"0 */{n} * * *"


def spotctl_executable() -> list[str]:
    """The command that runs this same spotctl, as absolute paths."""
    arg0 = sys.argv[0] if sys.argv else ""
    if Path(arg0).name.startswith("spotctl") and not arg0.endswith(".py"):
        p = Path(arg0) if os.sep in arg0 else Path(shutil.which(arg0) or arg0)
        if p.is_file() and os.access(p, os.X_OK):
            return [str(p.resolve())]
    found = shutil.which("spotctl")
    if found:
        return [str(Path(found).resolve())]
    return [str(Path(sys.executable).resolve()), "-m", "spotctl.cli.app"]


def _tag_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"(^|\s){re.escape(TAG)}{re.escape(name)}\s*$")


def _any_tag_re() -> re.Pattern[str]:
    return re.compile(rf"(^|\s){re.escape(TAG)}([a-z0-9-]+)\s*$")


def _cron_escape(cmd: str) -> str:
    # cron turns an unescaped % into a newline; nothing else in a command is special to it.
    return cmd.replace("%", r"\%")


def cron_command(line: str) -> str:
    """The shell command cron runs for `line` (time fields dropped, % unescaped)."""
    return line.split(None, 5)[5].replace(r"\%", "%")


def entry_line(name: str, schedule: str, exe: list[str], home: Path, log: Path) -> str:
    path = ":".join(dict.fromkeys([str(Path(exe[0]).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
    cmd = " ".join(
        [
            f"SPOTCTL_HOME={shlex.quote(str(home))}",
            f"PATH={shlex.quote(path)}",
            *(shlex.quote(x) for x in exe),
            "rebalance",
            "--name",
            shlex.quote(name),
            ">>",
            shlex.quote(str(log)),
            "2>&1",
        ]
    )
    return f"{schedule} {_cron_escape(cmd)} {TAG}{name}"


def with_entry(lines: list[str], name: str, line: str) -> list[str]:
    """`lines` with this cluster's line replaced (in place) or appended; one line only."""
    tag = _tag_re(name)
    out: list[str] = []
    placed = False
    for x in lines:
        if tag.search(x):
            if not placed:
                out.append(line)
                placed = True
            continue
        out.append(x)
    if not placed:
        out.append(line)
    return out


def without_entry(lines: list[str], name: str) -> list[str]:
    tag = _tag_re(name)
    return [x for x in lines if not tag.search(x)]


def entries(lines: list[str]) -> list[CronEntry]:
    out = []
    for x in lines:
        m = _any_tag_re().search(x)
        if not m or x.lstrip().startswith("#"):
            continue
        fields = x.split(None, 5)
        if len(fields) < 6:
            continue
        log = ""
        try:
            words = shlex.split(cron_command(x), comments=True)
        except ValueError:  # hand-edited line with broken quoting: still show it
            words = []
        if ">>" in words[:-1]:
            log = words[words.index(">>") + 1]
        out.append(CronEntry(m.group(2), " ".join(fields[:5]), x, log))
    return out


class Crontab:
    """The user's crontab through `crontab -l` / `crontab -` (or SPOTCTL_CRONTAB)."""

    def __init__(self, program: str | None = None):
        prog = program or os.environ.get("SPOTCTL_CRONTAB") or shutil.which("crontab")
        if not prog:
            raise SpotctlError(
                "crontab not found: install cron (e.g. `apt-get install cron`) "
                "or set SPOTCTL_CRONTAB"
            )
        self.program = prog

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.program, *args], input=stdin, capture_output=True, text=True, timeout=30
            )
        except OSError as e:
            raise SpotctlError(f"cannot run {self.program}: {e.strerror or e}") from None
        except subprocess.TimeoutExpired:
            raise SpotctlError(f"{self.program} {' '.join(args)} did not finish in 30s") from None

    def read(self) -> list[str]:
        r = self._run(["-l"])
        if r.returncode != 0:
            if "no crontab" in (r.stderr + r.stdout).lower():
                return []
            msg = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()
            raise SpotctlError(f"crontab -l failed: {msg[0]}")
        return r.stdout.splitlines()

    def write(self, lines: list[str]) -> None:
        text = "".join(x + "\n" for x in lines)
        r = self._run(["-"], stdin=text)
        if r.returncode != 0:
            msg = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()
            raise SpotctlError(f"crontab - failed: {msg[0]}")


def install(
    name: str, every: str, home: Path, cluster_dir: Path, tab: Crontab | None = None
) -> CronEntry:
    """Install (or update) this cluster's line; installing twice leaves one line."""
    schedule = parse_every(every)
    tab = tab or Crontab()
    cluster_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # the shell opens the log
    log = cluster_dir / LOG_NAME
    line = entry_line(name, schedule, spotctl_executable(), home, log)
    with _crontab_lock():
        lines = tab.read()
        new = with_entry(lines, name, line)
        if new != lines:
            tab.write(new)
    return CronEntry(name, schedule, line, str(log))


def remove(name: str, tab: Crontab | None = None) -> bool:
    """Remove this cluster's line; True when there was one. Other lines stay as they were."""
    tab = tab or Crontab()
    with _crontab_lock():
        lines = tab.read()
        new = without_entry(lines, name)
        if new == lines:
            return False
        tab.write(new)
    return True


@contextmanager
def _crontab_lock() -> Iterator[None]:
    """One read-modify-write of the crontab at a time (two `up`/`down` of different
    clusters would otherwise drop each other's line). A file lock in spotctl's home."""
    from spotctl.state import home

    fd = os.open(home() / "crontab.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def show(name: str | None = None, tab: Crontab | None = None) -> list[CronEntry]:
    found = entries((tab or Crontab()).read())
    return [e for e in found if name is None or e.cluster == name]


def replacement_hint(name: str, tab: Crontab | None = None) -> str:
    """What `up` says of a cloud cluster that nothing on this machine rebalances ("" when
    cron runs `spotctl rebalance` for it): lost nodes are replaced only by that (the head
    runs no reconcile loop), and a cluster below its minimum keeps its head billing."""
    try:
        if show(name, tab):
            return ""
    except SpotctlError:
        pass  # no usable crontab here: the way to replace nodes is the same
    return (f"nodes lost to preemption are replaced only by `spotctl rebalance` run on this "
            f"machine, and nothing runs it for {name}: `spotctl cron install --name {name}` "
            "(every 5 minutes), or keep `spotctl rebalance --watch` running")
