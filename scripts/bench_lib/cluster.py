"""The two cluster sessions (spotctl and plain torchrun) that the recovery, lost and join
benchmarks read. Run once per `scripts/bench` invocation and cached: together the three
benchmarks cost the same as any one of them."""

from __future__ import annotations

from dataclasses import dataclass

from . import spotctl_session, torchrun_session
from .core import Context

# Checkpoint intervals (steps) the lost-steps benchmark compares. Each spotctl cycle and
# each baseline cycle runs with one of them, in turn.
INTERVALS = (10, 30)


@dataclass(frozen=True)
class Plan:
    nodes: int
    notices: int  # spotctl notices (each followed by a join back to `nodes`)
    kills_per_interval: int  # spotctl hard kills per checkpoint interval
    baseline_kills: int  # plain torchrun kills (each followed by a join)
    intervals: tuple[int, ...]


def plan_for(ctx: Context, nodes: int, repeat: int | None, intervals: tuple[int, ...]) -> Plan:
    n = ctx.reps(5) if repeat is None else max(1, repeat)
    # A plain torchrun cycle takes ~1.5 min (its recovery alone ~50 s), so the baseline
    # runs fewer cycles than spotctl (2 at the default 5); its spread is small (fixed
    # timeouts dominate). This keeps a default run near 10 minutes on 2 cores.
    return Plan(
        nodes=nodes,
        notices=n,
        kills_per_interval=max(1, n // 4),
        baseline_kills=max(len(intervals), (n + 1) // 3),
        intervals=intervals,
    )


def sessions(
    ctx: Context, nodes: int = 4, repeat: int | None = None, intervals: tuple[int, ...] = INTERVALS
) -> tuple[spotctl_session.SpotctlResult, torchrun_session.BaselineResult]:
    p = plan_for(ctx, nodes, repeat, intervals)

    def run() -> tuple[spotctl_session.SpotctlResult, torchrun_session.BaselineResult]:
        ours = spotctl_session.run(ctx, p.nodes, p.notices, p.kills_per_interval, p.intervals)
        base = torchrun_session.run(ctx, p.nodes, p.baseline_kills, p.intervals)
        for f in ours.failures:
            ctx.log(f"spotctl session: {f}")
        for f in base.failures:
            ctx.log(f"torchrun session: {f}")
        return ours, base

    result: tuple[spotctl_session.SpotctlResult, torchrun_session.BaselineResult]
    result = ctx.cached(f"cluster:{p}", run)
    return result


def failure_note(ours: spotctl_session.SpotctlResult, base: torchrun_session.BaselineResult) -> str:
    parts = []
    if ours.failures:
        parts.append(f"spotctl: {len(ours.failures)} failed cycle(s): {ours.failures[0]}")
    if base.failures:
        parts.append(f"baseline: {base.failures[0]}")
    if ours.leftover_processes:
        parts.append(f"{ours.leftover_processes} process(es) outlived `spotctl down`")
    return "; ".join(parts)


def join_note(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
