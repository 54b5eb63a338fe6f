"""The head's samples (spotctl/head/samples.py), what `spotctl report` draws between
events: one sample's fields from the head's status, the file read back past a crash's cut
line, the pace kept across a head restart, and the thinning that bounds the file."""

from __future__ import annotations

import json
from pathlib import Path

from spotctl.head.samples import SampleLog, read_samples, sample_of


def test_a_sample_is_the_status_in_short() -> None:
    status = {"world_size": 3, "step": 41, "last_checkpoint_step": 40,
              "throughput": 123.45678, "nodes": {
                  "n1": {"state": "running"}, "n2": {"state": "running"},
                  "n3": {"state": "joining"}, "n4": {}, "n5": {"state": "running"}}}
    assert sample_of(status, 1000.12345) == {
        "ts": 1000.123, "world_size": 3, "step": 41, "checkpoint_step": 40,
        "throughput": 123.457, "nodes": 3}
    # a head that has seen nothing yet
    assert sample_of({}, 5.0) == {"ts": 5.0, "world_size": 0, "step": 0,
                                  "checkpoint_step": 0, "throughput": None, "nodes": 0}


def test_reading_back_skips_cut_and_foreign_lines(tmp_path: Path) -> None:
    p = tmp_path / "samples.jsonl"
    assert read_samples(p) == []
    p.write_bytes(b'{"ts":1,"step":1}\n{"ts":2,"st\n[1,2]\n{"step":3}\n{"ts":"x"}\n'
                  b'\xff\xfe\n{"ts":4.5,"step":4}\n')
    assert read_samples(p) == [{"ts": 1, "step": 1}, {"ts": 4.5, "step": 4}]


def test_samples_keep_their_pace_and_a_restart_keeps_it_too(tmp_path: Path) -> None:
    p = tmp_path / "samples.jsonl"
    log = SampleLog(p, interval_s=2.0)
    assert log.add({"ts": 100.0}) and not log.add({"ts": 101.0})
    assert not log.add({"ts": 101.89})  # sooner than 95 % of the interval
    assert log.add({"ts": 101.9})
    assert p.read_text() == '{"ts":100.0}\n{"ts":101.9}\n'  # compact lines
    assert log.count == 2
    # a restarted head reads the file: it goes on from the last sample, at the pace the
    # file had reached (90 % of the last gap, never below its own interval)
    p.write_text('{"ts":0}\n{"ts":100}\n{"ts":120}\n')
    again = SampleLog(p, interval_s=2.0)
    assert again.count == 3 and again.last_ts == 120 and again.interval_s == 18.0
    assert SampleLog(p, interval_s=30.0).interval_s == 30.0
    p.write_text('{"ts":0}\n{"ts":100000}\n')
    assert SampleLog(p, interval_s=2.0).interval_s == 3600.0  # at most an hour
    p.write_text('{"ts":7}\n')
    one = SampleLog(p, interval_s=2.0)
    assert one.interval_s == 2.0 and one.last_ts == 7


def test_the_file_is_thinned_at_its_bound_and_the_pace_halves(tmp_path: Path) -> None:
    p = tmp_path / "samples.jsonl"
    log = SampleLog(p, interval_s=1.0, max_samples=6)
    for t in range(5):
        assert log.add({"ts": float(t)})
    assert log.count == 5 and log.interval_s == 1.0
    assert log.add({"ts": 5.0})  # the 6th: every other one kept, the interval doubled
    assert [s["ts"] for s in read_samples(p)] == [0.0, 2.0, 4.0]
    assert log.count == 3 and log.interval_s == 2.0
    assert not (tmp_path / "samples.tmp").exists()
    assert all(json.loads(x) for x in p.read_text().splitlines())
    assert p.read_text().startswith('{"ts":0.0}\n')
