"""Lost steps per graceful notice and per hard kill, against the checkpoint interval.

Lost = highest step any rank completed before the event - the step the new group
resumed from. Kills land at a random point of the interval (after at least one
checkpoint of the group), so without a notice about (interval - 1) / 2 steps are
expected. Plain torchrun has no notice path: a noticed node dies at its deadline, which
loses what a kill loses, so its kills are the baseline of both rows.
"""

from __future__ import annotations

from . import ft_session
from .cluster import INTERVALS, failure_note, sessions
from .core import Context, Row, row


def bench(
    ctx: Context, nodes: int = 4, repeat: int | None = None, intervals: tuple[int, ...] = INTERVALS
) -> list[Row]:
    ours, base = sessions(ctx, nodes, repeat, intervals)
    rows = []
    fail = failure_note(ours, base)
    for every in intervals:
        b = [c.kill_lost for c in base.cycles if c.every == every and c.kill_lost is not None]
        n = [
            c.lost
            for c in ours.cycles
            if c.kind == "notice" and c.every == every and c.lost is not None
        ]
        k = [
            c.lost
            for c in ours.cycles
            if c.kind == "kill" and c.every == every and c.lost is not None
        ]
        rows.append(
            row(
                "lost",
                f"steps lost per notice, checkpoint every {every}",
                n,
                b,
                "steps",
                "baseline: plain torchrun, node dies at the deadline (kill)",
            )
        )
        rows.append(
            row(
                "lost",
                f"steps lost per hard kill, checkpoint every {every}",
                k,
                b,
                "steps",
                f"random point of the interval: ~{(every - 1) / 2:g} expected"
                + (f"; {fail}" if fail else ""),
            )
        )
    return rows + ft_session.rows(ctx, nodes, repeat, "lost")
