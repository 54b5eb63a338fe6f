"""Quorum: what the torchft engine's synchronous per-step quorum costs (issue 17).

spotctl's torchft engine waits for each step's quorum before the step starts, because the
quorum decides how the step's fixed global batch is split. Bare torchft starts the quorum
asynchronously and overlaps it with the forward pass (each replica draws its own batch, so
it need not know the membership yet). Both run N replica groups (one real torchrun each,
CPU/gloo, the head's Lighthouse module on loopback) with no membership change, the same
tiny MLP and no sleep between steps, so the step is almost all overhead: the worst case
for the quorum's share. Figures from the replicas' own step logs: the step time (gap
between committed steps) of the torchft engine vs bare torchft, and the time the engine's
next_step() waited for its quorum (FtRun.quorum_s).
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from .core import LIB, REPO, Context, Row, row


@dataclass
class QuorumFigures:
    step_s: list[float] = field(default_factory=list)  # per step, steady state
    quorum_s: list[float] = field(default_factory=list)  # engine only
    error: str = ""


def steady(steps: list[dict[str, Any]], replicas: int, skip: int = 10) -> list[dict[str, Any]]:
    """The run of consecutive committed steps at `replicas` replicas, less the first
    `skip` (a new quorum's first steps pay its process group's reconfiguration)."""
    full = [s for s in steps if s.get("replicas") == replicas]
    return full[skip:]


def step_times(steps: list[dict[str, Any]]) -> list[float]:
    """Gaps between consecutive committed steps (a gap across a skipped step is left out)."""
    return [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False)
            if b["step"] == a["step"] + 1]


def _session(ctx: Context, nodes: int, steps: int, bare: bool) -> QuorumFigures:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.elastic.ft_harness import FtReplicas

    tag = "bare torchft" if bare else "torchft"
    kw = {"script": LIB / "train_torchft_bare.py"} if bare else {}
    c = FtReplicas(ctx.subdir(f"quorum-{'bare' if bare else 'engine'}"), max_steps=1_000_000,
                   every=1_000_000, delay=0.0, **kw)
    names = [f"q{i}" for i in range(nodes)]
    witness = names[-1]
    out = QuorumFigures()
    try:
        for n in names:
            c.start(n)
        c.wait(f"{nodes} replicas in one quorum",
               lambda: all(any(s["replicas"] == nodes for s in c.steps(n)) for n in names),
               timeout=300)
        c.wait(f"{steps} steady steps", lambda: len(steady(c.steps(witness), nodes)) > steps,
               timeout=600)
        s = steady(c.steps(witness), nodes)[:steps + 1]
        out.step_s = step_times(s)
        out.quorum_s = [x["quorum_s"] for x in s[1:] if x.get("quorum_s") is not None]
        ctx.log(f"{tag}: {len(out.step_s)} steps, median "
                f"{statistics.median(out.step_s) * 1000:.1f} ms")
    except AssertionError as e:
        out.error = str(e).splitlines()[0][:200]
        ctx.log(f"{tag} quorum session failed: {out.error}")
    finally:
        c.stop()
    return out


def bench(ctx: Context, nodes: int = 3, steps: int | None = None) -> list[Row]:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        return [Row("quorum", "(skipped)", None, None, "", "torchft not installed (the 'ft' extra)")]
    n = steps if steps is not None else ctx.reps(1) * 200
    f, b = _session(ctx, nodes, n, bare=False), _session(ctx, nodes, n, bare=True)
    note = (f"{nodes} replica groups, tiny MLP, no sleep: the step is mostly overhead "
            f"(the worst case for the quorum's share)")
    errors = "; ".join(x for x in (f.error, b.error and f"bare: {b.error}") if x)
    if errors:
        note += f"; error: {errors}"
    ms = [x * 1000 for x in f.step_s]
    return [
        row("quorum", "torchft: step time, sync quorum vs bare torchft's async",
            ms, [x * 1000 for x in b.step_s], "ms", note),
        row("quorum", "torchft: next_step() waiting for its quorum",
            [x * 1000 for x in f.quorum_s], [], "ms",
            "the per-step Lighthouse round trip and the wait for the slowest replica"),
    ]
