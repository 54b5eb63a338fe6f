"""mutmut over the modules that decide correctness (`scripts/mutants --mutmut`).

mutmut (pinned in the dev extra) generates the mutants itself: every operator, constant,
comparison and argument of a module, one at a time. Each module in mutmut.toml is run in
a fresh copy of the committed HEAD with only its own tests (the fast ones), and the result
is one row per module (mutants, killed, survived, reached by no test, timed out) and the
survivors, each shown as the line it changed. A survivor listed under [[accepted]] in
mutmut.toml (matched by module and by the changed line before and after, so a renumbering
of mutants does not lose it) is counted apart, with its reason.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from mutants_lib import copy_head

MUTMUT_TOML = Path(__file__).resolve().parent / "mutmut.toml"
RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Module:
    path: str  # relative to the repository root
    tests: tuple[str, ...]
    # tests (node ids, or their prefixes) left out: those that fork or spawn processes
    # importing the module, which mutmut's in-process run cannot follow (its stats run
    # fails on them)
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class Accepted:
    module: str
    old: str  # the line as it is (stripped)
    new: str  # the line as the mutant has it (stripped)
    why: str


@dataclass
class Survivor:
    name: str  # mutmut's mutant name
    old: str
    new: str
    accepted: str = ""


@dataclass
class ModuleResult:
    path: str
    counts: dict[str, int] = field(default_factory=dict)
    survivors: list[Survivor] = field(default_factory=list)
    untested: dict[str, int] = field(default_factory=dict)  # function -> mutants no test ran
    seconds: float = 0.0
    error: str = ""
    commit: str = ""  # set where a table joins runs made at more than one commit

    @property
    def score(self) -> float | None:
        done = self.counts.get("killed", 0) + self.counts.get("survived", 0) + \
            self.counts.get("no_tests", 0) + self.counts.get("timeout", 0)
        if not done:
            return None
        return (self.counts.get("killed", 0) + self.counts.get("timeout", 0)) / done


def load(path: Path = MUTMUT_TOML) -> tuple[list[Module], list[Accepted]]:
    """The modules and the accepted survivors; a malformed entry raises ValueError."""
    data = tomllib.loads(path.read_text())
    mods: list[Module] = []
    for i, raw in enumerate(data.get("module", [])):
        where = f"{path.name}: module {raw.get('path', i)!r}"
        if set(raw) - {"path", "tests", "exclude"}:
            raise ValueError(f"{where}: unknown field(s) "
                             f"{sorted(set(raw) - {'path', 'tests', 'exclude'})}")
        if not isinstance(raw.get("path"), str) or not raw["path"].endswith(".py"):
            raise ValueError(f"{where}: path must name a .py file")
        tests = raw.get("tests")
        if not isinstance(tests, list) or not tests or not all(
                isinstance(t, str) and t for t in tests):
            raise ValueError(f"{where}: tests must be a non-empty list")
        exclude = raw.get("exclude", [])
        if not isinstance(exclude, list) or not all(isinstance(t, str) and t for t in exclude):
            raise ValueError(f"{where}: exclude must be a list of test ids")
        mods.append(Module(raw["path"], tuple(tests), tuple(exclude)))
    if len({m.path for m in mods}) != len(mods):
        raise ValueError(f"{path.name}: a module is listed twice")
    acc: list[Accepted] = []
    for i, raw in enumerate(data.get("accepted", [])):
        where = f"{path.name}: accepted #{i + 1}"
        for key in ("module", "old", "new", "why"):
            if not isinstance(raw.get(key), str) or not raw[key].strip():
                raise ValueError(f"{where}: {key} must be a non-empty string")
        if set(raw) - {"module", "old", "new", "why"}:
            raise ValueError(f"{where}: unknown field(s)")
        acc.append(Accepted(raw["module"], raw["old"].strip(), raw["new"].strip(),
                            raw["why"].strip()))
    return mods, acc


def _config(m: Module, package: str) -> str:
    tests = ", ".join(json.dumps(t) for t in m.tests)
    args = ["-p", "no:cacheprovider", "-q", "-m", "not slow"]
    for t in m.exclude:
        args += ["--deselect", t]
    return ("\n[tool.mutmut]\n"
            f"source_paths = [{json.dumps(package)}]\n"
            f"only_mutate = [{json.dumps(m.path)}]\n"
            # mutmut copies the package's files but not a directory reached through a
            # symlink (spotctl/templates -> ../templates): `spotctl init` needs it
            f"also_copy = [{json.dumps(package + '/templates')}]\n"
            f"pytest_add_cli_args_test_selection = [{tests}]\n"
            f"pytest_add_cli_args = [{', '.join(json.dumps(a) for a in args)}]\n")


def changed_line(diff: str) -> tuple[str, str]:
    """The line a mutant removed and the one it put in its place (stripped), from
    `mutmut show`'s unified diff."""
    old = [ln[1:].strip() for ln in diff.splitlines()
           if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:].strip() for ln in diff.splitlines()
           if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(old), " / ".join(new)


