"""Scale: the control plane with up to 64 nodes (issue 58).

The real head (`spotctl head`, a child process with its Lighthouse behind the filter, as a
torchft cluster's head runs) and N simulated nodes. Each node does what a node agent and
its one replica do on the wire, at their real rates, with no training:
- its agent heartbeats the head API every 0.25 s with its own node credential (a fresh
  HTTP connection each time, as spotctl.head.client does), reporting one worker in phase
  `train` whose step advances. The agents run in a process of their own (`AgentsProc`),
  as they run on other machines: in the process that times the quorums, their 256
  heartbeats a second at 64 nodes held its interpreter lock and added their own wait to
  the head's quorum latency (measured at 64 replicas, load 6-9: the bare Lighthouse
  with the same agents beside its clients, 25.0 / 29.9 ms p50, against 22.2 / 20.5 ms
  without them);
- its replica's Manager heartbeats the Lighthouse every 50 ms and asks it for a quorum
  before each step (torchft's LighthouseClient, the Rust client the Managers use), with a
  50 ms step in between; these run in the benchmark's process, for the head and for the
  bare Lighthouse alike.
For N = 8, 16, 32, 64 in turn on the same head (nodes added, as a cluster grows):
- quorum latency: per step, from the moment the last replica asked until the last one had
  its answer (the Lighthouse's own cost, not waiting for stragglers), p50 and p95;
- `status`: the controller's GET /api/status (what `spotctl status` renders), 20 calls;
- the head's CPU (user+system seconds per second, from /proc) and resident memory, and the
  CPU of the process that runs the Lighthouse (the head's child; the bare one's own) per
  Lighthouse request answered (less moved by other work on the machine than latency).
At 64: a notice on one node and a replacement node registering, each timed until the
head's status shows it; then the head's memory sampled for `hold_s` seconds of heartbeats
(its slope in MiB per hour says whether it is flat).
The baseline column holds nothing: this measures spotctl's own control plane, and the
issue's goals (quorum p50 <= 10 ms at 64 replicas, status <= 1 s) are in the notes.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from .core import REPO, Context, Row, row

os.environ.setdefault("RUST_LOG", "warn")  # torchft logs each client it creates
SIZES = (8, 16, 32, 64)
AGENT_TICK_S = 0.25
MANAGER_BEAT_S = 0.05
STEP_S = 0.05



_said = [0]


def call_failed(what: str, e: Exception) -> None:
    """A simulated node's call that failed, on stderr (the first 20 of a run): the row
    counts them, this says which and why."""
    _said[0] += 1
    if _said[0] <= 20:
        print(f"[scale] {what} failed at {time.time():.3f}: {type(e).__name__}: "
              f"{str(e)[:200]}", file=sys.stderr, flush=True)

def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the head's Lighthouse runs in a child of its own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except OSError:
                pass
    return out


def _cpu_s(pid: int) -> float:
    """User and system seconds of `pid` and its descendants."""
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants."""
    total = 0.0
    for p in _tree(pid):
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class HeadProc:
    """`spotctl head --lighthouse-port 0` on loopback, as a torchft cluster runs it."""

    def __init__(self, work: Path):
        self.dir = work / "head"
        self.dir.mkdir(mode=0o700, parents=True)
        self.secret = secrets.token_urlsafe(32)
        tok = work / "token"
        fd = os.open(tok, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, self.secret.encode())
        os.close(fd)
        self.log = open(work / "head.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spotctl.cli.app", "head", "--dir", str(self.dir),
             "--token-file", str(tok), "--host", "127.0.0.1", "--lighthouse-port", "0"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(REPO), env=dict(os.environ, RUST_LOG="warn"))
        deadline = time.monotonic() + 90
        info = self.dir / "head.json"
        while not info.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the head did not start: {(work / 'head.log').read_text()[-800:]}")
            time.sleep(0.1)
        time.sleep(0.2)
        d = json.loads(info.read_text())
        self.url, self.lighthouse = d["url"], d["lighthouse"]
        self.pid = self.proc.pid

    def lighthouse_pid(self) -> int:
        """The head's child that runs the Lighthouse and its filter (the head's pid if none)."""
        for p in _tree(self.pid):
            try:
                if b"spotctl.head.lighthouse" in Path(f"/proc/{p}/cmdline").read_bytes():
                    return p
            except OSError:
                pass
        return self.pid

    def status(self) -> dict[str, Any]:
        req = urllib.request.Request(self.url + "/api/status",
                                     headers={"Authorization": f"Bearer {self.secret}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return dict(json.load(r))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Agent:
    """One simulated node's agent: heartbeats to the head API (run by AgentsProc's child)."""

    def __init__(self, url: str, secret: str, nid: str, stop: threading.Event):
        from spotctl.head.auth import node_token
        from spotctl.head.client import HeadClient

        self.nid, self.stop = nid, stop
        self.client = HeadClient(url, node_token(secret, nid), timeout_s=10.0)
        self.started = time.monotonic()
        self.replicas = 0  # the agents' count, which the quorums reach once grown
        self.notice: dict[str, Any] | None = None
        self.errors = 0
        self.beats = 0  # heartbeats the head answered
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"{nid}-agent")
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            step = int((t0 - self.started) / (STEP_S + 0.01))  # about the replicas' pace
            body = {"node_id": self.nid, "agent_state": "running", "addr": "127.0.0.1",
                    "drain_gen": 0, "notice": self.notice, "ready": True,
                    "workers": [{"rank": 0, "local_rank": 0, "world_size": 1,
                                 "step": step, "phase": "train", "incarnation": self.nid,
                                 "resume_step": 0, "first_step_at": None, "last_ckpt": 0,
                                 "pid": os.getpid(), "engine": "torchft",
                                 "replicas": self.replicas, "failed_steps": 0}]}
            try:
                self.client.heartbeat(body)
                self.beats += 1
            except Exception as e:  # noqa: BLE001 - counted, and said
                self.errors += 1
                call_failed(f"{self.nid} heartbeat to the head", e)
            self.stop.wait(max(0.0, AGENT_TICK_S - (time.monotonic() - t0)))


def agents_main() -> None:
    """AgentsProc's child: reads commands on stdin (`add NID`, `notice NID JSON`, `count`),
    answers each on stdout."""
    url, secret = os.environ["BENCH_HEAD_URL"], os.environ["BENCH_HEAD_SECRET"]
    stop = threading.Event()
    agents: dict[str, Agent] = {}
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "add":
            agents[rest] = Agent(url, secret, rest, stop)
            for a in agents.values():
                a.replicas = len(agents)
            print("ok", flush=True)
        elif cmd == "notice":
            nid, _, body = rest.partition(" ")
            a = agents[nid]
            a.notice = json.loads(body)
            try:
                a.client.notice(nid, a.notice)
                print("ok", flush=True)
            except Exception as e:
                print(f"error {e}", flush=True)
        elif cmd == "count":
            print(sum(a.beats for a in agents.values()),
                  sum(a.errors for a in agents.values()), flush=True)
    stop.set()


class AgentsProc:
    """The simulated agents, in a process of their own (see the module's docstring)."""

    def __init__(self, head: HeadProc):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from bench_lib.scale import agents_main; agents_main()")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(REPO / "scripts")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=str(REPO),
            env=dict(os.environ, BENCH_HEAD_URL=head.url, BENCH_HEAD_SECRET=head.secret))

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer or answer.startswith("error"):
            raise RuntimeError(f"simulated agents: {line.split()[0]}: {answer or 'exited'}")
        return answer

    def add(self, nid: str) -> None:
        self._ask(f"add {nid}")

    def notice(self, nid: str, notice: dict[str, Any]) -> None:
        self._ask(f"notice {nid} {json.dumps(notice)}")

    def count(self) -> tuple[int, int]:
        beats, errors = self._ask("count").split()
        return int(beats), int(errors)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Node:
    """One simulated node's replica: its Manager's Lighthouse heartbeats and quorum loop
    (in this process); its agent, where there is a head, in `agents`."""

    def __init__(self, lighthouse: str, agents: AgentsProc | None, nid: str,
                 stop: threading.Event):
        self.nid, self.lighthouse, self.stop = nid, lighthouse, stop
        self.step = 0
        self.errors = 0
        self.quorums: list[tuple[int, float, float]] = []  # (step, asked, answered)
        self.beats = 0  # Lighthouse heartbeats answered
        self.replicas = 0
        if agents is not None:
            agents.add(nid)
        self.threads = [threading.Thread(target=f, daemon=True, name=f"{nid}-{f.__name__}")
                        for f in (self._manager_beat, self._replica)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _manager_beat(self) -> None:
        from torchft.coordination import LighthouseClient

        c = LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=10))
        while not self.stop.is_set():
            try:
                c.heartbeat(self.nid)
                self.beats += 1
            except Exception as e:  # noqa: BLE001 - counted, and said
                self.errors += 1
                call_failed(f"{self.nid} Manager heartbeat", e)
            self.stop.wait(MANAGER_BEAT_S)

    def _replica(self) -> None:
        from torchft.coordination import LighthouseClient

        c = LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=10))
        time.sleep(2 * MANAGER_BEAT_S)  # counted as alive before it first asks
        while not self.stop.is_set():
            asked = time.monotonic()
            try:
                q = c.quorum(replica_id=self.nid, timeout=timedelta(seconds=60),
                             address=f"tcp://127.0.0.1/{self.nid}", store_address="127.0.0.1:1",
                             step=self.step, world_size=1)
            except Exception as e:  # noqa: BLE001 - counted, and said
                self.errors += 1
                call_failed(f"{self.nid} quorum", e)
                self.stop.wait(0.2)
                continue
            answered = time.monotonic()
            self.replicas = len(q.participants)
            self.quorums.append((self.replicas, asked, answered))
            self.step += 1
            self.stop.wait(STEP_S)


