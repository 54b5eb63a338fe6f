"""Overhead: what spotctl costs every step when nothing fails (issues 29, 58).

One steady-state script written as users write it (train_steady.py: an MLP of 6 layers of
width 2048 with GELU, cross-entropy, AdamW, no clipping, global batch 256, batches made
per step, the loss passed to end_step), on the same number of ranks, three ways:
- plain: plain DDP as `torchrun --standalone --nproc-per-node=N train.py` runs it, in the
  environment this command was started with (torchrun's own OMP_NUM_THREADS=1 for N > 1,
  no pinning, the script's own data);
- plain-keep: the same plain DDP with glibc's malloc set as spotctl.elastic.init() sets
  it in its workers (keep_freed_memory: MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_
  at the same values), so that an engine's cost is read apart from that setting;
- torchft / torchrun: the same loop through spotctl.elastic.Run on a local cluster of one
  node per rank (`spotctl up`, `[train] engine = ...`).
A round runs the four in turn (plain, plain-keep, torchft, torchrun); rounds repeat, so a
slow spell of a shared machine falls on all four. Per run, from the first rank's own step log after
the warm-up: the median step gap (wall) and the median CPU time of that worker per step
(every thread of the process; less moved by other load than the wall time), with the
machine's load average and CPU busy share (/proc/stat) over the same seconds. Per round,
each engine's ratio plain / engine; over the rounds, median and min..max.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from spotctl.agent import proctree

from .core import LIB, Context, Row, row
from .spotctl_session import NO_HEAD_LOOP, Cluster

WARMUP = 10
SCRIPT = LIB / "train_steady.py"
ENGINES = ("torchft", "torchrun")
# glibc's environment settings for what spotctl.elastic.keep_freed_memory() sets by mallopt
KEEP = "plain-keep"
KEEP_STEP = "plain DDP with spotctl's malloc settings: step time"
KEEP_CPU = "plain DDP with spotctl's malloc settings: worker CPU per step"
GOAL = 0.98  # issue 58: each engine at least this fraction of plain DDP's speed


def points(log: Path, warmup: int = WARMUP) -> list[tuple[int, float, float | None, str]]:
    """(step, unix time, process CPU s or None, pid or "") of a "unix_time step world
    samples [cpu_s user_s sys_s pid]" log, the first `warmup` steps left out."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            t, step = float(parts[0]), int(parts[1])
            cpu = float(parts[4]) if len(parts) >= 5 else None
        except ValueError:
            continue
        if step > warmup:
            out.append((step, t, cpu, parts[7] if len(parts) >= 8 else ""))
    return out


def gaps(log: Path, warmup: int = WARMUP) -> list[float]:
    """Step-to-step gaps of a step log, leaving out the first `warmup` steps."""
    pts = points(log, warmup)
    return [b[1] - a[1] for a, b in zip(pts, pts[1:], strict=False) if b[0] == a[0] + 1]


def cpu_gaps(log: Path, warmup: int = WARMUP) -> list[float]:
    """CPU seconds of the logging worker per step: consecutive steps written by the same
    process only (on torchft the first rank can move to another replica)."""
    pts = points(log, warmup)
    return [b[2] - a[2] for a, b in zip(pts, pts[1:], strict=False)
            if b[0] == a[0] + 1 and a[2] is not None and b[2] is not None and a[3] == b[3]]


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (0, 0 elsewhere)."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    v = [float(x) for x in f]
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
    return sum(v) - idle, sum(v)


def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) of a live process, or None."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def role(cmdline: str) -> str:
    """What a process of a run is, from its command line. A process the node's zygote
    forked carries the zygote's: the workers are told apart by their pids (see _result),
    and the engines' torchrun agents, forked too, count under "zygote+torchrun"."""
    for needle, name in (("spotctl.head.lighthouse", "lighthouse"),
                         ("cli.app head", "head"), ("spotctl.agent.launch", "launcher"),
                         ("spotctl.agent.zygote", "zygote+torchrun"),
                         ("torch.distributed.run", "torchrun agent"),
                         ("/torchrun", "torchrun agent"), ("cli.app agent", "spotctl agent"),
                         ("spotctl.providers.local.vm", "local VM (metadata)")):
        if needle in cmdline:
            return name
    return "other"