def _function(name: str) -> str:
    """`spotctl.x.y.xǁCǁm__mutmut_3` -> `C.m`; `spotctl.x.y.x_f__mutmut_3` -> `f`."""
    tail = name.rsplit(".", 1)[-1].split("__mutmut_")[0]
    if tail.startswith("xǁ"):
        return ".".join(p for p in tail[2:].split("ǁ") if p)
    return tail[2:] if tail.startswith("x_") else tail


def run_module(repo: Path, m: Module, accepted: list[Accepted], python: str,
               max_children: int = 2, work: Path | None = None, package: str = "spotctl",
               ) -> ModuleResult:
    res = ModuleResult(m.path)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutmut-", dir=work) as tmp:
        copy = Path(tmp) / "repo"
        copy_head(repo, copy)
        if not (copy / m.path).is_file():
            res.error = f"{m.path}: no such file"
            return res
        with (copy / "pyproject.toml").open("a") as f:
            f.write(_config(m, package))
        mutmut = [python, "-m", "mutmut"]
        try:
            run = subprocess.run([*mutmut, "run", "--max-children", str(max_children)],
                                 cwd=copy, capture_output=True, text=True,
                                 timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res.error = f"mutmut run took over {RUN_TIMEOUT_S:.0f} s"
            return res
        stats = copy / "mutants" / "mutmut-cicd-stats.json"
        subprocess.run([*mutmut, "export-cicd-stats"], cwd=copy, capture_output=True)
        if run.returncode != 0 or not stats.is_file():
            tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
            res.error = f"mutmut run exit {run.returncode}: {' | '.join(tail)}"
            return res
        res.counts = {k: int(v) for k, v in json.loads(stats.read_text()).items()
                      if isinstance(v, int)}
        out = subprocess.run([*mutmut, "results"], cwd=copy, capture_output=True,
                             text=True).stdout
        untested: Counter[str] = Counter()
        want = {(a.old, a.new): a.why for a in accepted if a.module == m.path}
        for line in out.splitlines():
            name, _, status = line.strip().rpartition(": ")
            if status == "no tests":
                untested[_function(name)] += 1
            elif status == "survived":
                diff = subprocess.run([*mutmut, "show", name], cwd=copy,
                                      capture_output=True, text=True).stdout
                old, new = changed_line(diff)
                res.survivors.append(Survivor(name, old, new, want.get((old, new), "")))
        res.untested = dict(untested)
    res.seconds = round(time.monotonic() - t0, 1)
    return res


@dataclass(frozen=True)
class Stamp:
    """What a score is a score of: when, at which commit (the run copies the committed
    HEAD), and over which modules of how many listed. A score quoted without it says
    nothing about today's code."""

    date: str  # UTC, minutes
    commit: str  # short hash of the HEAD the run copied
    modules: tuple[str, ...]  # the modules run
    listed: int  # the modules mutmut.toml lists

    @classmethod
    def now(cls, repo: Path, modules: list[str], listed: int) -> Stamp:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or "unknown"
        return cls(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), sha, tuple(modules),
                   listed)

    def line(self) -> str:
        scope = ("all " + str(self.listed) + " listed modules" if len(self.modules) == self.listed
                 else f"{len(self.modules)} of the {self.listed} listed modules: "
                 + ", ".join(self.modules))
        at = "commits" if "," in self.commit else "commit"
        return f"mutmut run {self.date} at {at} {self.commit}; scope: {scope}"


def table(results: list[ModuleResult], stamp: Stamp | None = None) -> str:
    rows = [stamp.line()] if stamp else []
    rows += [f"{'module':36} {'mutants':>7} {'killed':>6} {'survived':>8} "
            f"{'no test':>7} {'timeout':>7} {'score':>6}"]
    for r in results:
        if r.error:
            rows.append(f"{r.path:36} error: {r.error}")
            continue
        c = r.counts
        score = "-" if r.score is None else f"{100 * r.score:.0f}%"
        rows.append(f"{r.path:36} {c.get('total', 0):>7} {c.get('killed', 0):>6} "
                    f"{c.get('survived', 0):>8} {c.get('no_tests', 0):>7} "
                    f"{c.get('timeout', 0):>7} {score:>6}")
    for r in results:
        open_ = [s for s in r.survivors if not s.accepted]
        if open_:
            rows.append(f"\n{r.path}: {len(open_)} survivor(s) no test kills")
            rows += [f"  {_function(s.name)}: - {s.old}\n{'':4}+ {s.new}" for s in open_]
        acc = [s for s in r.survivors if s.accepted]
        if acc:
            rows.append(f"\n{r.path}: {len(acc)} accepted survivor(s)")
            rows += [f"  {_function(s.name)}: {s.old}  ->  {s.new}\n{'':4}({s.accepted})"
                     for s in acc]
        if r.untested:
            rows.append(f"\n{r.path}: reached by none of its tests: " + ", ".join(
                f"{f} ({n})" for f, n in sorted(r.untested.items())))
    return "\n".join(rows)


