"""Trace readers on the shipped samples (no reads of ../shared) and on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.errors import SpecError
from spotctl.simulate.traces import read_trace

DATA = Path(__file__).resolve().parents[2] / "spotctl" / "data" / "traces"


def test_bamboo_p3_matches_published_counts() -> None:
    tr = read_trace(DATA / "p3-trace.csv")
    assert tr.format == "bamboo"
    # Shared data README: 344 events, 177 nodes, 32 concurrent at most, 11.37 h.
    assert len(tr.events) == 344
    assert len({e.node for e in tr.events}) == 177
    assert tr.max_nodes == 32
    assert tr.span_s / 3600 == pytest.approx(11.37, abs=0.01)
    assert tr.instance_type == "p3.2xlarge"


def test_bamboo_timeline_counts_present_nodes() -> None:
    tr = read_trace(DATA / "g4dn-trace.csv")
    present: set[str] = set()
    for e in tr.events:
        (present.add if e.kind == "add" else present.discard)(e.node)
        assert tr.available_at(e.t_s) >= 0
    # First event is at 480000 ms: nothing is available before it.
    assert tr.available_at(0.0) == 0
    assert tr.available_at(480.0) >= 1
    assert tr.max_nodes == 24


def test_spot_traces_multinode_counts_become_slot_events() -> None:
    tr = read_trace(DATA / "aws-4node-08-03-2023_us-west-2c_v100_1.json")
    raw = json.loads((DATA / "aws-4node-08-03-2023_us-west-2c_v100_1.json").read_text())
    gap = raw["metadata"]["gap_seconds"]
    assert tr.gap_s == gap
    assert tr.span_s == len(raw["data"]) * gap
    for i in range(0, len(raw["data"]), 97):
        assert tr.available_at(i * gap + gap / 2) == raw["data"][i]
    drops = sum(max(0, a - b) for a, b in zip(raw["data"], raw["data"][1:], strict=False))
    assert len(tr.preemptions) == drops
    assert (tr.zone, tr.region, tr.instance_type) == ("us-west-2c", "us-west-2", "p3.2xlarge")


def test_spot_traces_prices_kept_as_change_points() -> None:
    tr = read_trace(DATA / "aws-1node-04-22-2023-first48h_us-east-1c_v100_1.json")
    assert tr.prices == ((0.0, 0.918),)
    assert tr.max_nodes == 1
    assert len(tr.preemptions) == 13


def test_truncated_keeps_only_the_first_hours() -> None:
    tr = read_trace(DATA / "p3-trace.csv").truncated(2.0)
    assert tr.span_s == 7200.0
    assert all(e.t_s < 7200.0 for e in tr.events)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("a.json", "{not json", "not valid JSON"),
        ("b.json", '{"data": [1]}', "gap_seconds"),
        ("c.json", '{"metadata": {"gap_seconds": 0}, "data": [1]}', "positive"),
        ("d.json", '{"metadata": {"gap_seconds": 5}, "data": [1, "x"]}', "data[1]"),
        ("e.json", '{"metadata": {"gap_seconds": 5}, "data": [1], "prices": []}', "prices"),
        ("f.csv", "0,add,n1\n10,explode,n1\n", "row 2"),
        ("g.csv", "0,add,n1\n0,remove,n2\n", "removed but not present"),
        ("h.csv", "60,add,n1\n0,remove,n1\n", "goes back"),
        ("i.csv", "", "empty"),
        ("j.csv", "1,2\n", "row 1"),
    ],
)
def test_bad_files_raise_one_clear_line(tmp_path: Path, name: str, text: str, needle: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(SpecError) as ei:
        read_trace(p)
    msg = str(ei.value)
    assert needle in msg and str(p) in msg and "\n" not in msg


def test_missing_file() -> None:
    with pytest.raises(SpecError, match="no such file"):
        read_trace("/nonexistent/trace.json")
