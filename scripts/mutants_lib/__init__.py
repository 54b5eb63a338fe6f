"""Deliberate breakages and the tests that must catch them (scripts/mutants).

Each breakage is one edit of one file (breakages.toml). It is applied to a fresh copy of
the repository's HEAD (`git archive`, never the working tree), the breakage's tests run
there with that copy first on the import path, and the result is:

- killed: the tests failed (or ran past the time limit), so they see the breakage;
- survived: they passed with the breakage in place;
- error: the edit could not be applied (its `old` text is not there exactly once), or
  the copy imported its package from somewhere else.

The same tests are first run on an unbroken copy: a test that fails there proves nothing
about a breakage, so the run stops.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib

BREAKAGES = Path(__file__).resolve().parent / "breakages.toml"
FIELDS = {"id", "file", "old", "new", "breaks", "tests", "slow", "accepted"}
FAST_TIMEOUT_S = 600.0
SLOW_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Breakage:
    id: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in `file`
    new: str
    breaks: str  # what this breaks, in one line
    tests: tuple[str, ...]  # pytest node ids or paths that must fail
    slow: bool = False  # only a slow test sees it; --fast skips it
    accepted: str = ""  # why a survivor is tolerated ("" = it must be killed)


@dataclass
class Result:
    id: str
    outcome: str  # killed | survived | error
    seconds: float = 0.0
    detail: str = ""  # the last lines of pytest's output, or what went wrong
    accepted: str = ""
    slow: bool = False
    tests: list[str] = field(default_factory=list)


def load(path: Path = BREAKAGES) -> list[Breakage]:
    """The breakages in `path`; a malformed entry raises ValueError naming it."""
    data = tomllib.loads(path.read_text())
    out: list[Breakage] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("breakage", [])):
        where = f"{path.name}: breakage {raw.get('id', i)!r}"
        unknown = set(raw) - FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        for key in ("id", "file", "old", "new", "breaks"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise ValueError(f"{where}: {key} must be a non-empty string")
        tests = raw.get("tests")
        if not isinstance(tests, list) or not tests or not all(
                isinstance(t, str) and t for t in tests):
            raise ValueError(f"{where}: tests must be a non-empty list of node ids")
        if raw["old"] == raw["new"]:
            raise ValueError(f"{where}: new is the same as old")
        if raw["id"] in seen:
            raise ValueError(f"{where}: the id is used twice")
        seen.add(raw["id"])
        out.append(Breakage(id=raw["id"], file=raw["file"], old=raw["old"], new=raw["new"],
                            breaks=raw["breaks"], tests=tuple(tests),
                            slow=bool(raw.get("slow", False)),
                            accepted=str(raw.get("accepted", ""))))
    return out


def apply(root: Path, b: Breakage) -> str:
    """Apply `b` under `root`; returns "" or why it could not be applied."""
    path = root / b.file
    if not path.is_file():
        return f"{b.file}: no such file"
    text = path.read_text()
    n = text.count(b.old)
    if n != 1:
        return f"{b.file}: `old` occurs {n} times, not once"
    path.write_text(text.replace(b.old, b.new))
    return ""


def copy_head(repo: Path, dest: Path) -> None:
    """`repo`'s committed HEAD, extracted into `dest` (uncommitted changes left out)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "HEAD"],
                       stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as tf:
            tf.extractall(dest, filter="data")
    venv = repo / ".venv"
    if venv.is_dir() and not (dest / ".venv").exists():
        (dest / ".venv").symlink_to(venv.resolve())  # scripts that look for the venv


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def imports_from(python: str, copy: Path, package: str) -> str:
    """Where `package` is imported from when run in `copy` (an editable install of the
    original tree must not win over the copy)."""
    out = subprocess.run([python, "-c", f"import {package}; print({package}.__file__)"],
                         cwd=copy, env=env_for(copy), capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1:][0]