def quorum_latencies(nodes: list[Node], size: int, since: float) -> list[float]:
    """Per step at `size` replicas: the last answer minus the last request (the Lighthouse's
    own cost once every replica has asked). Steps are matched by their order in each
    replica's own log (replicas move in lockstep: each step waits for its quorum)."""
    per = [[(a, b) for n_, a, b in n.quorums if n_ == size and a >= since] for n in nodes]
    k = min((len(p) for p in per), default=0)
    out = []
    for i in range(1, k):  # the first at a new size is the join's regrouping
        asked = max(p[i][0] for p in per)
        answered = max(p[i][1] for p in per)
        if answered >= asked:
            out.append(answered - asked)
    return out


class BareLighthouse:
    """torchft's LighthouseServer alone, in a process of its own, with the timing the head
    gives it (spotctl.head.lighthouse.LighthouseTiming) and no filter: the baseline."""

    def __init__(self, work: Path):
        code = ("import os, sys, time\n"
                "from torchft.coordination import LighthouseServer\n"
                "from spotctl.head.lighthouse import LighthouseTiming\n"
                "t = LighthouseTiming()\n"
                "s = LighthouseServer(bind='127.0.0.1:0', min_replicas=t.min_replicas, "
                "join_timeout_ms=t.join_timeout_ms, quorum_tick_ms=t.quorum_tick_ms, "
                "heartbeat_timeout_ms=t.heartbeat_timeout_ms)\n"
                "print(str(s.address()).rsplit(':', 1)[1].strip('/'), flush=True)\n"
                "sys.stdin.read()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                                     env=dict(os.environ, RUST_LOG="warn"))
        assert self.proc.stdout is not None
        self.address = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}"
        self.pid = self.proc.pid

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(10)


