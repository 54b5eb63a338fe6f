"""Issue 14: the controller does not trust the head either, and its own state survives
races and damage: event import is validated and best effort, `down` always reaches its
cleanup, a rebalance that waited for `down` does not bring the cluster back, a corrupt
launch intent is set aside, locks name their holder, the crontab read-modify-write is
serialised, and kill_tag never signals a pid that now belongs to another process."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from spotctl.agent import proctree
from spotctl.control import cron, reconcile
from spotctl.errors import StateError
from spotctl.spec import ClusterSpec
from spotctl.state import Store
from tests.conftest import wait_until

POISON = [
    {"seq": 1, "ts": 1000.0, "type": "note", "message": "fine"},
    {"seq": 2, "ts": "x", "type": "note"},
    {"seq": "3", "ts": 1001.0, "type": "note"},
    {"seq": 4, "ts": 1e308, "type": "note"},
    {"seq": 5, "ts": 1002.0, "type": ["note"]},
    {"seq": 6, "ts": 1003.0, "type": "a\nb"},
    "not an object",
    None,
    {"seq": 7, "ts": 1004.0},
    {"seq": 8, "ts": 1005.0, "type": "rescale", "lost_steps": 0},
    {"seq": 9, "ts": 1006.0, "type": "rescale", "lost_steps": "x"},
    {"seq": 10, "ts": 1007.0, "type": "rescale", "to_world_size": [3]},
    {"seq": 11, "ts": 1008.0, "type": "notice", "node": {"id": 1}},
]


class _EvilHead(BaseHTTPRequestHandler):
    """A head that answers with whatever the test put in `reply` (it could be anyone)."""

    reply: Any = {"events": POISON}

    def log_message(self, *a: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps(type(self).reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def evil_head() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _EvilHead)
    t = threading.Thread(target=srv.serve_forever, daemon=True,
                         kwargs={"poll_interval": 0.05})
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("pass\n")
    s = Store(tmp_path / "home")
    yield s
    s.close()


def _cluster(store: Store, url: str, tmp_path: Path, state: str = "running") -> ClusterSpec:
    spec = ClusterSpec.model_validate({"name": "c1", "provider": "local",
                                       "train": {"script": str(tmp_path / "train.py")}})
    store.upsert_cluster("c1", "local", spec.model_dump(mode="json"), state)
    store.set_head("c1", {"url": url})
    store.cluster_dir("c1").token(create=True)
    return spec


def test_event_import_skips_malformed_events(store: Store, evil_head: str,
                                             tmp_path: Path) -> None:
    _cluster(store, evil_head, tmp_path)
    skipped = reconcile.sync_events(store, "c1")
    assert skipped == len(POISON) - 2
    evs = store.events("c1")
    assert [(e["type"], e["ts"]) for e in evs] == [("note", 1000.0), ("rescale", 1005.0)]


@pytest.mark.parametrize("reply", [{"events": "x"}, [], {"nope": 1}, {"events": [[1, 2]]}])
def test_event_import_survives_a_malformed_answer(store: Store, evil_head: str,
                                                  tmp_path: Path, reply: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_EvilHead, "reply", reply)
    _cluster(store, evil_head, tmp_path)
    reconcile.sync_events(store, "c1")  # never raises
    assert store.events("c1") == []


def test_journal_rows_written_before_validation_are_skipped(store: Store, tmp_path: Path) -> None:
    store.add_event("c1", "ok", {"ts": "forged", "type": "forged", "x": 1}, ts=5.0)
    store.db.execute("INSERT INTO events (cluster, ts, type, data_json) VALUES (?,?,?,?)",
                     ("c1", "x", "bad", "{}"))
    store.db.execute("INSERT INTO events (cluster, ts, type, data_json) VALUES (?,?,?,?)",
                     ("c1", 6.0, "bad", "[1]"))
    assert store.events("c1") == [{"ts": 5.0, "type": "ok", "x": 1}]


def test_down_reaches_cleanup_when_the_head_serves_poison(store: Store, evil_head: str,
                                                          tmp_path: Path) -> None:
    _cluster(store, evil_head, tmp_path)
    leaks = reconcile.down(store, "c1")
    assert leaks == []
    assert store.get_cluster("c1").state == "down"
    assert [e for e in store.events("c1") if e["type"] == "down"]


def test_rebalance_that_waited_for_down_does_not_bring_the_cluster_back(
    store: Store, tmp_path: Path
) -> None:
    """The race: rebalance saw 'running' before the lock, `down` held the lock; once down
    is done, the rebalance must stop under the lock instead of re-creating the head."""
    spec = _cluster(store, "http://127.0.0.1:9", tmp_path)
    cdir = store.cluster_dir("c1")
    holding, release = threading.Event(), threading.Event()

    def down_holding_the_lock() -> None:
        with cdir.lock():
            holding.set()
            release.wait(10)
            own = Store(store.root)  # one connection per thread, as per process
            own.set_cluster_state("c1", "down")
            own.close()

    t = threading.Thread(target=down_holding_the_lock)
    t.start()
    assert holding.wait(5)
    waited: list[str] = []
    out: list[BaseException] = []

    def rebalance() -> None:
        own = Store(store.root)
        try:
            reconcile.reconcile(own, spec, create=False,
                                progress=lambda msg, frac=None: waited.append(msg))
        except BaseException as e:  # noqa: BLE001 - collected for the assert
            out.append(e)
        finally:
            own.close()

    r = threading.Thread(target=rebalance)
    r.start()
    # the rebalance is waiting on the lock when it names the holder
    wait_until(lambda: any(f"pid {os.getpid()}" in m for m in waited), 10,
               "the rebalance to wait for the lock")
    release.set()
    t.join(10)
    r.join(20)
    assert out and isinstance(out[0], StateError) and "is down" in str(out[0])
    assert store.get_cluster("c1").state == "down"
    assert not (cdir.path / "head" / "head.json").exists()  # no head started
    assert any(f"pid {os.getpid()}" in m for m in waited), waited  # the holder was named


def test_a_lock_held_elsewhere_names_its_holder(store: Store) -> None:
    cdir = store.cluster_dir("c1")
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from spotctl.state import ClusterDir\n"
         "d = ClusterDir(Path(sys.argv[1]), 'c1')\n"
         "with d.lock():\n print('held', flush=True); time.sleep(30)\n",
         str(store.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(StateError, match=f"pid {proc.pid}"), cdir.lock(wait=False):
            pass
        with pytest.raises(StateError, match=f"still held after 0s .*pid {proc.pid}"), \
                cdir.lock(timeout_s=0.3):
            pass
    finally:
        proc.kill()
        proc.wait()
    with cdir.lock(wait=False):  # free again once the holder is gone
        pass


class _NoLaunch:
    def launch(self, *a: Any, **kw: Any) -> list[Any]:
        raise AssertionError("a corrupt intent must not be replayed")


@pytest.mark.parametrize("content", ["{", "[]", '{"offer": {}}', '{"offer": 1, "count": "x"}',
                                     "\x00\xff"])
def test_a_corrupt_launch_intent_is_set_aside(store: Store, tmp_path: Path,
                                              content: str) -> None:
    spec = _cluster(store, "http://127.0.0.1:9", tmp_path)
    p = store.cluster_dir("c1").path / "launch-intent.json"
    p.write_text(content)
    result = reconcile.ReconcileResult(cluster="c1", plan=reconcile.Plan())
    reconcile._resume_intent(store, spec, _NoLaunch(), result)
    assert not p.exists()
    assert list(p.parent.glob("launch-intent.corrupt-*.json"))
    assert result.errors and "corrupt launch intent" in result.errors[0]
    reconcile._resume_intent(store, spec, _NoLaunch(), result)  # later runs go on


FAKE_CRONTAB = """#!/bin/sh
f="${FAKE_CRONTAB_FILE:?}"
case "$1" in
  -l) [ -f "$f" ] || { echo "no crontab for x" >&2; exit 1; }; cat "$f"; sleep 0.3 ;;
  -) cat > "$f" ;;
