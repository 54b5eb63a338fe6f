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
    assert "| pause at a join, torchft engine | 0.05 s |" in text
    readme.write_text(text.replace("| pause at a join, torchft engine | 0.05 s |",
                                   "| pause at a join, torchft engine | 0.04 s |"))  # fmt: skip
    assert "0.04 s" in figures.diff(t)
    # and a changed result without regenerating the docs
    shutil.copy(REPO / "README.md", readme)
    res = json.loads((t / "docs/figures/bench-results.json").read_text())
    for r in res["rows"]:
        if r["metric"] == "torchft: training pause at a join (3->4)":
            r["spotctl"]["median"] = 0.07
    (t / "docs/figures/bench-results.json").write_text(json.dumps(res))
    assert "0.07 s" in figures.diff(t)


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
    assert "0.31 s (0.2..0.4, 3 notices)" in d and "bare torchft: 0.22 s (a kill)" in d
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


def test_each_readme_figure_names_its_recorded_runs() -> None:
    """Issue 63: every README figure row names the run(s) its cells come from, and each
    run named is listed under the table with its command, date, commit, torch version and
    machine load (or says which of those its record lacks); a row drawing on more than
    one run says so."""
    import re

    text = (REPO / "README.md").read_text()
    block = text.split("<!-- figures:readme -->\n", 1)[1].split("<!-- /figures -->", 1)[0]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    records = dict(re.findall(r"^(\d+)\. (.+)$", block, re.M))
    assert len(rows) == 6 and records, block
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        runs = cells[3]
        if "(simulated)" in cells[0]:
            assert "deterministic" in runs and "scripts/sim-goodput" in runs, row
            continue
        named = re.findall(r"(\d+) \(", runs)
        assert named and all(n in records for n in named), (row, records)
        assert all(re.search(r"n=\d+|n not recorded", part) for part in runs.split(";")), row
        if len(set(named)) > 1:
            assert cells[0] in block.split("combine figures from separate runs", 1)[1], row
    for rec in records.values():
        assert rec.startswith("`scripts/") and re.search(r", 20\d\d-\d\d-\d\d, ", rec), rec
        assert re.search(r"torch \S+|torch version not recorded", rec), rec
        assert re.search(r"cores, load ", rec), rec
        assert re.search(r", [0-9a-f]{7,}, |commit not recorded", rec), rec


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
