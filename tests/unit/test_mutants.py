"""scripts/mutants: every listed breakage still applies to the code as it is (its `old`
text occurs exactly once, its tests exist), so the list cannot rot silently when the code
changes; and the runner tells a breakage its tests catch from one they do not, in a small
git repository of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import mutants_lib as ml  # noqa: E402

BREAKAGES = ml.load()


@pytest.mark.parametrize("b", BREAKAGES, ids=[b.id for b in BREAKAGES])
def test_each_breakage_applies_once_and_names_tests_that_exist(b: ml.Breakage) -> None:
    text = (REPO / b.file).read_text()
    assert text.count(b.old) == 1, f"{b.id}: `old` is in {b.file} {text.count(b.old)} times"
    for t in b.tests:
        path, _, name = t.partition("::")
        assert (REPO / path).exists(), f"{b.id}: no {path}"
        if name:
            func = re.sub(r"\[.*\]$", "", name.split("::")[-1])
            assert re.search(rf"^\s*(async )?def {re.escape(func)}\(",
                             (REPO / path).read_text(), re.M), f"{b.id}: no test {t}"


def test_the_named_breakages_of_the_issue_are_listed() -> None:
    ids = {b.id for b in BREAKAGES}
    assert {"planner-order-inverted", "report-goodput-ignores-world-size",
            "report-goodput-counts-stalls", "exit-codes-collapse-to-3",
            "head-body-limit-x1000", "head-connections-x1000", "head-events-x1000",
            "head-nodes-x1000", "head-node-rate-x1000", "cooldown-never-expires",
            "spec-run-as-any-name", "commit-rename-without-fsync"} <= ids


def test_a_malformed_entry_is_refused_with_its_id(tmp_path: Path) -> None:
    p = tmp_path / "b.toml"
    p.write_text('[[breakage]]\nid = "x"\nfile = "f"\nold = "a"\nnew = "a"\nbreaks = "b"\n'
                 'tests = ["t"]\n')
    with pytest.raises(ValueError, match="'x': new is the same as old"):
        ml.load(p)
    p.write_text('[[breakage]]\nid = "y"\nfile = "f"\nold = "a"\nnew = "b"\nbreaks = "b"\n'
                 'tests = []\n')
    with pytest.raises(ValueError, match="'y': tests must be"):
        ml.load(p)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def _committed_repo(repo: Path, files: dict[str, str]) -> Path:
    """A git repository at `repo` holding `files` (path -> text), committed."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "fake")
    return repo


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    repo = _committed_repo(tmp_path / "fake", {
        "pytest.ini": "[pytest]\n",
        "fakepkg/__init__.py": "def add(a, b):\n    return a + b\n",
        "tests/test_add.py":
            "from fakepkg import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"})
    # uncommitted: the runner works from HEAD, so this never reaches a copy
    (repo / "fakepkg" / "__init__.py").write_text("def add(a, b):\n    return 0\n")
    return repo


def _b(old: str, new: str) -> ml.Breakage:
    return ml.Breakage(id="t", file="fakepkg/__init__.py", old=old, new=new, breaks="t",
                       tests=("tests/test_add.py",))


