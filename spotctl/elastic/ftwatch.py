"""A replica that vanished mid-step, found by its heartbeats instead of a timeout.

On the torchft engine each cross-replica collective is bounded by the cross-replica
timeout (SPOTCTL_FT_TIMEOUT_S). That bound has to be long on GPUs: a first
`torch.compile` step, a save's copy or a heal can keep a live replica out of a collective
for minutes, and a timeout would fail the step for everyone. A replica that is really
gone (its VM vanished, its network cut: nothing closes its connections) would then hold
the others for that long.

Every replica's Manager heartbeats the Lighthouse (every 50 ms). While a collective of
this worker has waited more than `after_s`, `Watch` reads the Lighthouse's status page
(every `poll_s`) and, when a member of the current quorum has not been seen for
`stale_s`, fails what waits: the step is not committed, and the next quorum, formed
without the vanished replica, goes on. Nothing is read while collectives finish in time.

What waits on a collective does so through `guard(fut)`: a future completed by `fut`,
or failed by the watch, whichever comes first (gloo); or inside `watching()`, where the
watch's `on_gone` ends the wait (NCCL: it aborts the group).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("spotctl.elastic.ft")

# one entry of the page's heartbeat list; the page HTML-escapes ids, so an id (which any
# cluster member chooses) cannot close its entry, and its age is the entry's last "seen"
_ENTRY = re.compile(r'<li class="heartbeat[^"]*">(.*?)</li>', re.S)
_AGE = re.compile(r"([0-9.eE+-]+)s ago")


def status_page(lighthouse: str) -> str:
    """torchft's Lighthouse status page (through the head's filter, which passes it),
    at most 1 MiB of it; OSError when it cannot be read."""
    with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=2) as r:
        return r.read(1 << 20).decode(errors="replace")


def heartbeats(page: str) -> dict[str, float]:
    """Replica id -> seconds since its last heartbeat, from torchft 0.2.0's status page."""
    out: dict[str, float] = {}
    for entry in _ENTRY.findall(page):
        rid, _, rest = entry.strip().rpartition(": seen ")
        m = _AGE.fullmatch(rest)
        if not rid or m is None:
            continue
        try:
            out[rid] = float(m.group(1))
        except ValueError:
            continue
    return out


def vanished(members: Iterable[str], own: str, beats: dict[str, float],
             stale_s: float) -> str | None:
    """The first member of the quorum (not this replica, `own` or `own:<uuid>`) the
    Lighthouse has not heard from for `stale_s`, or that it no longer lists. None while
    it does not list this replica either: a Lighthouse started again lists nobody until
    the next heartbeats, which says nothing about a peer."""
    if not any(r == own or r.startswith(own + ":") for r in beats):
        return None
    for m in members:
        if m == own or m.startswith(own + ":"):
            continue
        if beats.get(m, float("inf")) > stale_s:
            return m
    return None


class Watch:
    def __init__(self, lighthouse: str, own: str, members: Callable[[], Iterable[str]],
                 on_gone: Callable[[Exception], None], *, after_s: float = 1.0,
                 poll_s: float = 0.5, stale_s: float = 2.0, device: Any = None):
        self.device = device  # a CUDA device: the watch's thread asks events on it
        self._done: dict[int, Callable[[], bool]] = {}  # track()'s entries
        self.lighthouse = lighthouse
        self.own = own
        self.members = members
        self.on_gone = on_gone
        self.after_s, self.poll_s, self.stale_s = after_s, poll_s, stale_s
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, torch.futures.Future[Any]]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.found: list[str] = []  # replicas found gone, in order

    def _add(self, g: torch.futures.Future[Any]) -> int:
        with self._lock:
            key = self._next
            self._next += 1
            self._pending[key] = (time.monotonic(), g)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="spotctl-ft-watch")
                self._thread.start()
        return key

    @contextmanager
    def watching(self) -> Iterator[None]:
        """For a wait that only `on_gone` can end (NCCL: its abort ends the collective):
        the watch looks while the block runs."""
        key = self._add(torch.futures.Future())
        try:
            yield
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def track(self, done: Callable[[], bool]) -> None:
        """NCCL's case: a collective's wait only orders the stream, and the host blocks
        later, anywhere (backward's launch queue full, an .item(), the commit). The
        collective counts as waited for until `done()` (an event recorded after it on the
        stream: Event.query) says so; the watch prunes it then."""
        key = self._add(torch.futures.Future())
        with self._lock:
            self._done[key] = done

    def _prune(self) -> None:
        with self._lock:
            checks = list(self._done.items())
        over = [k for k, done in checks if done()]
        with self._lock:
            for k in over:
                self._done.pop(k, None)
                self._pending.pop(k, None)

    def guard(self, fut: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        g: torch.futures.Future[Any] = torch.futures.Future()
        key = self._add(g)

        def done(f: torch.futures.Future[Any]) -> None:
            with self._lock:
                mine = self._pending.pop(key, None) is not None
            if not mine:
                return  # failed by the watch already
            try:
                g.set_result(f.value())
            except Exception as e:  # noqa: BLE001 - the collective's own error, passed on
                g.set_exception(e)

        fut.add_done_callback(done)
        return g

    def _oldest(self) -> float | None:
        with self._lock:
            return min((t for t, _ in self._pending.values()), default=None)

    def close(self) -> None:
        """Stops the watch's thread and waits for it (end of training: nothing is left to
        call into torch from a thread of its own while the interpreter shuts down)."""
        self._closed.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        if self.device is not None and getattr(self.device, "type", "") == "cuda":
            torch.cuda.set_device(self.device)  # (a new thread's device is GPU 0)
        while not self._closed.wait(self.poll_s):
            self._prune()
            t0 = self._oldest()
            if t0 is None or time.monotonic() - t0 < self.after_s:
                continue
            try:
                page = status_page(self.lighthouse)
            except OSError:
                continue  # the Lighthouse unreachable says nothing about a peer
            gone = vanished(list(self.members()), self.own, heartbeats(page), self.stale_s)
            if gone is None:
                continue
            with self._lock:
                waiting = [g for _, g in self._pending.values()]
                self._pending.clear()
                self._done.clear()
            if not waiting:
                continue
            err = RuntimeError(f"replica {gone} stopped heartbeating to the Lighthouse "
                               f"(not seen for over {self.stale_s:g} s) during a collective")
            self.found.append(gone)
            log.warning("%s: this step is given up", err)
            try:
                self.on_gone(err)
            except Exception:  # noqa: BLE001 - the futures below must still fail
                log.exception("giving up the step")
            for g in waiting:
                g.set_exception(err)