class LoadProbe:
    """Samples the load average, the machine's CPU counters and the CPU time of the run's
    own processes (`pids()`, looked up again every 5 s) every second while a run goes
    on, so that the load of exactly the measured seconds can be read afterwards."""

    def __init__(self, pids: Callable[[], Iterable[int]] = tuple) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float, float, float]] = []  # t, load1, busy, total
        self.procs: dict[int, list[tuple[float, float]]] = {}  # pid -> (t, cpu s)
        self.cmd: dict[int, str] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> LoadProbe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def _loop(self) -> None:
        known: list[int] = []
        last_lookup = 0.0
        while True:
            now = time.time()
            if now - last_lookup >= 5.0:
                last_lookup = now
                try:
                    known = sorted(set(self.pids()))
                except OSError:
                    pass
                for pid in known:
                    if pid not in self.cmd:
                        try:
                            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                        except OSError:
                            continue
                        self.cmd[pid] = raw.replace(b"\0", b" ").decode(errors="replace")
            for pid in known:
                c = _proc_cpu(pid)
                if c is not None:
                    self.procs.setdefault(pid, []).append((now, c))
            busy, total = _cpu_times()
            self.samples.append((now, os.getloadavg()[0], busy, total))
            if self._stop.wait(1.0):
                return

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """(mean 1-minute load average, CPU busy share 0..1) over [t0, t1]."""
        s = [x for x in self.samples if t0 - 1.0 <= x[0] <= t1 + 1.0]
        if len(s) < 2:
            return (s[0][1] if s else os.getloadavg()[0]), float("nan")
        load = statistics.mean(x[1] for x in s)
        dt = s[-1][3] - s[0][3]
        return load, ((s[-1][2] - s[0][2]) / dt if dt > 0 else float("nan"))

    def cores(self, t0: float, t1: float, workers: set[int]) -> dict[str, float]:
        """Cores each role of the run's processes used over [t0, t1] (CPU seconds per
        second; "worker" for the pids in `workers`)."""
        out: dict[str, float] = {}
        for pid, pts in self.procs.items():
            inside = [p for p in pts if t0 - 1.0 <= p[0] <= t1 + 1.0]
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                continue
            used = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
            name = "worker" if pid in workers else role(self.cmd.get(pid, ""))
            out[name] = out.get(name, 0.0) + used
        return out


@dataclass
class RunResult:
    """One run of one way, read from its first rank's step log."""

    name: str
    step_s: float  # median wall gap between consecutive steps
    cpu_s: float  # median CPU seconds of that worker per step
    steps: int  # gaps measured
    load: float  # 1-minute load average over the measured seconds
    busy: float  # the machine's CPU busy share over them (0..1, all cores)
    workers: list[dict] = field(default_factory=list)  # each rank's threads and affinity
    cores: dict[str, float] = field(default_factory=dict)  # cores used, by process role
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # see train_steady

    def describe(self) -> str:
        th = sorted({(w.get("torch_threads"), w.get("omp_num_threads")) for w in self.workers})
        return (f"{self.name}: step {self.step_s:.3f} s, worker CPU {self.cpu_s:.3f} s/step "
                f"({self.steps} steps; load {self.load:.1f}, CPU busy {self.busy:.0%}; "
                f"threads (torch, OMP_NUM_THREADS) {th})")


def _result(name: str, log: Path, probe: LoadProbe) -> RunResult:
    g, c = gaps(log), cpu_gaps(log)
    if not g:
        raise RuntimeError(f"{name}: no steps after the warm-up in {log}")
    pts = points(log)
    load, busy = probe.between(pts[0][1], pts[-1][1])
    workers = []
    for p in sorted(log.parent.glob(log.name + ".*.json")):
        try:
            workers.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    pids = {int(w["pid"]) for w in workers if "pid" in w}
    return RunResult(name, statistics.median(g), statistics.median(c) if c else float("nan"),
                     len(g), load, busy, workers, probe.cores(pts[0][1], pts[-1][1], pids),
                     parts_of(log))


def parts_of(log: Path, warmup: int = WARMUP) -> dict[str, tuple[float, float]]:
    """Median (wall s, main-thread CPU s) of each part of a step, over every rank's
    parts file after the warm-up (train_steady.Parts)."""
    got: dict[str, list[tuple[float, float]]] = {}
    for p in log.parent.glob(log.name + ".*.parts"):
        for line in p.read_text().splitlines():
            head, *fields = line.split()
            try:
                if int(head) <= warmup:
                    continue
                for f in fields:
                    name, _, v = f.partition("=")
                    wall, _, cpu = v.partition("/")
                    got.setdefault(name, []).append((float(wall), float(cpu)))
            except ValueError:
                continue
    return {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
            for k, v in got.items()}


def _env(log: Path, steps: int, width: int, mode: str) -> dict[str, str]:
    return {"OVERHEAD_MODE": mode, "OVERHEAD_STEPS": str(steps), "OVERHEAD_WIDTH": str(width),
            "BENCH_STEP_LOG": str(log)}


def _torchrun() -> str:
    exe = Path(sys.executable).parent / "torchrun"
    return str(exe) if exe.exists() else shutil.which("torchrun") or "torchrun"


