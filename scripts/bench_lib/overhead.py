"""Overhead: what spotctl costs every step when nothing fails (issue 29).

The same compute-bound loop (train_overhead.py: an MLP of 6 layers of width 2048, AdamW,
clipping, global batch 256, the global loss reduced for logging) on the same number of
ranks, three ways, nothing failing:
- baseline: plain DDP under plain torchrun (`--standalone`, one process per rank);
- each engine: the loop through spotctl.elastic on a local cluster of one node per rank
  (`spotctl up`, `[train] engine = "torchrun"` or `"torchft"`).
Figures from the first rank's own step log: the gaps between consecutive steps after the
warm-up steps; the median of each run, and each engine's ratio to the baseline's. The
runs alternate (baseline, torchrun, torchft, baseline, ...) so that a slow spell of the
machine falls on all of them.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .core import LIB, Context, Row, row
from .spotctl_session import NO_HEAD_LOOP, Cluster

WARMUP = 10


def gaps(log: Path, warmup: int = WARMUP) -> list[float]:
    """Step-to-step gaps of a "unix_time step ..." log, leaving out the first `warmup` steps."""
    pts = []
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split()
        if len(parts) >= 2:
            pts.append((float(parts[0]), int(parts[1])))
    pts = [p for p in pts if p[1] > warmup]
    return [b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False) if b[1] == a[1] + 1]


def _env(log: Path, steps: int, width: int, mode: str, ranks: int) -> dict[str, str]:
    # every rank runs on this machine: each gets its share of the cores, the same on all
    # three (a local node's worker would otherwise take them all and oversubscribe)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    return {"OVERHEAD_MODE": mode, "OVERHEAD_STEPS": str(steps), "OVERHEAD_WIDTH": str(width),
            "OVERHEAD_THREADS": str(threads), "BENCH_STEP_LOG": str(log)}


def plain(work: Path, ranks: int, steps: int, width: int) -> list[float]:
    log = work / "steps.log"
    env = dict(os.environ, **_env(log, steps, width, "plain", ranks))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={ranks}", str(LIB / "train_overhead.py")],
                       env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"plain DDP exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return gaps(log)


def on_spotctl(work: Path, ranks: int, steps: int, width: int, engine: str) -> list[float]:
    c = Cluster(work, ranks, first_every=1_000_000)
    (c.project / "train.py").write_text((LIB / "train_overhead.py").read_text())
    env = _env(c.steps, steps, width, "spotctl", ranks)
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    (c.project / "spotctl.toml").write_text(
        f'name = "{c.name}"\nprovider = "local"\ngpus = "{ranks}"\n\n'
        f'[train]\nengine = "{engine}"\nscript = "train.py"\n'
        f"checkpoint_every = 1000000\nenv = {{ {env_toml} }}\n"
        + NO_HEAD_LOOP
    )
    try:
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
    return gaps(c.steps)


def bench(ctx: Context, ranks: int = 2, steps: int | None = None,
          width: int = 2048) -> list[Row]:
    n = steps if steps is not None else 50
    reps = ctx.reps(2)
    runs: dict[str, list[float]] = {"plain": [], "torchrun": [], "torchft": []}
    for i in range(reps):
        for name in runs:
            d = ctx.subdir(f"overhead-{name}-{i}")
            t0 = time.monotonic()
            g = (plain(d, ranks, n, width) if name == "plain"
                 else on_spotctl(d, ranks, n, width, name))
            if not g:
                raise RuntimeError(f"{name}: no steps after the warm-up in its log")
            runs[name].append(statistics.median(g))
            ctx.log(f"overhead {name} run {i + 1}: median step {runs[name][-1]:.3f} s "
                    f"({len(g)} steps, {time.monotonic() - t0:.0f} s in all)")
    note = (f"{ranks} ranks, MLP {6}x{width}, global batch 256, AdamW + clipping, "
            f"median step of each of {reps} runs ({n - WARMUP - 1} steps after {WARMUP} "
            f"warm-up), runs alternating")
    rows = []
    for engine in ("torchrun", "torchft"):
        ratio = [b / e for b, e in zip(runs["plain"], runs[engine], strict=True)]
        rows.append(row("overhead", f"{engine}: step time vs plain DDP", runs[engine],
                        runs["plain"], "s", note))
        rows.append(row("overhead", f"{engine}: speed as a fraction of plain DDP's", ratio,
                        [], "", "plain step time / engine step time, per pair of runs; "
                        "goal ≥ 0.95"))
    return rows
