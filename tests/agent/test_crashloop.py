"""A worker that keeps failing is an error, not a wait (issue 62): the agent's reading of
its workers' log (spotctl.agent.crashloop). The agent and the head around it: the e2e
newcomer session (tests/e2e/test_first_hour.py)."""

from __future__ import annotations

from pathlib import Path

from spotctl.agent.crashloop import LINE_MAX, CrashWatch, crash_limit, last_error

TB = """Traceback (most recent call last):
  File "/p/train.py", line 9, in <module>
    main()
  File "/p/train.py", line 5, in main
    raise ValueError("dataset_size must be 8192")
ValueError: dataset_size must be 8192
"""
# what torchrun prints after its worker failed: its own traceback, not the cause
LAUNCHER = """Traceback (most recent call last):
  File "/v/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
"""


def test_last_error_is_the_workers_not_the_launchers() -> None:
    assert last_error("noise\n" + TB + "more noise\n" + LAUNCHER) == (
        "ValueError: dataset_size must be 8192", len("noise\n" + TB + "more noise\n" + LAUNCHER))
    assert last_error("a log with no traceback\n")[0] is None


def test_a_library_fatal_line_counts_as_the_error() -> None:
    line = ("spotctl.elastic: checkpoint step 40 under /c was written with dataset_size=8192, "
            "this run has dataset_size=2048; resuming would change the training trajectory")
    assert last_error(f"x\n{line}\n{LAUNCHER}")[0] == line


def test_a_traceback_still_being_written_is_read_again_whole(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    w = CrashWatch(log, limit=1)
    half = TB[: TB.index("ValueError")]
    log.write_text("started\n" + half)
    assert not w.look(None) and w.line is None
    with open(log, "a") as f:
        f.write(TB[len(half):])
    assert w.look(None) and w.line == "ValueError: dataset_size must be 8192"


def test_the_same_failure_limit_times_without_a_step_stops_it(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    log.write_text(TB)  # an earlier agent's log: not news
    w = CrashWatch(log, limit=3)
    w.skip_to_end()
    seen = []
    for _ in range(3):
        with open(log, "a") as f:
            f.write("starting\n" + TB + LAUNCHER)
        seen.append(w.look(0))
    assert seen == [False, False, True] and w.count == 3


def test_progress_or_another_error_starts_the_count_anew(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    log.write_text("")
    w = CrashWatch(log, limit=2)
    with open(log, "a") as f:
        f.write(TB)
    assert not w.look(5)
    with open(log, "a") as f:  # it trained past step 5 before failing again: no loop
        f.write(TB)
    assert not w.look(9) and w.count == 1
    with open(log, "a") as f:
        f.write(TB.replace("8192", "4096"))
    assert not w.look(9) and w.count == 1
    with open(log, "a") as f:
        f.write(TB.replace("8192", "4096"))
    assert w.look(9)


def test_failures_not_counted_while_told_not_to(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    log.write_text("")
    w = CrashWatch(log, limit=1)
    with open(log, "a") as f:
        f.write(TB)
    assert not w.look(None, count=False) and w.count == 0
    assert not w.look(None)  # and what was read then is not counted later


def test_the_line_is_one_printable_bounded_line() -> None:
    nasty = "RuntimeError: \x1b[31mred\x1b[0m " + "x" * 1000 + "\r\x07"
    line = last_error(f"Traceback (most recent call last):\n  File 'a'\n{nasty}\n")[0]
    assert line is not None and len(line) <= LINE_MAX and line.isprintable()
    assert line.startswith("RuntimeError:  [31mred [0m x") and line.endswith("...")


def test_crash_limit_from_the_environment() -> None:
    assert crash_limit({}) == 3
    assert crash_limit({"SPOTCTL_CRASH_LIMIT": "0"}) == 0
    assert crash_limit({"SPOTCTL_CRASH_LIMIT": "-1"}) == 3  # not a count: the default
