"""The head's reconcile loop: `spotctl rebalance --watch` for its own cluster, run and
restarted by the head ([rebalance] on_head), so that lost nodes are replaced with nothing
running on the controller: no cron line, no open terminal.

The loop is the controller's own command, run as a child of the head with the state
directory it is given (`SPOTCTL_HOME`). It reconciles when the head journals a notice, a
leave or a loss, and every `interval_s`; it takes the same "rebalance" lock as cron and a
`rebalance --watch` started by hand, so only one of them acts at a time. It ends by itself
once the cluster is down. It dies with the head (a restarted head starts a new one), and a
loop that fails is started again after 1, 2, 4 ... 60 s.

What it did last (its own JSON lines: the trigger, the actions, an error) is kept for the
head's status page; its whole output goes to `rebalance.log` beside the head's log.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("spotctl.head")

MAX_BACKOFF_S = 60.0
LOG_MAX_BYTES = 8 << 20  # rebalance.log is set aside as rebalance.log.1 past this
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the head's stop() still ends it
        pass


class Rebalancer:
    """Runs `spotctl rebalance --watch --name <cluster>` with `home` as its state directory
    and restarts it when it fails; `status()` is what the head's status page shows."""

    def __init__(self, cluster: str, home: Path, log_path: Path, interval_s: float = 60.0):
        self.cluster = cluster
        self.home = home
        self.log_path = log_path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self.last_run: dict[str, Any] | None = None
        self.last_exit: int | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "spotctl.cli.app", "rebalance", "--watch", "--json",
                "--name", self.cluster, "--interval", f"{self.interval_s:g}"]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rebalancer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            p = self._proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> dict[str, Any]:
        with self._lock:
            p = self._proc
            return {
                "running": p is not None and p.poll() is None,
                "pid": p.pid if p is not None else None,
                "restarts": self.restarts,
                # `rebalance --watch` exits 0 only once the cluster is down
                "ended": self.last_exit == 0,
                "last_exit": self.last_exit,
                "last_run": self.last_run,
                "interval_s": self.interval_s,
            }

    def _loop(self) -> None:
        backoff = 1.0
        env = dict(os.environ, SPOTCTL_HOME=str(self.home))
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                # its stderr (a traceback) goes into the same log, through _read
                p = subprocess.Popen(
                    self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=env, close_fds=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as e:
                log.warning("could not start the reconcile loop: %s", e)
                p = None
            if p is not None:
                with self._lock:
                    self._proc = p
                log.info("reconcile loop started (pid %d)", p.pid)
                assert p.stdout is not None
                self._read(p.stdout)
                code = p.wait()
                with self._lock:
                    self.last_exit = code
                if code == 0:  # the cluster is down: nothing to restart
                    log.info("reconcile loop ended: cluster %s is down", self.cluster)
                    return
            if self._stop.is_set():
                return
            if time.monotonic() - started > MAX_BACKOFF_S:
                backoff = 1.0
            with self._lock:
                self.restarts += 1
            log.warning("reconcile loop exited (%s); again in %.0f s",
                        None if p is None else p.returncode, backoff)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _rotate(self) -> None:
        try:
            if self.log_path.stat().st_size > LOG_MAX_BYTES:
                self.log_path.replace(self.log_path.with_name(self.log_path.name + ".1"))
        except OSError:
            pass

    def _read(self, out: IO[bytes]) -> None:
        """Each run's JSON line (this head's own child writes them) into `last_run`, and
        every line into the log."""
        self._rotate()
        logf = open(self.log_path, "ab")
        try:
            for raw in out:
                if logf.tell() > LOG_MAX_BYTES:  # a loop that runs for weeks
                    logf.close()
                    self._rotate()
                    logf = open(self.log_path, "ab")
                logf.write(raw)
                logf.flush()
                try:
                    run = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(run, dict):
                    continue
                acts = run.get("actions")
                acts = acts if isinstance(acts, list) else []
                summary = {
                    "at": time.time(),
                    "trigger": run.get("trigger"),
                    "skipped": bool(run.get("skipped")),
                    "actions": [f"{a.get('type')}: {a.get('reason')}" for a in acts
                                if isinstance(a, dict)],
                    "errors": run.get("errors") or ([run["error"]] if run.get("error") else []),
                }
                with self._lock:
                    self.last_run = summary
        finally:
            logf.close()