def keep_env() -> dict[str, str]:
    """glibc's malloc, by environment, as spotctl's workers set it by mallopt."""
    from spotctl.elastic import MALLOC_MMAP_BYTES, MALLOC_TRIM_BYTES

    return {"MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_BYTES),
            "MALLOC_TRIM_THRESHOLD_": str(MALLOC_TRIM_BYTES)}


def plain(work: Path, ranks: int, steps: int, width: int, keep: bool = False) -> RunResult:
    """`torchrun --standalone --nproc-per-node=RANKS train.py`, as a user types it (`keep`:
    with spotctl's malloc settings, keep_env())."""
    log = work / "steps.log"
    shutil.copy(SCRIPT, work / "train.py")
    env = dict(os.environ, **_env(log, steps, width, "plain"), **(keep_env() if keep else {}))
    out = open(work / "torchrun.log", "w")
    p = subprocess.Popen([_torchrun(), "--standalone", f"--nproc-per-node={ranks}",
                          "train.py"], env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                         text=True)
    out.close()
    with LoadProbe(lambda: [p.pid, *proctree.descendants(p.pid)]) as probe:
        try:
            rc = p.wait(timeout=1800)
        finally:
            if p.poll() is None:
                p.kill()
    if rc != 0:
        tail = (work / "torchrun.log").read_text()[-800:]
        raise RuntimeError(f"plain DDP exited {rc}: {tail}")
    return _result(KEEP if keep else "plain", log, probe)


def ctx_log(msg: str) -> None:
    print(f"[overhead] {msg}", file=sys.stderr, flush=True)


def on_spotctl(work: Path, ranks: int, steps: int, width: int, engine: str) -> RunResult:
    c = Cluster(work, ranks, first_every=1_000_000)
    shutil.copy(SCRIPT, c.project / "train.py")
    env = _env(c.steps, steps, width, "spotctl")
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    (c.project / "spotctl.toml").write_text(
        f'name = "{c.name}"\nprovider = "local"\ngpus = "{ranks}"\n\n'
        f'[train]\nengine = "{engine}"\nscript = "train.py"\n'
        f"checkpoint_every = 1000000\nenv = {{ {env_toml} }}\n"
        + NO_HEAD_LOOP
    )
    with LoadProbe(lambda: proctree.tagged_prefix(str(c.home) + "/")) as probe:
        try:
            try:
                c.cli("up", "--wait", "180", timeout=300)
            except RuntimeError as e:
                # on a loaded machine the head can take longer than `up` waits for it to
                # start; it goes on starting, and a second `up` finds it
                if "did not start" not in str(e):
                    raise
                ctx_log(f"{engine}: {str(e).splitlines()[-1][:120]}; `up` again")
                c.cli("up", "--wait", "180", timeout=300)
            deadline = time.monotonic() + 1800
            while time.monotonic() < deadline:
                lines = c.steps.read_text().splitlines() if c.steps.exists() else []
                if any(x.split()[1:2] == [str(steps)] for x in lines):
                    break
                time.sleep(1)
            else:
                raise RuntimeError(f"{engine}: training did not reach step {steps}")
        finally:
            c.down()
    return _result(engine, c.steps, probe)


def _spread(values: list[float]) -> str:
    """median (min..max, -a %..+b % of the median)"""
    m = statistics.median(values)
    lo, hi = (min(values) / m - 1) * 100, (max(values) / m - 1) * 100
    return f"{m:.3f} ({min(values):.3f}..{max(values):.3f}, {lo:+.1f} %..{hi:+.1f} %)"


def summary(rounds: list[dict[str, RunResult]]) -> list[str]:
    """The lines printed after the runs: each round, then each engine over the rounds."""
    out = []
    for i, r in enumerate(rounds, 1):
        for name, res in r.items():
            extra = "".join(
                f"; {b}/{name} wall {r[b].step_s / res.step_s:.3f}, "
                f"CPU {r[b].cpu_s / res.cpu_s:.3f}"
                for b in ("plain", KEEP) if b in r and name not in ("plain", b))
            out.append(f"round {i}  {res.describe()}{extra}")
    out += profile(rounds)
    for e in ENGINES:
        for b, what in (("plain", "plain DDP's"),
                        (KEEP, "plain DDP's with spotctl's malloc settings")):
            if b not in rounds[0]:
                continue
            wall = [r[b].step_s / r[e].step_s for r in rounds]
            cpu = [r[b].cpu_s / r[e].cpu_s for r in rounds]
            out.append(f"{e}: speed as a fraction of {what}, wall {_spread(wall)}; "
                       f"worker CPU {_spread(cpu)}; goal >= {GOAL} with the spread within 2 %")
    return out


