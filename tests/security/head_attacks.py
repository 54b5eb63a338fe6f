"""Attacks on a real head process (loopback only, bounded in connections and time), and a
small benchmark that prints what each gets:

    .venv/bin/python -m tests.security.head_attacks            # this tree's head
    .venv/bin/python -m tests.security.head_attacks --tree DIR # another checkout's head
    .venv/bin/python -m tests.security.head_attacks --save     # and record the figures in
                                                    # docs/figures/bench-results.json

Each attack runs while a real controller client (HeadClient, the cluster secret) asks for
`status` every half second; the figures are the head's RSS, how long the attacker's
connections stay open, and the latency of those `status` calls (failures counted)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotctl.head.auth import node_token
from spotctl.head.client import HeadClient, HeadUnavailable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import figures  # noqa: E402


@dataclass
class Head:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    token: str

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def client(self, timeout_s: float = 10.0) -> HeadClient:
        return HeadClient(self.url, self.token, timeout_s=timeout_s)


@contextmanager
def real_head(tmp: Path, tree: Path | None = None) -> Iterator[Head]:
    """`spotctl head` as a process of its own (with its TCPStore), as clusters run it."""
    token = secrets.token_urlsafe(32)
    (tmp / "token").write_text(token)
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotctl.cli.app", "head", "--dir", str(tmp / "head"),
         "--token-file", str(tmp / "token"), "--host", "127.0.0.1"],
        cwd=str(tree or REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        info = tmp / "head" / "head.json"
        deadline = time.monotonic() + 60
        while True:
            if info.exists():
                got = json.loads(info.read_text())
                if got.get("pid") == proc.pid:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the head did not start (exit {proc.poll()})")
            time.sleep(0.1)
        head = Head(proc, got["url"], int(got["url"].rsplit(":", 1)[1]), token)
        head.client().health()
        yield head
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass
class Probe:
    """A real controller asking for `status` every `every` seconds, timed (or, with
    `node`, that node's agent sending its heartbeat with its own token)."""

    head: Head
    every: float = 0.5
    node: str = ""
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        if self.node:
            client = HeadClient(self.head.url, node_token(self.head.token, self.node), 10.0)
            body = {"node_id": self.node, "agent_state": "waiting", "workers": []}
        else:
            client = self.head.client(timeout_s=10.0)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                client.heartbeat(body) if self.node else client.status()
                self.latencies.append(time.monotonic() - t0)
            except HeadUnavailable as e:
                self.failures.append(str(e)[:120])
            self._stop.wait(self.every)

    @contextmanager
    def running(self) -> Iterator[Probe]:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join(15)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        what = "heartbeat" if self.node else "status"
        return {f"{what}_ok": len(lat), f"{what}_failed": len(self.failures),
                f"{what}_median_s": round(lat[len(lat) // 2], 3) if lat else None,
                f"{what}_max_s": round(lat[-1], 3) if lat else None}


@dataclass
class Slowloris:
    """`n` connections, each sending one byte of a never-ending request every `every`
    seconds; a connection the head closes is replaced at once (as the tool does)."""

    port: int
    n: int
    every: float = 2.0
    opened: dict[socket.socket, float] = field(default_factory=dict)
    lifetimes: list[float] = field(default_factory=list)  # of connections the head closed
    connects: int = 0

    def _open(self) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            s.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            self.opened[s] = time.monotonic()
            self.connects += 1
        except OSError:
            pass

    def _closed(self, s: socket.socket) -> None:
        self.lifetimes.append(time.monotonic() - self.opened.pop(s))
        s.close()

    def run(self, duration_s: float, tick: Callable[[], None] | None = None) -> None:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            while len(self.opened) < self.n and time.monotonic() < end:
                self._open()
            for s in list(self.opened):
                if self._still_open(s):
                    try:
                        s.send(b"X")
                    except OSError:
                        self._closed(s)
            if tick:
                tick()
            time.sleep(self.every)

    def held(self) -> int:
        """How many of the attacker's connections the head still holds open."""
        return sum(self._still_open(s) for s in list(self.opened))

    def _still_open(self, s: socket.socket) -> bool:
        """False (and counted closed) once the head has closed `s`."""
        try:
            readable, _, _ = select.select([s], [], [], 0)
            if not (readable and s.recv(4096) == b""):
                return True
        except OSError:
            pass
        self._closed(s)
        return False

    def oldest_s(self) -> float:
        now = time.monotonic()
        return max((now - t for t in self.opened.values()), default=0.0)

    def close(self) -> None:
        for s in self.opened:
            s.close()
        self.opened.clear()


def header_flood(port: int, n: int, lines: int, line_bytes: int) -> list[socket.socket]:
    """`n` connections, each sending a request line and `lines` headers of `line_bytes`
    without the blank line that ends them, then holding: what the head keeps meanwhile."""
    socks = []
    header = b"X-Pad: " + b"a" * (line_bytes - 9) + b"\r\n"
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            continue
        socks.append(s)
        try:
            s.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n" + header * lines)
        except OSError:
            pass  # the head stopped reading and closed: what it should do
    return socks


def run_slowloris(head: Head, n: int = 300, duration_s: float = 16.0) -> dict[str, Any]:
    rss0 = head.rss_mb()
    peak = [rss0]
    loris = Slowloris(head.port, n)
    with Probe(head).running() as probe, Probe(head, node="n1").running() as agent:
        loris.run(duration_s, tick=lambda: peak.append(head.rss_mb()))
        held = loris.held()
    out = {"attack": f"slowloris {n} conns, 1 B/{loris.every:g} s, {duration_s:g} s",
           "connections_held_at_end": held, "attacker_connects": loris.connects,
           "oldest_open_s": round(loris.oldest_s(), 1),
           "longest_closed_s": round(max(loris.lifetimes, default=0.0), 1),
           "rss_before_mb": round(rss0), "rss_peak_mb": round(max(peak)), **probe.summary(),
           **agent.summary()}
    loris.close()
    return out


def run_header_flood(head: Head, n: int = 250, lines: int = 60,
                     line_bytes: int = 16384, hold_s: float = 3.0) -> dict[str, Any]:
    rss0 = head.rss_mb()
    with Probe(head).running() as probe:
        socks = header_flood(head.port, n, lines, line_bytes)
        peak = rss0
        end = time.monotonic() + hold_s
        while time.monotonic() < end:
            peak = max(peak, head.rss_mb())
            time.sleep(0.2)
    open_ = 0
    for s in socks:
        try:
            s.setblocking(False)
            s.recv(65536)  # an answer (431) or EOF: the head let it go
        except BlockingIOError:
            open_ += 1  # nothing said, still open: held by the head
        except OSError:
            pass
        s.close()
    return {"attack": f"header flood {n} conns x {lines} headers x {line_bytes // 1024} KiB",
            "connections_held_at_end": open_, "rss_before_mb": round(rss0),
            "rss_peak_mb": round(peak), **probe.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=None,
                    help="run the head from this checkout (e.g. an older commit's export)")
    ap.add_argument("--slowloris", type=int, default=300, help="connections (default 300)")
    ap.add_argument("--flood", type=int, default=250, help="connections (default 250)")
    ap.add_argument("--save", action="store_true",
                    help="record the figures in docs/figures/bench-results.json (the docs' "
                    "'now' column; then scripts/docs-figures --write)")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="with --save: run the same attacks on DIR's head (a checkout without "
                    "admission control) and record them as the 'before' column; without it "
                    "the recorded 'before' figures are kept")
    args = ap.parse_args(argv)
    if args.before is not None and not args.save:
        ap.error("--before only goes with --save")
    t0 = time.monotonic()
    started = figures.machine() if args.save else {}
    rows = attack(args.tree, args.slowloris, args.flood)
    for r in rows:
        print(json.dumps(r))
    if not args.save:
        return 0
    before = attack(args.before, args.slowloris, args.flood) if args.before else None
    command = ".venv/bin/python -m tests.security.head_attacks " + " ".join(argv or sys.argv[1:])
    run = save_rows(rows, before, command.strip(), started, time.monotonic() - t0)
    print(f"saved to {figures.RESULTS.relative_to(REPO)} as run {run!r}; "
          "then scripts/docs-figures --write", file=sys.stderr)
    return 0


def attack(tree: Path | None, slowloris: int, flood: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as d, real_head(Path(d), tree) as head:
        rows.append(run_slowloris(head, slowloris))
    with tempfile.TemporaryDirectory() as d, real_head(Path(d), tree) as head:
        rows.append(run_header_flood(head, flood))
    return rows


def save_rows(now: list[dict[str, Any]], before: list[dict[str, Any]] | None, command: str,
              started: dict[str, Any], elapsed_s: float,
              path: Path | None = None) -> str:
    """Record one run's attacks as results rows (benchmark 'head-attacks', metric the
    attack): its figures are the 'now' column; `before` (the same attacks on a head
    without admission control) the 'before' column, or, when None, the row's recorded
    'before' figures and their run are kept. Returns the run's id."""
    path = path or figures.RESULTS
    old = {r["metric"]: r for r in figures.read_results(path)["rows"]
           if r["benchmark"] == "head-attacks"}
    rows = []
    for i, got in enumerate(now):
        metric = got["attack"]
        row: dict[str, Any] = {"benchmark": "head-attacks", "metric": metric,
                               "spotctl": {k: v for k, v in got.items() if k != "attack"},
                               "unit": "", "note": ""}
        if before is not None:
            row["baseline"] = {k: v for k, v in before[i].items() if k != "attack"}
        elif metric in old and old[metric].get("baseline") is not None:
            row["baseline"] = old[metric]["baseline"]
            row["baseline_run"] = old[metric].get("baseline_run", old[metric]["run"])
        rows.append(row)
    return figures.save(rows, command, started=started, elapsed_s=elapsed_s, path=path)


if __name__ == "__main__":
    raise SystemExit(main())