def test_runner_kills_a_real_breakage_and_a_no_op_survives(
        fake_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the fake needs none: quicker
    assert ml.baseline(fake_repo, [_b("a + b", "a - b")], sys.executable, "fakepkg") == ""
    killed = ml.run_one(fake_repo, _b("a + b", "a - b"), sys.executable, "fakepkg")
    assert killed.outcome == "killed", killed
    same = ml.run_one(fake_repo, _b("a + b", "b + a"), sys.executable, "fakepkg")
    assert same.outcome == "survived", same
    assert ml.failing([killed, same]) == [same]
    missing = ml.run_one(fake_repo, _b("a * b", "a - b"), sys.executable, "fakepkg")
    assert missing.outcome == "error" and "0 times" in missing.detail, missing
    assert "score: 1/2 killed, 1 error(s)" in ml.table([killed, same, missing])
    accepted = ml.Result(id="a", outcome="survived", accepted="equivalent")
    assert ml.failing([accepted]) == []
    # the working tree's uncommitted edit never reached a copy
    assert "return a + b" in subprocess.run(
        ["git", "-C", str(fake_repo), "show", "HEAD:fakepkg/__init__.py"],
        capture_output=True, text=True, check=True).stdout


def test_a_copy_of_this_repository_imports_spotctl_from_itself(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    ml.copy_head(REPO, copy)
    assert ml.imports_from(sys.executable, copy, "spotctl") == str(
        copy / "spotctl" / "__init__.py")


# mutmut (scripts/mutants --mutmut): the module list and the accepted survivors cannot rot,
# and the runner tells killed from surviving mutants, in a small repository of its own

from mutants_lib import mutmut_run as mm  # noqa: E402

MODULES, ACCEPTED = mm.load()


@pytest.mark.parametrize("m", MODULES, ids=[m.path for m in MODULES])
def test_each_mutmut_module_and_its_tests_exist(m: mm.Module) -> None:
    assert (REPO / m.path).is_file(), m.path
    for t in (*m.tests, *m.exclude):
        assert (REPO / t.partition("::")[0]).exists(), f"{m.path}: no {t}"
    for t in m.exclude:  # an excluded test is still there, under that name
        path, _, name = t.partition("::")
        assert name and f"def {name}(" in (REPO / path).read_text(), f"{m.path}: no {t}"


def test_each_accepted_survivor_names_a_line_that_is_still_there() -> None:
    paths = {m.path for m in MODULES}
    for a in ACCEPTED:
        assert a.module in paths, f"accepted survivor in a module not run: {a}"
        lines = {ln.strip() for ln in (REPO / a.module).read_text().splitlines()}
        # a mutant that changed several lines shows them joined by " / "
        assert a.old in lines or all(part in lines for part in a.old.split(" / ")), \
            f"stale: {a}"


def test_the_correctness_modules_of_the_issue_are_run() -> None:
    paths = {m.path for m in MODULES}
    assert {"spotctl/spec.py", "spotctl/agent/monitors.py"} <= paths
    for pkg in ("spotctl/elastic/", "spotctl/control/", "spotctl/head/"):
        assert any(p.startswith(pkg) for p in paths), pkg


def test_mutmut_runner_reports_survivors_and_matches_accepted_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _committed_repo(tmp_path / "fake", {
        "pyproject.toml": "[tool.pytest.ini_options]\n",
        "fakepkg/__init__.py": "",
        "fakepkg/calc.py": "def add(a, b):\n    return a + b\n\n\ndef big(x):\n"
                           "    return x > 10\n\n\ndef unused(x):\n    return x * 2\n",
        "tests/test_calc.py": "from fakepkg.calc import add, big\n\n\ndef test_calc():\n"
                              "    assert add(2, 3) == 5\n    assert big(20) and not big(1)\n"})
    m = mm.Module("fakepkg/calc.py", ("tests/test_calc.py",))
    accept = mm.Accepted("fakepkg/calc.py", "return x > 10", "return x >= 10", "10 untested")
    r = mm.run_module(repo, m, [accept], sys.executable, package="fakepkg")
    assert r.error == "", r.error
    assert r.counts["killed"] >= 1 and r.counts["no_tests"] >= 1, r.counts
    changed = {(s.old, s.new): s.accepted for s in r.survivors}
    assert changed.get(("return x > 10", "return x >= 10")) == "10 untested", changed
    assert ("return x > 10", "return x > 11") in changed, changed
    assert r.untested == {"unused": r.counts["no_tests"]}, r.untested
    assert mm.failing([r])  # x > 11 survives and is not accepted
    out = mm.table([r])
    assert "- return x > 10\n    + return x > 11" in out and "unused (" in out, out


def test_mutmut_markdown_rows_and_totals() -> None:
    a = mm.ModuleResult("a.py", counts={"total": 10, "killed": 6, "timeout": 1, "survived": 2,
                                        "no_tests": 1},
                        survivors=[mm.Survivor("x", "o", "n", "why"), mm.Survivor("y", "o", "m")])
    b = mm.ModuleResult("b.py", counts={"total": 4, "killed": 4})
    md = mm.markdown([a, b]).splitlines()
    assert md[2] == "| `a.py` | 10 | 7 | 2 (1) | 1 | 70 % |"
    assert md[3] == "| `b.py` | 4 | 4 | 0 (0) | 0 | 100 % |"
    assert md[4] == "| all | 14 | 11 | 2 (1) | 1 | 79 % |"


def test_the_modules_reworked_since_the_last_run_are_in_scope() -> None:
    """Issue 63: the modules added or reworked since the last full run decide correctness
    too; the head's cloud loop is run with the tests that reach it."""
    paths = {m.path: m.tests for m in MODULES}
    for p in ("spotctl/elastic/checkpoint.py", "spotctl/elastic/parts.py",
              "spotctl/elastic/ft.py", "spotctl/elastic/__init__.py",
              "spotctl/head/grpc_filter.py", "spotctl/providers/local/private.py",
              "spotctl/control/reconcile.py"):
        assert p in paths, p
    assert "tests/unit/test_head_loop_bundle.py" in paths["spotctl/head/rebalancer.py"]


def test_a_score_is_printed_with_its_date_commit_and_scope() -> None:
    a = mm.ModuleResult("a.py", counts={"total": 4, "killed": 3, "survived": 1})
    stamp = mm.Stamp("2026-12-07 09:40 UTC", "abc123def456", ("a.py",), 21)
    want = ("mutmut run 2026-12-07 09:40 UTC at commit abc123def456; scope: 1 of the 21 "
            "listed modules: a.py")
    assert mm.table([a], stamp).splitlines()[0] == want
    assert mm.markdown([a], stamp).splitlines()[0] == want
    assert mm.to_json([a], stamp)[0]["run"] == {
        "date": "2026-12-07 09:40 UTC", "commit": "abc123def456", "scope": ["a.py"],
        "listed": 21}
    whole = mm.Stamp("d", "c", ("a.py", "b.py"), 2)
    assert whole.line() == "mutmut run d at commit c; scope: all 2 listed modules"


def test_the_readme_quotes_a_score_only_with_its_date_and_scope() -> None:
    """Issue 63: a mutation score in the README names when it was measured and over
    which modules (and the partial run its commit); the count of listed modules it names
    is the list's (adding a module makes the sentence be rewritten)."""
    import re

    text = (REPO / "README.md").read_text()
    para = text[text.index("Mutation\n  testing"):].split("\n\n", 1)[0]
    sentences = [s for s in re.split(r"(?<=\.) ", " ".join(para.split())) if "%" in s]
    assert sentences, para
    for s in sentences:
        assert re.search(r"20\d\d-\d\d-\d\d", s) and re.search(r"\d+ (listed )?modules?", s), s
    flat = " ".join(para.split())
    assert re.search(rf"(\d+ of the|all) {len(MODULES)} listed modules", flat), para
    assert re.search(r"at commits? [0-9a-f]{7,}", flat), para
    assert "2026-12-04" not in flat and "86 %" not in flat, para  # the stale run is gone


def test_the_planted_bugs_of_issue_63_are_listed() -> None:
    ids = {b.id for b in BREAKAGES}
    assert {"ft-all-reduce-partial-sum", "timed-save-clock-never-reset",
            "timed-save-stale-due-flag", "down-resumes-head-loop",
            "private-stop-signals-stranger", "parts-in-flight-off-by-one",
            "parts-in-flight-uncapped", "share-splits-list-tensors", "share-balanced-by-count",
            "pause-ttl-uncapped", "step-bounds-written-in-place"} <= ids


def test_saved_runs_make_one_table_under_one_stamp() -> None:
    """`scripts/mutants --mutmut --from-json`: per-module runs saved with --json are one
    table under one stamp (first and last date, the commit, the modules), survivors marked
    accepted by today's mutmut.toml; runs at two commits name each row's."""
    a = mm.ModuleResult("a.py", counts={"total": 4, "killed": 3, "survived": 1},
                        survivors=[mm.Survivor("a.x_f__mutmut_1", "x = 1", "x = 2")])
    b = mm.ModuleResult("b.py", counts={"total": 2, "killed": 2})
    ja = mm.to_json([a], mm.Stamp("2026-12-07 15:20 UTC", "abc123def456", ("a.py",), 20))
    jb = mm.to_json([b], mm.Stamp("2026-12-07 16:01 UTC", "abc123def456", ("b.py",), 20))
    acc = [mm.Accepted("a.py", "x = 1", "x = 2", "never read")]
    results, stamp = mm.from_json([ja, jb], 20, acc)
    assert stamp.line() == ("mutmut run 2026-12-07 15:20 UTC to 2026-12-07 16:01 UTC at commit "
                            "abc123def456; scope: 2 of the 20 listed modules: a.py, b.py")
    assert [r.path for r in results] == ["a.py", "b.py"]
    assert results[0].survivors[0].accepted == "never read" and not mm.failing(results)
    assert mm.markdown(results, stamp).splitlines()[-1] == "| all | 6 | 5 | 1 (1) | 0 | 83 % |"
    # runs at two commits: the stamp names both, each row its own
    other = mm.to_json([b], mm.Stamp("2026-12-07 16:01 UTC", "0123456789ab", ("b.py",), 20))
    results, stamp = mm.from_json([ja, other], 20, acc)
    assert " at commits abc123def456 (1 module), 0123456789ab (1 module); " in stamp.line()
    assert mm.markdown(results, stamp).splitlines()[-2].startswith("| `b.py` (0123456) | 2 |")
    with pytest.raises(ValueError, match="more than one run"):
        mm.from_json([ja, ja], 20, acc)