PARTS = ("next_step", "data", "forward", "backward", "optimizer", "end_step", "rest")


def profile(rounds: list[dict[str, RunResult]]) -> list[str]:
    """Where a step's time goes, each way (medians over the rounds): each part of the
    loop (wall ms / main-thread CPU ms; forward and backward hold DDP's and the engine's
    hooks, optimizer the torchft commit vote, next_step the quorum or the control
    all-reduce), then the cores each kind of process of the run used."""
    names = list(rounds[0])
    head = f"{'per step (ms, wall/CPU)':<26}" + "".join(f"{n:>18}" for n in names)
    out = ["profile, medians over the rounds", head]
    for part in PARTS:
        cells = []
        for n in names:
            vals = [r[n].parts[part] for r in rounds if part in r[n].parts]
            cells.append(f"{statistics.median(v[0] for v in vals) * 1e3:.1f}/"
                         f"{statistics.median(v[1] for v in vals) * 1e3:.1f}" if vals else "-")
        out.append(f"{part:<26}" + "".join(f"{c:>18}" for c in cells))
    roles = sorted({k for r in rounds for res in r.values() for k in res.cores})
    for rl in roles:
        cells = [f"{statistics.median(r[n].cores.get(rl, 0.0) for r in rounds):.3f}"
                 for n in names]
        out.append(f"{'cores: ' + rl:<26}" + "".join(f"{c:>18}" for c in cells))
    return out


def bench(ctx: Context, ranks: int = 2, steps: int | None = None,
          width: int = 2048) -> list[Row]:
    n = steps if steps is not None else 50
    reps = ctx.reps(3)
    rounds: list[dict[str, RunResult]] = []
    for i in range(reps):
        rnd: dict[str, RunResult] = {}
        for name in ("plain", KEEP, *ENGINES):
            d = ctx.subdir(f"overhead-{name}-{i}")
            t0 = time.monotonic()
            rnd[name] = (plain(d, ranks, n, width, keep=name == KEEP)
                         if name in ("plain", KEEP) else on_spotctl(d, ranks, n, width, name))
            ctx.log(f"overhead round {i + 1}: {rnd[name].describe()} "
                    f"({time.monotonic() - t0:.0f} s in all)")
        rounds.append(rnd)
    lines = summary(rounds)
    for line in lines:
        ctx.log(line)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "bench-overhead.txt").write_text("\n".join(lines) + "\n")
    loads = [r[k].load for r in rounds for k in r]
    busy = [r[k].busy for r in rounds for k in r]
    note = (f"{ranks} ranks, MLP 6x{width} GELU, cross-entropy, AdamW, global batch 256, "
            f"batches made per step; median step of each of {reps} rounds (plain, plain "
            f"with spotctl's malloc settings, torchft, torchrun in turn; {n - WARMUP - 1} steps after {WARMUP} warm-up); load "
            f"{min(loads):.1f}-{max(loads):.1f}, CPU busy {min(busy):.0%}-{max(busy):.0%}")
    rows = []
    for e in ENGINES:
        wall = [r["plain"].step_s / r[e].step_s for r in rounds]
        cpu = [r["plain"].cpu_s / r[e].cpu_s for r in rounds]
        rows.append(row("overhead", f"{e}: step time vs plain DDP",
                        [r[e].step_s for r in rounds], [r["plain"].step_s for r in rounds],
                        "s", note))
        rows.append(row("overhead", f"{e}: speed as a fraction of plain DDP's", wall, [], "",
                        f"plain step time / engine step time, per round; goal >= {GOAL}, "
                        "spread within 2 %"))
        rows.append(row("overhead", f"{e}: worker CPU per step vs plain DDP",
                        [r[e].cpu_s for r in rounds], [r["plain"].cpu_s for r in rounds], "s",
                        "CPU seconds of the first rank's worker process per step (all its "
                        "threads); plain / engine per round: "
                        + ", ".join(f"{x:.3f}" for x in cpu)))
        same = [r[KEEP].step_s / r[e].step_s for r in rounds]
        rows.append(row("overhead", f"{e}: speed as a fraction of plain DDP's, same malloc "
                        "settings", same, [], "", "plain-keep step time / engine step time, "
                        f"per round; goal >= {GOAL}, spread within 2 %"))
    rows.append(row("overhead", KEEP_STEP, [r[KEEP].step_s for r in rounds],
                    [r["plain"].step_s for r in rounds], "s",
                    "plain DDP with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ as "
                    "spotctl's workers set them; the baseline: plain DDP as users run it"))
    rows.append(row("overhead", KEEP_CPU, [r[KEEP].cpu_s for r in rounds],
                    [r["plain"].cpu_s for r in rounds], "s",
                    "CPU seconds of the first rank's worker process per step"))
    return rows