def _grow(nodes: list[Node], size: int, lighthouse: str, agents: AgentsProc | None,
          stop: threading.Event) -> None:
    while len(nodes) < size:
        n = Node(lighthouse, agents, f"s{len(nodes):03d}", stop)
        n.start()
        nodes.append(n)
    deadline = time.monotonic() + 120
    while not all(n.replicas == size for n in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no quorum of {size} replicas in 120 s")
        time.sleep(0.2)


def _answered(nodes: list[Node]) -> int:
    return sum(n.beats + len(n.quorums) for n in nodes)


def _window(nodes: list[Node], size: int, pid: int, window_s: float,
            lighthouse_pid: int | None = None) -> tuple[list[float], float, float]:
    """Quorum latencies over `window_s` at `size` replicas, the CPU (cores) `pid` used, and
    the CPU seconds of `lighthouse_pid` (`pid` when None) per Lighthouse request answered
    (heartbeats and quorums): what the filter costs a request, whatever the load lets
    through in the window."""
    lh = lighthouse_pid or pid
    t0, c0, l0, r0 = time.monotonic(), _cpu_s(pid), _cpu_s(lh), _answered(nodes)
    time.sleep(window_s)
    cpu = (_cpu_s(pid) - c0) / (time.monotonic() - t0)
    per_request = (_cpu_s(lh) - l0) / max(1, _answered(nodes) - r0)
    return quorum_latencies(nodes, size, t0), cpu, per_request


def bench(ctx: Context, sizes: tuple[int, ...] = SIZES, window_s: float = 15.0,
          hold_s: float = 60.0) -> list[Row]:
    rows: list[Row] = []
    base: dict[int, tuple[list[float], float, float]] = {}
    bare = BareLighthouse(ctx.subdir("scale-bare"))
    stop = threading.Event()
    nodes: list[Node] = []
    try:
        for size in sizes:
            ctx.log(f"scale: bare Lighthouse, {size} replicas")
            _grow(nodes, size, bare.address, None, stop)
            base[size] = _window(nodes, size, bare.pid, window_s)
    finally:
        stop.set()
        bare.stop()
    for n in nodes:
        for t in n.threads:
            t.join(5)
    head = HeadProc(ctx.subdir("scale"))
    agents = AgentsProc(head)
    stop = threading.Event()
    nodes = []
    try:
        for size in sizes:
            ctx.log(f"scale: the head, {size} nodes")
            _grow(nodes, size, head.lighthouse, agents, stop)
            lat, cpu, per_req = _window(nodes, size, head.pid, window_s, head.lighthouse_pid())
            status_s = []
            for _ in range(20):
                s0 = time.monotonic()
                st = head.status()
                status_s.append(time.monotonic() - s0)
            listed = sum(1 for v in st["nodes"].values() if v["state"] == "running")
            blat, bcpu, bper_req = base[size]
            ctx.log(f"scale: {size} nodes: quorum p50 {1000 * statistics.median(lat):.1f} ms "
                    f"(bare {1000 * statistics.median(blat):.1f} ms), status "
                    f"{1000 * statistics.median(status_s):.1f} ms, head cpu {cpu:.2f} "
                    f"(bare Lighthouse {bcpu:.2f}), Lighthouse process {1e6 * per_req:.0f} us CPU "
                    f"per request (bare {1e6 * bper_req:.0f} us), rss {_rss_mib(head.pid):.0f} MiB")
            note = (f"{len(lat)} and {len(blat)} steps; p95 {1000 * _pct(lat, 0.95):.1f} vs "
                    f"{1000 * _pct(blat, 0.95):.1f} ms; load {os.getloadavg()[0]:.1f}")
            rows.append(row("scale", f"quorum latency, {size} replicas",
                            [1000 * x for x in lat], [1000 * x for x in blat], "ms",
                            note + ("; goal p50 <= 10 ms" if size == 64 else "")))
            rows.append(row("scale", f"GET /api/status, {size} nodes",
                            [1000 * x for x in status_s], [], "ms",
                            f"{listed} nodes listed running"
                            + ("; goal <= 1000 ms" if size == 64 else "")))
            rows.append(row("scale", f"head CPU, {size} nodes", [cpu], [bcpu], "cores",
                            f"over {window_s:.0f} s: the head (API, filter, Lighthouse) vs the "
                            "bare Lighthouse's process; per Lighthouse request answered, the "
                            f"head's Lighthouse process {1e6 * per_req:.0f} us CPU vs bare "
                            f"{1e6 * bper_req:.0f} us"))
            rows.append(row("scale", f"head memory, {size} nodes", [_rss_mib(head.pid)], [],
                            "MiB", "resident"))
        # a notice and a replacement at the largest size, timed until the head shows them
        victim = nodes[0]
        t0 = time.monotonic()
        agents.notice(victim.nid, {"id": "bench-notice", "source": "bench", "kind": "preempt",
                                   "deadline": time.time() + 120, "received_at": time.time()})
        while head.status()["nodes"][victim.nid].get("notice") is None:
            time.sleep(0.01)
        notice_s = time.monotonic() - t0
        t0 = time.monotonic()
        new = Node(head.lighthouse, agents, f"s{len(nodes):03d}", stop)
        new.start()
        nodes.append(new)
        while new.nid not in head.status()["nodes"]:
            time.sleep(0.01)
        join_s = time.monotonic() - t0
        rows.append(row("scale", f"notice shown in status, {len(nodes) - 1} nodes",
                        [1000 * notice_s], [], "ms",
                        "POST /api/notice until GET /api/status has it"))
        rows.append(row("scale", f"replacement shown in status, {len(nodes) - 1} nodes",
                        [1000 * join_s], [], "ms", "its agent's first heartbeat until listed"))
        # memory over a longer hold: the slope says whether it is flat
        ctx.log(f"scale: holding {len(nodes)} nodes for {hold_s:.0f} s (memory)")
        samples: list[tuple[float, float]] = []
        beats0, held0 = agents.count()[0], time.monotonic()
        t_end = time.monotonic() + hold_s
        while time.monotonic() < t_end:
            samples.append((time.monotonic(), _rss_mib(head.pid)))
            time.sleep(max(1.0, hold_s / 30))
        slope = 0.0
        if len(samples) >= 3:
            xs = [t for t, _ in samples]
            ys = [m for _, m in samples]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            den = sum((x - mx) ** 2 for x in xs) or 1.0
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600
        rate = (agents.count()[0] - beats0) / max(1e-9, time.monotonic() - held0)
        rows.append(row("scale", f"head memory growth, {len(nodes)} nodes", [slope], [],
                        "MiB/h", f"least squares over {hold_s:.0f} s ({len(samples)} samples, "
                        f"{samples[0][1]:.0f} -> {samples[-1][1]:.0f} MiB, {rate:.0f} heartbeats/s "
                        f"answered, {len(nodes) / AGENT_TICK_S:.0f}/s due); goal: flat"))
        errors = sum(n.errors for n in nodes) + agents.count()[1]
        rows.append(row("scale", "client calls that failed", [errors], [], "calls",
                        "heartbeats, quorums and notices of every simulated node"))
    finally:
        stop.set()
        agents.stop()
        head.stop()
    return rows