def markdown(results: list[ModuleResult], stamp: Stamp | None = None) -> str:
    """The per-module rows as a Markdown table (for the docs), with the totals; with a
    stamp, its line (date, commit, scope) above the table."""
    rows = [stamp.line() + "\n"] if stamp else []
    rows += ["| module | mutants | killed | survived (accepted) | no test reaches | score |",
             "|---|---:|---:|---:|---:|---:|"]
    tot: Counter[str] = Counter()
    for r in results:
        c = r.counts
        acc = sum(1 for s in r.survivors if s.accepted)
        score = "-" if r.score is None else f"{100 * r.score:.0f} %"
        name = f"`{r.path}` ({r.commit[:7]})" if r.commit else f"`{r.path}`"
        rows.append(f"| {name} | {c.get('total', 0)} | {c.get('killed', 0) + c.get('timeout', 0)} "
                    f"| {c.get('survived', 0)} ({acc}) | {c.get('no_tests', 0)} | {score} |")
        tot.update({k: v for k, v in c.items() if k in ("total", "killed", "timeout",
                                                         "survived", "no_tests")})
        tot["accepted"] += acc
    done = tot["killed"] + tot["timeout"] + tot["survived"] + tot["no_tests"]
    score = f"{100 * (tot['killed'] + tot['timeout']) / done:.0f} %" if done else "-"
    rows.append(f"| all | {tot['total']} | {tot['killed'] + tot['timeout']} | "
                f"{tot['survived']} ({tot['accepted']}) | {tot['no_tests']} | {score} |")
    return "\n".join(rows)


def to_json(results: list[ModuleResult], stamp: Stamp | None = None) -> list[dict[str, Any]]:
    run = {"date": stamp.date, "commit": stamp.commit, "scope": list(stamp.modules),
           "listed": stamp.listed} if stamp else {}
    return [{"module": r.path, "counts": r.counts, "score": r.score, "error": r.error,
             "seconds": r.seconds, "untested": r.untested,
             "survivors": [s.__dict__ for s in r.survivors], **({"run": run} if run else {})}
            for r in results]


def from_json(docs: list[list[dict[str, Any]]], listed: int, accepted: list[Accepted],
              ) -> tuple[list[ModuleResult], Stamp]:
    """The results of several saved runs (`scripts/mutants --mutmut --json`, one module
    each, say) as one table: the stamp names the first and last run's dates, the commit(s)
    and the modules; where the runs were made at more than one commit, each row names its
    own. A survivor is marked accepted by today's mutmut.toml (the score does not count it
    either way). A module in two runs raises ValueError."""
    results: list[ModuleResult] = []
    runs: list[dict[str, Any]] = []
    for doc in docs:
        for d in doc:
            if not isinstance(d, dict) or not isinstance(d.get("run"), dict):
                raise ValueError("not the JSON of scripts/mutants --mutmut --json")
            runs.append(d["run"])
            want = {(a.old, a.new): a.why for a in accepted if a.module == d["module"]}
            surv = [Survivor(x["name"], x["old"], x["new"], want.get((x["old"], x["new"]), ""))
                    for x in d["survivors"]]
            results.append(ModuleResult(d["module"], dict(d["counts"]), surv,
                                        dict(d["untested"]), float(d["seconds"]),
                                        str(d["error"]), str(d["run"]["commit"])))
    mods = [r.path for r in results]
    if len(set(mods)) != len(mods):
        raise ValueError("a module is in more than one run")
    commits = list(dict.fromkeys(r.commit for r in results))
    if len(commits) == 1:
        for r in results:
            r.commit = ""
        commit = commits[0]
    else:
        def n(c: str) -> str:
            k = sum(r.commit == c for r in results)
            return f"{k} module{'' if k == 1 else 's'}"

        commit = ", ".join(f"{c} ({n(c)})" for c in commits)
    dates = sorted({r["date"] for r in runs})
    date = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return results, Stamp(date, commit, tuple(mods), listed)


def failing(results: list[ModuleResult]) -> bool:
    return any(r.error or any(not s.accepted for s in r.survivors) for r in results)

