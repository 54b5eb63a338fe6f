"""Every figure table of docs/benchmarks.md and the README is what scripts/docs-figures
renders from the committed results (docs/figures/*.json), and the simulator's goodput
figures are what the simulator computes today. Editing a number by hand, or changing the
results without regenerating, fails here."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import figures  # noqa: E402

SLOW_TRACE = "aws-16node-08-27-2023_us-west-2a_v100_1"  # ~8 s a run: the slow set has it


def _tree(tmp_path: Path) -> Path:
    """A copy of the docs and results that a test may change."""
    for rel in (*figures.DOCS, "docs/figures/bench-results.json", "docs/figures/goodput.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    return tmp_path


def test_docs_are_rendered_from_the_results_files() -> None:
    assert figures.unshown(figures.read_results()) == []
    d = figures.diff()
    assert d == "", (
        "the docs differ from docs/figures/*.json; run scripts/docs-figures --write\n" + d
    )


def test_a_number_edited_by_hand_is_caught(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    readme = t / "README.md"
    text = readme.read_text()
    cell = "| torchrun engine 0.534 s, torchft engine 0.646 s |"
    assert cell in text
    readme.write_text(text.replace(cell, cell.replace("0.534 s", "0.53 s")))
    assert "0.53 s" in figures.diff(t)
    # and a changed result without regenerating the docs
    shutil.copy(REPO / "README.md", readme)
    res = json.loads((t / "docs/figures/bench-results.json").read_text())
    for r in res["rows"]:
        if r["metric"] == "torchrun: step time vs plain DDP":
            r["spotctl"]["median"] = 0.57
    (t / "docs/figures/bench-results.json").write_text(json.dumps(res))
    assert "torchrun engine 0.57 s" in figures.diff(t)


def test_a_table_without_its_markers_is_refused(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    p = t / "docs/benchmarks.md"
    p.write_text(p.read_text().replace("<!-- figures:quorum -->\n", "", 1))
    with pytest.raises(figures.FiguresError, match="quorum missing"):
        figures.diff(t)


def test_saved_rows_replace_their_metric_and_record_the_run(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    path = t / "docs/figures/bench-results.json"
    row = {
        "benchmark": "recovery",
        "metric": "torchft: pause at a notice (4->3)",
        "spotctl": {"median": 0.31, "min": 0.2, "max": 0.4, "n": 3},
        "baseline": {"median": 0.22, "min": 0.2, "max": 0.25, "n": 3},
        "unit": "s",
        "note": "",
    }
    failed = {"benchmark": "quorum", "metric": "(failed)", "spotctl": None, "baseline": None,
              "unit": "", "note": "error: x"}  # fmt: skip
    started = {"load_average": [1.0, 1.0, 1.0]}
    run = figures.save([row, failed], "scripts/bench recovery --save", started=started,
                       elapsed_s=12.34, path=path, now=0)  # fmt: skip
    data = figures.read_results(path)
    mine = [r for r in data["rows"] if r["metric"] == row["metric"]]
    assert len(mine) == 1 and mine[0]["spotctl"]["median"] == 0.31 and mine[0]["run"] == run
    assert not any(r["metric"] == "(failed)" for r in data["rows"])
    rec = data["runs"][run]
    assert rec["command"] == "scripts/bench recovery --save" and rec["source"] == "measured"
    assert rec["finished_at"] == "1970-01-01T00:00:00Z" and rec["elapsed_s"] == 12.3
    m = rec["machine"]
    assert m["cores"] and m["torch"] and m["load_average"]["start"] == [1.0, 1.0, 1.0]
    # the rest is kept; the docs now differ in exactly the new figures
    assert len(data["rows"]) == len(figures.read_results()["rows"])
    d = figures.diff(t)
    assert "0.31 s (0.2..0.4, 3 notices)" in d and "0.22 s (0.2..0.25) (a kill)" in d
    assert "scripts/bench recovery --save" in d and "1970-01-01" in d
    # a run at another size is kept but shown nowhere: scripts/docs-figures says so
    other = dict(row, metric="torchft: pause at a notice (3->2)")
    figures.save([other], "scripts/bench recovery --nodes 3 --save", started=started,
                 elapsed_s=1, path=path)  # fmt: skip
    assert figures.unshown(figures.read_results(path)) == [f"recovery / {other['metric']}"]


def _goodput() -> dict[str, object]:
    return figures.read_goodput()


def test_readme_goodput_on_p3_is_the_simulators() -> None:
    g = _goodput()
    sim = figures.simulate_goodput(g, only=["p3-trace"])  # type: ignore[arg-type]
    ft, tr = (sim[e][0]["goodput_vs_oracle"] for e in ("torchft", "torchrun"))
    readme = (REPO / "README.md").read_text()
    assert (
        f"| goodput on the p3 spot trace (simulated) | torchft {ft:.3f}, torchrun {tr:.3f} |"
        in readme
    )
    assert (
        f"| p3 (bamboo) | 32 | {ft:.3f} | {tr:.3f} |" in (REPO / "docs/benchmarks.md").read_text()
    )


def test_goodput_file_is_what_the_simulator_computes() -> None:
    g = _goodput()
    names = [r["trace"] for r in g["torchft"]["rows"] if r["trace"] != SLOW_TRACE]  # type: ignore[index]
    assert len(names) == 8, names
    sim = figures.simulate_goodput(g, only=names)  # type: ignore[arg-type]
    for e in ("torchft", "torchrun"):
        want = [r for r in g[e]["rows"] if r["trace"] in names]  # type: ignore[index]
        assert sim[e] == want, (
            f"{e}: docs/figures/goodput.json is stale: scripts/docs-figures --sim"
        )


def test_goodput_what_ifs_are_what_the_simulator_computes() -> None:
    g = _goodput()
    variants = g["variants"]  # type: ignore[index]
    assert [v["label"] for v in variants] == [  # type: ignore[attr-defined]
        "a reconcile every minute, torchft",
        "blind offers, torchft",
        "blind offers, torchrun",
    ]
    sim = figures.simulate_variants(g)
    for v, rows in zip(variants, sim, strict=True):  # type: ignore[call-overload]
        assert rows == v["rows"], f"{v['label']}: goodput.json is stale: scripts/docs-figures --sim"


def test_a_head_attack_figure_edited_by_hand_is_caught(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    page = t / "docs/benchmarks.md"
    text = page.read_text()
    cell = "RSS 284 -> 285 MB"
    assert text.count(cell) == 1
    page.write_text(text.replace(cell, "RSS 284 -> 286 MB"))
    d = figures.diff(t)
    assert "-| header flood" in d and "RSS 284 -> 285 MB" in d
    # the table's markers are required
    page.write_text(text.replace("<!-- figures:head-attacks -->\n", "", 1))
    with pytest.raises(figures.FiguresError, match="head-attacks missing"):
        figures.diff(t)


def test_head_attacks_save_records_the_run_and_keeps_the_before_figures(tmp_path: Path) -> None:
    from tests.security import head_attacks

    t = _tree(tmp_path)
    path = t / "docs/figures/bench-results.json"
    now = [
        {"attack": "slowloris 300 conns, 1 B/2 s, 16 s", "connections_held_at_end": 40,
         "attacker_connects": 900, "oldest_open_s": 4.2, "longest_closed_s": 6.1,
         "rss_before_mb": 60, "rss_peak_mb": 61, "status_ok": 30, "status_failed": 0,
         "status_median_s": 0.004, "status_max_s": 0.41, "heartbeat_ok": 31,
         "heartbeat_failed": 1, "heartbeat_median_s": 0.005, "heartbeat_max_s": 0.2},
        {"attack": "header flood 250 conns x 60 headers x 16 KiB", "connections_held_at_end": 0,
         "rss_before_mb": 60, "rss_peak_mb": 62, "status_ok": 7, "status_failed": 0,
         "status_median_s": 0.002, "status_max_s": 0.05},
    ]  # fmt: skip
    old = {r["metric"]: r for r in figures.read_results(path)["rows"]
           if r["benchmark"] == "head-attacks"}  # fmt: skip
    run = head_attacks.save_rows(now, None, ".venv/bin/python -m tests.security.head_attacks "
                                 "--save", {"load_average": [0.5, 0.5, 0.5]}, 40.0, path)  # fmt: skip
    data = figures.read_results(path)
    mine = {r["metric"]: r for r in data["rows"] if r["benchmark"] == "head-attacks"}
    assert set(mine) == set(old)
    for m, r in mine.items():
        assert r["run"] == run and r["spotctl"]["connections_held_at_end"] in (40, 0)
        # the 'before' column is the recorded one, still naming its own run
        assert r["baseline"] == old[m]["baseline"]
        assert r["baseline_run"] == old[m]["baseline_run"] in data["runs"]
    rec = data["runs"][run]
    assert rec["source"] == "measured" and rec["machine"]["cores"]
    assert rec["command"].endswith("head_attacks --save")
    page = figures.rendered(t)["docs/benchmarks.md"][1]
    assert "| 40 held at the end (oldest 4.2 s), each closed within 6.1 s; " in page
    assert "heartbeats 31 of 32 served (median 5 ms, max 0.2 s) |" in page
    # the before column did not change; the index names the new run
    assert (
        "| 190-250 held at the end; RSS 284 -> 526 MB | 0 held at the end; RSS 60 -> 62 MB" in page
    )
    assert "`.venv/bin/python -m tests.security.head_attacks --save`" in page
    # with --before, the before column is this run's too, and the old runs are dropped
    run2 = head_attacks.save_rows(now, now, "x --save --before old", {"load_average": [1, 1, 1]},
                                  80.0, path)  # fmt: skip
    data = figures.read_results(path)
    for r in data["rows"]:
        if r["benchmark"] == "head-attacks":
            assert r["run"] == run2 and "baseline_run" not in r
            assert r["baseline"] == r["spotctl"]
    gone = {run, *(r[k] for r in old.values() for k in ("run", "baseline_run"))}
    assert gone & set(data["runs"]) == set()
    page = figures.rendered(t)["docs/benchmarks.md"][1]
    assert (
        "| 0 held at the end; RSS 60 -> 62 MB; `status` 7 of 7 served (median 2 ms, max 50 ms) | 0 held"
        in page
    )


def _readme_block(text: str) -> tuple[list[list[str]], dict[str, str], str]:
    """The README figures table's rows (cells), its numbered run records, and the block."""
    import re

    block = text.split("<!-- figures:readme -->\n", 1)[1].split("<!-- /figures -->", 1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in block.splitlines()
            if ln.startswith("| ") and "---" not in ln][1:]
    return rows, dict(re.findall(r"^(\d+)\. (.+)$", block, re.M)), block


