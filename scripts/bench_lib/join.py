"""Join: a new node enters a running job (N-1 -> N).

spotctl: `spotctl up` launches a node; it joins through a drain (checkpoint at the same
step on every rank) before the group re-forms. Baseline: a new plain torchrun agent joins
the running group; torchrun restarts every worker, which resume from the last periodic
checkpoint. Pause = last step completed before the join -> first step at the new size,
from the step log of each side.
"""

from __future__ import annotations

import statistics

from . import ft_session
from .cluster import INTERVALS, failure_note, sessions
from .core import Context, Row, row


def bench(
    ctx: Context, nodes: int = 4, repeat: int | None = None, intervals: tuple[int, ...] = INTERVALS
) -> list[Row]:
    ours, base = sessions(ctx, nodes, repeat, intervals)
    pause = [c.join_pause_s for c in ours.cycles if c.join_pause_s is not None]
    bpause = [c.join_pause_s for c in base.cycles if c.join_pause_s is not None]
    lost = [c.join_lost for c in ours.cycles if c.join_lost is not None]
    blost = [c.join_lost for c in base.cycles if c.join_lost is not None]
    if pause:
        ctx.engine_sim("torchrun")["join_pause_s"] = round(statistics.median(pause), 3)
    m = f"{nodes - 1}->{nodes} nodes"
    return [
        row(
            "join",
            f"training pause ({m})",
            pause,
            bpause,
            "s",
            "spotctl up + drain vs a new plain torchrun agent joining",
        ),
        row(
            "join",
            f"steps lost per join ({m})",
            lost,
            blost,
            "steps",
            "baseline workers restart from the last periodic checkpoint"
            + (f"; {failure_note(ours, base)}" if failure_note(ours, base) else ""),
        ),
    ] + ft_session.rows(ctx, nodes, repeat, "join")
