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

On a cloud head the loop runs from a state directory of its own (`home/` beside the
bundle): `up` uploads a bundle (rebalance.json: the cluster's spec, where the head is,
the cluster's SSH key and pinned host keys), which the head imports before each run of
the loop when it changed. The loop's cloud calls use the head VM's own role, scoped to
this cluster (the provider's head policy), never the controller's credentials.

The controller and the head never reconcile at once: a controller's `up`, `rebalance`
or `down` asks the head to pause (`pause()`), which holds the same "rebalance" lock
the loop's runs take (a run in progress finishes first), until `resume()` or the pause's
time-to-live ends.
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

from spotctl.state import ClusterDir, Store, write_private

log = logging.getLogger("spotctl.head")

MAX_BACKOFF_S = 60.0
LOG_MAX_BYTES = 8 << 20  # rebalance.log is set aside as rebalance.log.1 past this
_PR_SET_PDEATHSIG = 1
BUNDLE = "rebalance.json"
ON_HEAD_VAR = "SPOTCTL_ON_HEAD"  # the loop's child: the head's instance id
HEAD_DIR_VAR = "SPOTCTL_HEAD_NODE_DIR"  # the loop's child: the head's node directory
MAX_PAUSE_S = 3 * 3600.0
FRESH_BUNDLE_S = 120.0  # a head started this soon after its bundle came starts paused...
FIRST_PAUSE_S = 900.0  # ...for this long at most (the controller resumes it sooner)


def import_bundle(bundle: Path, token_file: Path) -> dict[str, Any]:
    """Make `home/` beside `bundle` the state directory of the bundle's cluster: its spec
    and head in the store, its files (the SSH key, known_hosts) and the head's token in
    its cluster directory. Returns the bundle."""
    b = json.loads(bundle.read_text())
    if not isinstance(b, dict) or not isinstance(b.get("cluster"), str):
        raise ValueError(f"{bundle}: not a bundle")
    name = b["cluster"]
    home = bundle.parent / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    store = Store(home)
    try:
        cdir = store.cluster_dir(name).ensure()
        files = b.get("files") or {}
        for rel, text in files.items():
            parts = rel.split("/") if isinstance(rel, str) else [""]
            if len(parts) > 2 or any(not p or p.startswith(".") for p in parts):
                raise ValueError(f"{bundle}: bad file name {rel!r}")
            if len(parts) == 2:
                (cdir.path / parts[0]).mkdir(mode=0o700, exist_ok=True)
            write_private(cdir.path / rel, str(text))
        write_private(cdir.token_file, token_file.read_text().strip() + "\n")
        store.upsert_cluster(name, str(b["provider"]), dict(b["spec"]), "running")
        store.set_head(name, dict(b["head"]))
    finally:
        store.close()
    return b


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the head's stop() still ends it
        pass


class Rebalancer:
    """Runs `spotctl rebalance --watch --name <cluster>` with `home` as its state directory
    and restarts it when it fails; `status()` is what the head's status page shows."""

    def __init__(self, cluster: str, home: Path, log_path: Path, interval_s: float = 60.0,
                 bundle: Path | None = None, token_file: Path | None = None):
        self.cluster = cluster
        self.home = home
        self.log_path = log_path
        self.interval_s = interval_s
        # a cloud head: the bundle `up` uploaded (see import_bundle), imported when it changed
        self.bundle = bundle
        self.token_file = token_file
        self._bundle_seen: float | None = None
        self._env: dict[str, str] = {}
        self._pause: Any = None  # the held lock (a context manager) while paused
        self._pause_until = 0.0
        self._pause_by = ""
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

    @classmethod
    def from_bundle(cls, bundle: Path, token_file: Path, log_path: Path) -> Rebalancer:
        b = import_bundle(bundle, token_file)
        loop = cls(b["cluster"], bundle.parent / "home", log_path,
                   float(b.get("interval_s") or 60.0), bundle=bundle, token_file=token_file)
        loop._took(b)
        if time.time() - bundle.stat().st_mtime < FRESH_BUNDLE_S:
            # `up` just uploaded it and started this head: that controller is still acting
            # (launching the first nodes) and resumes the loop when done
            loop.pause(FIRST_PAUSE_S, "the `up` that started this head")
        return loop

    def _took(self, b: dict[str, Any]) -> None:
        assert self.bundle is not None
        self._bundle_seen = self.bundle.stat().st_mtime
        self.interval_s = float(b.get("interval_s") or self.interval_s)
        env = {str(k): str(v) for k, v in (b.get("env") or {}).items()}
        env[ON_HEAD_VAR] = str(b["head"].get("instance_id") or "")
        env[HEAD_DIR_VAR] = str(self.bundle.parent)
        self._env = env

    def _refresh(self) -> None:
        """Import the bundle again when `up` uploaded a new one (a new spec)."""
        if self.bundle is None or self.token_file is None:
            return
        try:
            if self.bundle.stat().st_mtime != self._bundle_seen:
                self._took(import_bundle(self.bundle, self.token_file))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("could not import %s: %s", self.bundle, e)

    # ---- pause / resume (the controller reconciles meanwhile) ---------------------------

    def pause(self, ttl_s: float, by: str = "") -> dict[str, Any]:
        """Hold the loop's lock for the controller, for `ttl_s` at most. Never waits: a run
        in progress answers `paused: false` with who holds the lock; ask again."""
        ttl_s = min(max(ttl_s, 1.0), MAX_PAUSE_S)
        with self._lock:
            if self._pause is None:
                cm = ClusterDir(self.home, self.cluster).lock("rebalance", wait=False)
                try:
                    cm.__enter__()
                except Exception as e:  # noqa: BLE001 (LockHeld: a run is in progress)
                    return {"paused": False, "busy": str(e)}
                self._pause = cm
                threading.Thread(target=self._expire, name="rebalance-pause",
                                 daemon=True).start()
            self._pause_until = time.monotonic() + ttl_s
            self._pause_by = by[:200]
        log.info("reconcile loop paused for %.0f s (%s)", ttl_s, by or "controller")
        return {"paused": True, "ttl_s": ttl_s}

    def resume(self) -> dict[str, Any]:
        with self._lock:
            cm, self._pause = self._pause, None
        if cm is not None:
            cm.__exit__(None, None, None)
            log.info("reconcile loop resumed")
        self._refresh()
        return {"paused": False}

    def _expire(self) -> None:
        while True:
            with self._lock:
                if self._pause is None:
                    return
                left = self._pause_until - time.monotonic()
            if left <= 0:
                log.warning("the controller's pause ran out: the reconcile loop goes on")
                self.resume()
                return
            self._stop.wait(min(left, 5.0))
            if self._stop.is_set():
                return

    def status(self) -> dict[str, Any]:
        with self._lock:
            p = self._proc
            return {
                "paused": self._pause is not None,
                "paused_by": self._pause_by if self._pause is not None else "",
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
        while not self._stop.is_set():
            self._refresh()
            env = {**os.environ, **self._env, "SPOTCTL_HOME": str(self.home)}
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