esac
"""


def test_concurrent_crontab_edits_keep_every_line(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the lock two installs read the same table and the second write drops the
    first's line (the fake crontab is slow to read to make that window wide)."""
    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path / "home"))
    prog = tmp_path / "crontab"
    prog.write_text(FAKE_CRONTAB)
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("SPOTCTL_CRONTAB", str(prog))
    monkeypatch.setenv("FAKE_CRONTAB_FILE", str(tmp_path / "table"))
    names = [f"c{i}" for i in range(4)]
    ts = [threading.Thread(target=cron.install,
                           args=(n, "5m", tmp_path / "home", tmp_path / "home" / n))
          for n in names]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sorted(e.cluster for e in cron.show()) == names


def test_kill_tag_never_signals_a_reused_pid() -> None:
    """A pid whose start time is not the one recorded (the kernel gave the number to a
    new process) is left alone; the same check lets the real one be killed."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = proctree._start_time(p.pid)
        assert started is not None
        proctree._signal_same(p.pid, started - 1, signal.SIGKILL)  # "another" process
        time.sleep(0.2)
        assert p.poll() is None
        proctree._signal_same(p.pid, started, signal.SIGKILL)
        assert p.wait(5) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_dry_run_writes_nothing(store: Store, tmp_path: Path) -> None:
    spec = _cluster(store, "http://127.0.0.1:9", tmp_path)
    n_events = len(store.events("c1"))
    before = sorted(p.name for p in store.cluster_dir("c1").path.iterdir())
    res = reconcile.reconcile(store, spec, dry_run=True)
    assert res.dry_run
    assert sorted(p.name for p in store.cluster_dir("c1").path.iterdir()) == before
    assert len(store.events("c1")) == n_events
    assert store.get_cluster("c1").state == "running"


def test_training_processes_get_no_credential() -> None:
    from spotctl.agent.supervisor import worker_env

    tok = "node:n1:" + "ab" * 32
    env = {"PATH": "/bin", "LEAK": tok, "WRAPPED": f"x{tok}y", "SPOTCTL_TOKEN_FILE": "/t",
           "WANDB_API_KEY": "user's own"}
    assert worker_env(env, tok) == {"PATH": "/bin", "WANDB_API_KEY": "user's own"}


def test_down_waiting_on_a_lock_names_the_holder(store: Store, tmp_path: Path) -> None:
    _cluster(store, "http://127.0.0.1:9", tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from spotctl.state import ClusterDir\n"
         "with ClusterDir(Path(sys.argv[1]), 'c1').lock():\n"
         " print('held', flush=True); time.sleep(3)\n", str(store.root)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        p = subprocess.run([sys.executable, "-m", "spotctl.cli.app", "down", "--name", "c1",
                            "--yes"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, SPOTCTL_HOME=str(store.root)))
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 0, p.stderr
    assert f"waiting for the reconcile lock of c1: held by pid {holder.pid}" in p.stderr
    assert store.get_cluster("c1").state == "down"
