"""The fault matrix's replay count on torchrun (scripts/chaos_lib/replays.py), from worker
traces written in templates/train.py's format: a file per process, a line per trained step
(`group rank step epoch indices...`)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.chaos_lib.replays import Window, fill, trained  # noqa: E402
from scripts.chaos_lib.result import Result  # noqa: E402


class Workers:
    """A worker group's processes appending to their trace as the template does."""

    def __init__(self, trace: Path) -> None:
        self.trace = trace
        self.pid = 1000

    def group(self, name: str, ranks: int, steps: range, torn: int | None = None) -> None:
        """`ranks` processes of group `name` train `steps`; `torn`: rank 0 was killed while
        writing the line of that step (no newline)."""
        for rank in range(ranks):
            self.pid += 1
            with open(self.trace / f"{self.pid}.txt", "a") as f:
                for s in steps:
                    f.write(f"{name} {rank} {s} 0 {s * 3 + rank} {s * 3 + rank + 1}\n")
                if torn is not None and rank == 0:
                    f.write(f"{name} {rank} {torn} 0 1")


def test_a_graceful_leave_replays_nothing(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 3, range(1, 21))
    mark = Window.open(tmp_path)
    w.group("a", 3, range(21, 31))  # drained at 30: the survivors resume from 30
    w.group("b", 2, range(31, 41))
    got = mark.close(timeout=0)
    assert got == {"replayed": 0, "steps": {}, "new_groups": 1, "settled": True}


def test_a_hard_kill_counts_every_step_trained_again(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 3, range(1, 31))
    mark = Window.open(tmp_path)
    # killed after training 37 (38 half-written by one rank: not trained), last commit 20
    w.group("a", 3, range(31, 38), torn=38)
    w.group("b", 2, range(21, 46))
    got = mark.close(timeout=0)
    assert got["settled"] and got["replayed"] == 17, got
    assert sorted(got["steps"]) == list(range(21, 38)) and set(got["steps"].values()) == {1}
    assert trained(tmp_path)[38] == {"b"}  # the torn line is no training of 38


def test_the_count_waits_for_the_new_group_to_pass_the_old(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 2, range(1, 38))
    mark = Window.open(tmp_path)
    w.group("b", 2, range(21, 31))  # replaying, not yet past 37
    early = mark.close(timeout=0)
    assert not early["settled"] and early["replayed"] == 10, early
    w.group("b", 2, range(31, 39))
    assert mark.close(timeout=0) == {
        "replayed": 17,
        "steps": dict.fromkeys(range(21, 38), 1),
        "new_groups": 1,
        "settled": True,
    }


def test_replays_before_the_mark_are_not_counted_again(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 2, range(1, 31))
    w.group("b", 2, range(21, 51))  # an earlier scenario's replays
    mark = Window.open(tmp_path)
    w.group("b", 2, range(51, 61))
    assert mark.close(timeout=0)["replayed"] == 0


def test_two_restarts_in_one_fault(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 3, range(1, 38))
    mark = Window.open(tmp_path)
    w.group("b", 2, range(21, 26))  # killed too before it got far
    w.group("c", 1, range(21, 41))
    got = mark.close(timeout=0)
    # 21..25 trained three times (two replays each), 26..37 twice
    assert got["settled"] and got["replayed"] == 5 * 2 + 12 * 1 and got["new_groups"] == 2


def test_the_row_carries_the_workers_figure_and_the_heads_beside_it(tmp_path: Path) -> None:
    w = Workers(tmp_path)
    w.group("a", 2, range(1, 31))
    mark = Window.open(tmp_path)
    w.group("a", 2, range(31, 36))
    w.group("b", 2, range(21, 37))
    row = Result("3 x")
    fill(row, mark, head_lost_steps=12, timeout=0)  # the head heard of step 33 last
    assert row.steps_replayed == 15
    assert row.detail["head_lost_steps"] == 12
    assert row.detail["replays_disagree"] == {"workers": 15, "head": 12}
    same = Result("3 y")
    fill(same, Window.open(tmp_path), head_lost_steps=0, timeout=0)
    assert same.steps_replayed == 0 and "replays_disagree" not in same.detail
    head_only = Result("1 ft")  # no trace (torchft's replicas log their own steps)
    fill(head_only, None, head_lost_steps=4)
    assert head_only.steps_replayed == 4 and "workers_replayed" not in head_only.detail