def test_each_readme_figure_is_from_one_full_run_record() -> None:
    """Issue 63: every README figure row comes from ONE recorded run, listed under the table
    with its command, date, commit, torch version and machine load, and names each cell's
    sample count; nothing in the block is 'not recorded' or combined from several runs."""
    import re

    rows, records, block = _readme_block((REPO / "README.md").read_text())
    assert rows and records, block
    assert "not recorded" not in block and "combine" not in block, block
    for cells in rows:
        runs = cells[3]
        if "(simulated)" in cells[0]:
            assert "deterministic" in runs and "scripts/sim-goodput" in runs, cells
            continue
        # one n per figure of the cell (a row may carry two: a pause and its lost steps)
        m = re.fullmatch(r"(\d+) \(n=\d+(, n=\d+)*(, baseline n=\d+)*\)", runs)
        assert m and m.group(1) in records, (cells, records)
    for rec in records.values():
        assert re.fullmatch(r"`scripts/bench [^`]+`, 20\d\d-\d\d-\d\d, [0-9a-f]{7,}, "
                            r"torch \S+, \d+ cores, load [0-9-]+", rec), rec


def test_a_readme_row_is_shown_only_from_one_full_run(tmp_path: Path) -> None:
    """A row whose cells come from a run without a commit, or from two runs, is left out
    and named under the table; one `scripts/bench ... --save` run of its benchmarks brings
    it back, citing that run alone."""
    t = _tree(tmp_path)
    path = t / "docs/figures/bench-results.json"

    def stat(x: float, n: int = 2) -> dict[str, float]:
        return {"median": x, "min": x, "max": x, "n": n}

    def r(bench: str, metric: str, ours: float, base: float | None) -> dict[str, object]:
        return {"benchmark": bench, "metric": metric, "spotctl": stat(ours),
                "baseline": stat(base) if base is not None else None, "unit": "s", "note": ""}

    rows = [r("recovery", "torchft: pause at a notice (4->3)", 0.3, 0.25),
            r("lost", "torchft: steps lost per notice", 0, 0),
            r("join", "torchft: training pause at a join (3->4)", 0.06, 0.01),
            r("recovery", "notice -> first step at new size (4->3 nodes)", 2.5, 48.0),
            r("lost", "steps lost per notice, checkpoint every 10", 0, 9)]
    started = {"load_average": [0.4, 0.5, 0.6]}
    figures.save(rows, "scripts/bench recovery lost join --repeat 2 --save", started=started,
                 elapsed_s=300, path=path, now=86400)  # fmt: skip
    readme = figures.rendered(t)["README.md"][1]
    got, records, block = _readme_block(readme)
    by = {c[0]: c for c in got}
    assert by["pause at a notice, torchft engine"][1:] == [
        "0.3 s, 0 steps lost", "bare torchft: 0.25 s (a kill)", "1 (n=2, baseline n=2)"]
    assert by["pause at a join, torchft engine"][1] == "0.06 s"
    assert by["notice -> survivors' first step, torchrun engine, 4 -> 3 nodes"][1:3] == [
        "2.5 s, 0 steps lost", "plain torchrun: 48 s, 9 steps lost (checkpoint every 10)"]
    assert records["1"].startswith("`scripts/bench recovery lost join --repeat 2 --save`, "
                                   "1970-01-02, ")
    # (the quorum wait, from a transcribed run, is still named below the table)
    assert not [c[0] for c in got if c[0] in block.split("Not shown", 1)[-1]]
    # the same rows from a run whose record lacks its commit: left out, named below
    data = json.loads(path.read_text())
    (rid,) = {x["run"] for x in data["rows"] if x["metric"] == rows[2]["metric"]}
    data["runs"][rid]["commit"] = None
    path.write_text(json.dumps(data))
    got, _, block = _readme_block(figures.rendered(t)["README.md"][1])
    assert "pause at a join, torchft engine" not in {c[0] for c in got}
    assert "Not shown until" in block and "pause at a join, torchft engine" in block
    # and a row whose cells come from two runs (the notice pause re-measured alone)
    data["runs"][rid]["commit"] = "abc1234"
    path.write_text(json.dumps(data))
    figures.save([rows[0]], "scripts/bench recovery --save", started=started, elapsed_s=9,
                 path=path, now=2 * 86400)  # fmt: skip
    got, _, block = _readme_block(figures.rendered(t)["README.md"][1])
    names = {c[0] for c in got}
    assert "pause at a notice, torchft engine" not in names  # its steps lost: the other run
    assert "pause at a join, torchft engine" in names
    assert "pause at a notice, torchft engine" in block.split("Not shown", 1)[1]


