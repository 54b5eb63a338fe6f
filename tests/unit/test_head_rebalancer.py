"""The head's reconcile loop (spotctl.head.rebalancer) with real child processes: what it
reports of each run, restarts after a failure, the end once the cluster is down, stop,
and that it dies with the head that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from spotctl.agent import proctree
from spotctl.head.rebalancer import Rebalancer
from tests.conftest import wait_until


class Scripted(Rebalancer):
    """The loop with a stand-in command: each start runs the next script."""

    def __init__(self, tmp: Path, scripts: list[str]):
        super().__init__("c1", tmp / "home", tmp / "rebalance.log", interval_s=30)
        self.scripts = scripts
        self.starts = 0

    def argv(self) -> list[str]:
        src = self.scripts[min(self.starts, len(self.scripts) - 1)]
        self.starts += 1
        return [sys.executable, "-c", textwrap.dedent(src)]


RUN = {"cluster": "c1", "trigger": ["notice"], "errors": ["n4: bootstrap failed"], "launched": ["n3"],
       "actions": [{"type": "replace", "reason": "n1 got a notice"}]}


def test_runs_are_reported_a_failure_restarts_it_and_the_end_of_the_cluster_ends_it(
    tmp_path: Path,
) -> None:  # fmt: skip
    # (each run's line stays the last one for a while: the test looks at it meanwhile)
    first = ("import json, sys, time; print('not json'); "
             f"print(json.dumps({RUN!r}), flush=True); time.sleep(1); sys.exit(3)")
    failed = ("import json, time; print(json.dumps({'cluster': 'c1', 'error': 'aws: throttled', "
              "'actions': [], 'trigger': ['interval']}), flush=True); time.sleep(1); "
              "raise SystemExit(1)")
    # the loop's environment is the head's, with the state directory it was given
    last = ("import os, sys; assert os.environ['SPOTCTL_HOME'].endswith('home'); "
            "sys.exit(os.environ.get('REBALANCER_TEST') != 'inherited')")
    os.environ["REBALANCER_TEST"] = "inherited"
    try:
        r = Scripted(tmp_path, [first, failed, last])
        r.start()
        wait_until(lambda: r.status()["last_run"] is not None, 20, "a first run", 0.05)
        st = r.status()
        assert st["last_run"]["actions"] == ["replace: n1 got a notice"], st
        assert st["last_run"]["trigger"] == ["notice"], st
        assert st["last_run"]["errors"] == ["n4: bootstrap failed"], st
        assert st["interval_s"] == 30 and st["running"] and st["restarts"] == 0, st
        assert st["last_run"]["skipped"] is False and st["last_run"]["at"] <= time.time()
        wait_until(lambda: r.status()["last_run"]["errors"] == ["aws: throttled"], 20,
                   "the second run's failure", 0.05)
        assert r.status()["restarts"] == 1 and r.status()["running"]
        assert r.status()["last_run"]["errors"] == ["aws: throttled"]
        wait_until(lambda: r.status()["ended"], 20, "the loop to end", 0.1)
    finally:
        del os.environ["REBALANCER_TEST"]
    st = r.status()
    assert st["restarts"] == 2 and st["last_exit"] == 0 and not st["running"], st
    assert r.starts == 3
    log = (tmp_path / "rebalance.log").read_text()
    assert "not json" in log and '"launched": ["n3"]' in log, log
    r.stop()


def test_the_real_command_for_an_unknown_cluster_fails_and_is_started_again(
    tmp_path: Path,
) -> None:  # fmt: skip
    r = Rebalancer("nosuch", tmp_path / "home", tmp_path / "rebalance.log", interval_s=30)
    r.start()
    try:
        wait_until(lambda: r.status()["restarts"] >= 1, 60, "a restart", 0.1)
        st = r.status()
        assert st["last_exit"] not in (None, 0) and not st["ended"], st
        log = (tmp_path / "rebalance.log").read_text()
        assert "no cluster named 'nosuch'" in log, log
    finally:
        r.stop()
    assert not r.status()["running"]


def test_stop_ends_a_running_loop(tmp_path: Path) -> None:
    r = Scripted(tmp_path, ["import time; time.sleep(60)"])
    r.start()
    wait_until(lambda: r.status()["running"], 20, "the loop to run", 0.05)
    pid = r.status()["pid"]
    assert isinstance(pid, int) and proctree.alive(pid)
    r.stop()
    assert not r.status()["running"] and r.status()["restarts"] == 0
    assert not proctree.alive(pid)


def test_the_loop_dies_with_the_head_that_started_it(tmp_path: Path) -> None:
    """A head killed outright (SIGKILL: no stop()) takes its loop with it, so the head
    that replaces it does not run a second one beside the first."""
    head = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from spotctl.head.rebalancer import Rebalancer

        class Loop(Rebalancer):
            def argv(self):
                return [sys.executable, "-c", "import time; time.sleep(60)"]

        r = Loop("c1", Path({str(tmp_path)!r}), Path({str(tmp_path / "log")!r}))
        r.start()
        while not r.status()["running"]:
            time.sleep(0.05)
        print(r.status()["pid"], flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", head], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    try:
        assert p.stdout is not None
        pid = int(p.stdout.readline())
        assert proctree.alive(pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 10
        while proctree.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not proctree.alive(pid), "the loop outlived its head"
    finally:
        p.kill()


def test_a_line_of_the_loop_that_is_not_a_run_changes_nothing(tmp_path: Path) -> None:
    lines = ["[1, 2]", json.dumps({"actions": "x", "trigger": ["interval"], "skipped": 1}),
             "{"]
    src = "print(" + repr("\n".join(lines)) + ")"
    r = Scripted(tmp_path, [src + "\nimport sys; sys.exit(0)"])
    r.start()
    wait_until(lambda: r.status()["ended"], 20, "the loop to end", 0.1)
    last = r.status()["last_run"]
    assert last is not None and last["actions"] == [] and last["trigger"] == ["interval"]
    assert last["skipped"] is True and last["errors"] == []
    r.stop()


def test_its_log_is_set_aside_past_a_size(tmp_path: Path, monkeypatch) -> None:
    """A loop that runs for weeks keeps one old log beside the current one, not all."""
    from spotctl.head import rebalancer

    monkeypatch.setattr(rebalancer, "LOG_MAX_BYTES", 1000)
    (tmp_path / "rebalance.log").write_bytes(b"old\n" * 400)  # from an earlier head
    src = "import json\nfor i in range(100): print(json.dumps({'trigger': [str(i)]}))"
    r = Scripted(tmp_path, [src])
    r.start()
    wait_until(lambda: r.status()["ended"], 20, "the loop to end", 0.1)
    r.stop()
    assert r.status()["last_run"]["trigger"] == ["99"]
    now = (tmp_path / "rebalance.log").read_text()
    old = (tmp_path / "rebalance.log.1").read_text()
    assert '{"trigger": ["99"]}' in now and "old" not in now and "old" not in old
    assert len(now) <= 1100 and len(old) <= 1100
    assert not (tmp_path / "rebalance.log.2").exists()