def run_tests(python: str, copy: Path, tests: Sequence[str], slow: bool
              ) -> tuple[int | None, str]:
    """(pytest's exit code or None on timeout, the tail of its output). Unless `slow`, the
    slow tests in a named file or directory are left out (a fast breakage that names a
    slow test by id then collects nothing, exit 5)."""
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           *([] if slow else ["-m", "not slow"]), *tests]
    timeout_s = SLOW_TIMEOUT_S if slow else FAST_TIMEOUT_S
    try:
        out = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        return None, (text or "")[-2000:]
    return out.returncode, (out.stdout + out.stderr)[-2000:]


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(x.strip() for x in text.strip().splitlines()[-lines:])


def baseline(repo: Path, breakages: Iterable[Breakage], python: str = sys.executable,
             package: str = "spotctl", work: Path | None = None) -> str:
    """Run every named test once on an unbroken copy: "" when all pass, else why not."""
    chosen = list(breakages)
    with tempfile.TemporaryDirectory(prefix="mutants-base-", dir=work) as tmp:
        copy = Path(tmp) / "repo"
        copy_head(repo, copy)
        where = imports_from(python, copy, package)
        if not where.startswith(str(copy)):
            return f"the copy imports {package} from {where}, not from itself"
        for slow in (False, True):
            tests = sorted({t for b in chosen if b.slow == slow for t in b.tests})
            if not tests:
                continue
            code, out = run_tests(python, copy, tests, slow)
            if code != 0:
                return (f"the tests fail with nothing broken (pytest exit {code}): "
                        f"{_tail(out, 12)}")
    return ""


def run_one(repo: Path, b: Breakage, python: str = sys.executable, package: str = "spotctl",
            work: Path | None = None) -> Result:
    """Apply `b` to a fresh copy of `repo`'s HEAD and run its tests there."""
    import time

    res = Result(id=b.id, outcome="error", accepted=b.accepted, slow=b.slow,
                 tests=list(b.tests))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-", dir=work) as tmp:
        copy = Path(tmp) / "repo"
        copy_head(repo, copy)
        why = apply(copy, b)
        if why:
            res.detail = why
            return res
        where = imports_from(python, copy, package)
        if not where.startswith(str(copy)):
            res.detail = f"the copy imports {package} from {where}, not from itself"
            return res
        code, out = run_tests(python, copy, b.tests, b.slow)
    res.seconds = round(time.monotonic() - t0, 1)
    if code is None:
        res.outcome, res.detail = "killed", "timed out"
    elif code == 0:
        res.outcome, res.detail = "survived", _tail(out, 1)
    elif code in (1, 2):  # failed, or could not even be collected with the breakage in
        res.outcome, res.detail = "killed", _tail(out, 1)
    else:  # 3-5: internal error, usage error (an unknown node id), no tests collected
        res.detail = f"pytest exit {code}: {_tail(out)}"
    return res


def failing(results: Iterable[Result]) -> list[Result]:
    """Results that fail a run: errors, and survivors not listed as accepted."""
    return [r for r in results
            if r.outcome == "error" or (r.outcome == "survived" and not r.accepted)]


def table(results: Sequence[Result]) -> str:
    rows = [f"{'breakage':36} {'result':9} {'secs':>6}  note"]
    for r in results:
        note = r.accepted if (r.outcome == "survived" and r.accepted) else (
            r.detail if r.outcome != "killed" else "")
        label = r.outcome + (" (accepted)" if r.outcome == "survived" and r.accepted else "")
        rows.append(f"{r.id:36} {label:9} {r.seconds:6.1f}  {note[:100]}")
    killed = sum(r.outcome == "killed" for r in results)
    judged = sum(r.outcome in ("killed", "survived") for r in results)
    rows.append(f"score: {killed}/{judged} killed"
                + (f", {len(results) - judged} error(s)" if judged < len(results) else ""))
    return "\n".join(rows)


def to_json(results: Sequence[Result]) -> dict[str, Any]:
    return {
        "killed": sum(r.outcome == "killed" for r in results),
        "survived": sum(r.outcome == "survived" for r in results),
        "errors": sum(r.outcome == "error" for r in results),
        "results": [asdict(r) for r in results],
    }