def test_a_saved_run_records_its_commit(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    path = t / "docs/figures/bench-results.json"
    row = {"benchmark": "quorum", "metric": "torchft: next_step() waiting for its quorum",
           "spotctl": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 200}, "baseline": None,
           "unit": "ms", "note": ""}
    run = figures.save([row], "scripts/bench quorum --save",
                       started={"load_average": [1.0, 1.0, 1.0]}, elapsed_s=1, path=path, now=0)
    rec = figures.read_results(path)["runs"][run]
    assert rec["commit"] and len(rec["commit"]) >= 7
    assert figures.run_record(rec).startswith(
        f"`scripts/bench quorum --save`, 1970-01-01, {rec['commit']}, torch ")


def test_a_saved_quorum_run_renders_its_tables_and_readme_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scripts/bench quorum --save` (issue 63): the rows of one full quorum run, as the
    benchmark builds them (its sessions replaced by fixed figures), saved and rendered.
    The stability table reads the late replica's heals and the oldest heartbeat from the
    saved row, and the README's quorum-wait row is shown, citing that one run."""
    from bench_lib import quorum
    from bench_lib.core import Context, rows_json

    monkeypatch.setitem(sys.modules, "torchft", sys.modules.get("torchft") or object())
    monkeypatch.setattr(quorum, "_session", lambda ctx, nodes, steps, bare: quorum.QuorumFigures(
        step_s=[0.012 if bare else 0.007] * steps,
        quorum_s=[] if bare else [0.0025] * steps))
    runs = iter([quorum.StragglerRun(0.0, 1, "", 0.061, 2.4),  # spotctl's timing
                 quorum.StragglerRun(52.0, 7, "", 0.9, 2.6)])  # the baseline's
    monkeypatch.setattr(quorum, "_straggler_session", lambda ctx, steps, env: next(runs))
    rows = quorum.bench(Context(work=tmp_path / "work", out=tmp_path / "out", quiet=True))
    assert [r.metric for r in rows] == [
        "torchft: step time, sync quorum vs bare torchft's async",
        "torchft: next_step() waiting for its quorum",
        "torchft: spurious regroupings per 1,000 steps, jittery replica"]
    t = _tree(tmp_path)
    path = t / "docs/figures/bench-results.json"
    run = figures.save(json.loads(rows_json(rows)), "scripts/bench quorum --save",
                       started={"load_average": [2.0, 2.0, 2.0]}, elapsed_s=600, path=path,
                       now=86400)  # fmt: skip
    saved = {r["metric"]: r for r in figures.read_results(path)["rows"]}
    stab = saved["torchft: spurious regroupings per 1,000 steps, jittery replica"]
    assert stab["run"] == run and stab["heals"] == {"spotctl": 1, "baseline": 7}
    assert stab["oldest_heartbeat_ms"] == {"2": 61}
    tables = figures.render_tables(figures.read_results(path),
                                   figures.read_goodput(t / "docs/figures/goodput.json"))
    assert "| heals of the late replica | 1 | 7 per run |" in tables["quorum-stability"]
    assert "| 61 ms (load 2) |" in tables["quorum-stability"]
    assert "| `next_step()` wait for the quorum | 2.5 ms |" in tables["quorum"]
    got, records, block = _readme_block(figures.rendered(t)["README.md"][1])
    (wait,) = [c for c in got if c[0].startswith("quorum wait per step")]
    assert wait[1:3] == ["2.5 ms", ""], wait
    assert records[wait[3].split()[0]].startswith("`scripts/bench quorum --save`, 1970-01-02, ")
    assert wait[3].endswith("(n=200)") and "quorum wait" not in block.split("\n\n", 1)[1]
