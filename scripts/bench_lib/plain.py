"""A plain torchrun script (examples/torchrun-plain/train.py, no spotctl import) on a
local cluster with the default spec: notice -> training again, and the steps redone,
per notice; and the steps redone per join. Measured from the script's own step log:
training again = its first step after the resume, minus the time `spotctl preempt` was
called; redone = the last step logged before the resume minus the step it resumed from.

spotctl: the script reads SPOTCTL_NOTICE_FILE and saves at the step boundary
(SAVE_ON_NOTICE=1). Baseline: the same script ignoring the file (SIGTERM at the end of
the grace; what any plain script gets), same cluster size, same grace (5 s).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from chaos_lib.cluster import Cluster

from .core import REPO, Context, Row, row

EXAMPLE = REPO / "examples" / "torchrun-plain" / "train.py"
SAVE_EVERY = 10
GRACE_S = "5"


def _records(log: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise TimeoutError(what)


def _steps(log: Path, world: int, by: int) -> None:
    def n() -> int:
        return sum(1 for r in _records(log) if "step" in r and r["world"] == world)

    n0 = n()
    _wait(lambda: n() >= n0 + by, 180, f"{by} steps at world {world}")


def _cycle(log: Path, n0: int, world: int, t0: float) -> tuple[float, int]:
    """(seconds from t0 to the first step after the resume at `world`, steps redone)."""
    def find() -> tuple[float, int] | None:
        recs = _records(log)
        for i in range(n0, len(recs)):
            r = recs[i]
            if r.get("resumed") is not None and r["world"] == world:
                after = [x for x in recs[i + 1:] if "step" in x]
                if not after:
                    return None
                last = max(x["step"] for x in recs[:i] if "step" in x)
                return after[0]["t"] - t0, last - r["resumed"]
        return None

    return _wait(find, 240, f"a resume at world {world}")  # type: ignore[no-any-return]


def _session(ctx: Context, tag: str, nodes: int, reps: int, notice_file: bool) -> dict[str, list[float]]:
    root = ctx.work / f"plain-{tag}"
    log = root / "steps.jsonl"
    env = {"STEP_LOG": str(log), "CKPT_PATH": str(root / "checkpoint.pt"),
           "SAVE_EVERY": str(SAVE_EVERY), "SPOTCTL_NOTICE_GRACE_S": GRACE_S}
    if notice_file:
        env["SAVE_ON_NOTICE"] = "1"
    c = Cluster(root, f"bplain{tag}", f"{nodes - 1}..{nodes}", SAVE_EVERY, train_env=env,
                engine="torchft", script=EXAMPLE)  # the default engine
    out: dict[str, list[float]] = {"again": [], "redone": [], "join_redone": []}
    try:
        c.up()
        _steps(log, nodes, 10)
        for i in range(reps):
            node = sorted(n["id"] for n in c.status()["nodes"] if n["state"] == "running")[0]
            n0 = len(_records(log))
            t0 = time.time()
            c.cli("preempt", node, "--name", c.name, "--style", "aws")
            again, redone = _cycle(log, n0, nodes - 1, t0)
            out["again"].append(again)
            out["redone"].append(redone)
            ctx.log(f"plain {tag}: notice {i + 1}/{reps}: training again after {again:.2f}s, "
                    f"{redone} steps redone")
            _steps(log, nodes - 1, 10)
            n0 = len(_records(log))
            c.up()
            _, redone = _cycle(log, n0, nodes, time.time())
            out["join_redone"].append(redone)
            _steps(log, nodes, 10)
    finally:
        c.down()
    return out


def bench(ctx: Context, nodes: int = 3, repeat: int | None = None) -> list[Row]:
    reps = ctx.reps(2)
    nodes = max(2, min(nodes, 3))
    ours = _session(ctx, "file", nodes, reps, True)
    base = _session(ctx, "nofile", nodes, reps, False)
    note = (f"examples/torchrun-plain, {nodes} -> {nodes - 1} nodes, default spec, "
            f"grace {GRACE_S} s; baseline: the script ignores the notice file")
    return [
        row("plain", "plain script: notice -> training again", ours["again"], base["again"],
            "s", note),
        row("plain", f"plain script: steps redone per notice, saves every {SAVE_EVERY}",
            ours["redone"], base["redone"], "steps", note),
        row("plain", f"plain script: steps redone per join, saves every {SAVE_EVERY}",
            ours["join_redone"], base["join_redone"], "steps", note),
    ]
