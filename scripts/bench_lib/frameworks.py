"""Hugging Face Trainer and Lightning jobs (the repo's examples, as tests/e2e/jobs runs
them) under spotctl, one row set per framework:

- steady step time: the job on a 2-node local cluster (world 2, engine torchrun, spotctl's
  callback on) against the same job under plain torchrun (--nproc-per-node 2 on this
  machine, no callback), in interleaved windows: the cluster's job is held (its step
  waits on the pace file, no CPU) while the plain torchrun window runs;
- a notice: the steps redone (the last step the framework logged before the resume minus
  the step it resumed from) and notice -> training again (its first step after the resume
  minus the time `spotctl preempt` was called), with spotctl's callback against the same
  job without it (a launch started while NO_CALLBACK_FILE exists: SIGTERM at the end of
  the grace, back to the last periodic save).

Every figure comes from the job's own step log (rank 0, as the framework emits each step).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos_lib.cluster import Cluster

from .core import REPO, Context, Row, row
from .plain import _cycle, _records, _steps

JOBS = REPO / "tests" / "e2e" / "jobs"
SAVE_EVERY = 20
GRACE_S = "5"
WINDOW = 30  # steps per step-time window (the first 3 of a plain torchrun run not counted)
FRAMEWORKS: dict[str, dict[str, Any]] = {
    "hf": {"label": "HF Trainer", "module": "transformers", "job": "hf_job.py",
           "example": REPO / "examples" / "hf-trainer" / "train.py",
           "args": ["--global-batch", "8", "--per-device-batch", "2"]},
    "lightning": {"label": "Lightning", "module": "lightning", "job": "lightning_job.py",
                  "example": REPO / "examples" / "lightning" / "train.py",
                  "args": ["--global-batch", "32", "--per-device-batch", "8"]},
}


def _step_time(log: Path, n0: int, world: int, skip: int = 0) -> float:
    """Median seconds between consecutive steps at `world` past the first n0 records (one
    launch's run of steps: a resume in between ends it)."""
    ts: list[float] = []
    for r in _records(log)[n0:]:
        if r.get("resumed") is not None:
            if ts:
                break
            continue
        if "step" in r and r["world"] == world:
            ts.append(r["t"])
    ts = ts[skip:]
    if len(ts) < 3:
        raise RuntimeError(f"{len(ts)} steps at world {world} in {log}")
    return statistics.median(b - a for a, b in zip(ts, ts[1:], strict=False))


def _plain_torchrun(root: Path, fw: dict[str, Any], rep: int) -> float:
    """The job under plain torchrun, 2 processes, WINDOW + 3 steps, no spotctl callback."""
    d = root / f"torchrun-{rep}"
    d.mkdir(parents=True)
    shutil.copy(fw["example"], d / "example.py")
    shutil.copy(JOBS / fw["job"], d / "train.py")
    (d / "nocb").touch()
    log = d / "steps.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", STEP_LOG=str(log),
               NO_CALLBACK_FILE=str(d / "nocb"), PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith("SPOTCTL_")]:
        env.pop(k)
    with open(d / "out.log", "wb") as out:
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
             "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id=bench{rep}",
             "--local-addr=127.0.0.1", str(d / "train.py"), "--out", str(d / "out"),
             "--max-steps", str(WINDOW + 3), "--save-steps", str(SAVE_EVERY), *fw["args"]],
            env=env, cwd=d, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"plain torchrun exited {p.returncode}: see {d / 'out.log'}")
    return _step_time(log, 0, 2, skip=3)


def _session(ctx: Context, name: str, fw: dict[str, Any], reps: int) -> dict[str, list[float]]:
    root = ctx.work / f"fw-{name}"
    log, pace, nocb = root / "steps.jsonl", root / "pace", root / "nocb"
    root.mkdir(parents=True)
    pace.write_text("0")
    args = ["--out", str(root / "out"), "--max-steps", "1000000", "--save-steps",
            str(SAVE_EVERY), *fw["args"]]
    c = Cluster(root, f"bfw{name}", "1..2", SAVE_EVERY, engine="torchrun",
                script=JOBS / fw["job"], extra_toml=f"args = {json.dumps(args)}",
                train_env={"STEP_LOG": str(log), "PACE_FILE": str(pace),
                           "NO_CALLBACK_FILE": str(nocb), "HF_HUB_OFFLINE": "1",
                           "SPOTCTL_NOTICE_GRACE_S": GRACE_S})
    shutil.copy(fw["example"], c.project / "example.py")
    out: dict[str, list[float]] = {k: [] for k in (
        "step", "base_step", "again", "redone", "base_again", "base_redone")}

    def notice() -> tuple[float, int]:
        node = sorted(n["id"] for n in c.status()["nodes"] if n["state"] == "running")[0]
        n0, t0 = len(_records(log)), time.time()
        c.cli("preempt", node, "--name", c.name, "--style", "aws")
        return _cycle(log, n0, 1, t0)

    def join() -> None:
        n0 = len(_records(log))
        c.up()
        _cycle(log, n0, 2, time.time())

    try:
        c.up()
        _steps(log, 2, 5)
        for i in range(reps):
            # step time, interleaved: plain torchrun while the cluster's job is held
            pace.write_text("3600")
            time.sleep(2.0)
            out["base_step"].append(_plain_torchrun(root, fw, i))
            n0 = len(_records(log))
            pace.write_text("0")
            _steps(log, 2, WINDOW)
            out["step"].append(_step_time(log, n0, 2))
            # a notice with spotctl's callback
            again, redone = notice()
            out["again"].append(again)
            out["redone"].append(redone)
            _steps(log, 1, 5)
            nocb.touch()  # the launch the join starts trains without the callback
            join()
            _steps(log, 2, SAVE_EVERY // 2)
            again, redone = notice()
            out["base_again"].append(again)
            out["base_redone"].append(redone)
            nocb.unlink()
            join()
            _steps(log, 2, 5)
            ctx.log(f"frameworks {name} {i + 1}/{reps}: step {out['step'][-1] * 1e3:.0f} ms "
                    f"vs plain torchrun {out['base_step'][-1] * 1e3:.0f} ms; notice: "
                    f"{out['redone'][-1]} steps redone, again after {out['again'][-1]:.1f} s "
                    f"(without the callback {out['base_redone'][-1]}, "
                    f"{out['base_again'][-1]:.1f} s); load {os.getloadavg()[0]:.1f}")
    finally:
        c.down()
    return out


def bench(ctx: Context, repeat: int | None = None) -> list[Row]:
    import importlib.util

    reps = ctx.reps(2)
    rows: list[Row] = []
    for name, fw in FRAMEWORKS.items():
        if importlib.util.find_spec(fw["module"]) is None:
            ctx.log(f"frameworks: {fw['module']} is not installed (the '{name}' extra); "
                    "skipped")
            continue
        load0 = os.getloadavg()[0]
        r = _session(ctx, name, fw, reps)
        note = (f"examples/{'hf-trainer' if name == 'hf' else 'lightning'}, world 2 -> 1, "
                f"periodic saves every {SAVE_EVERY} steps, grace {GRACE_S} s; load "
                f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
        label = fw["label"]
        rows += [
            row("frameworks", f"{label}: steady step time (vs plain torchrun)",
                r["step"], r["base_step"], "s", note),
            row("frameworks", f"{label}: steps redone per notice (vs no callback)",
                r["redone"], r["base_redone"], "steps", note),
            row("frameworks", f"{label}: notice -> training again (vs no callback)",
                r["again"], r["base_again"], "s", note),
        ]
    return rows
