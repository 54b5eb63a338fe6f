"""Recovery: notice -> the survivors' first step at N-1 (local N -> N-1 nodes).

spotctl: `spotctl preempt NODE --style aws`, then notice_to_resume_s of the rescale event;
a hard kill (`spotctl kill NODE`) is timed from the dead node's last heartbeat. Baseline:
plain torchrun, one agent's process tree SIGKILLed, kill -> first step at N-1 from the
step log (torchrun has no notice path: a noticed node dies the same way at its deadline).
Issue 3's goal is <= 5 s for the notice case on the local 4 -> 3 cluster.
"""

from __future__ import annotations

import statistics

from . import ft_session
from .cluster import INTERVALS, failure_note, join_note, sessions
from .core import Context, Row, row


def bench(
    ctx: Context, nodes: int = 4, repeat: int | None = None, intervals: tuple[int, ...] = INTERVALS
) -> list[Row]:
    ours, base = sessions(ctx, nodes, repeat, intervals)
    notice = [
        c.recovery_s
        for c in ours.cycles
        if c.kind == "notice" and c.reason == "notice" and c.recovery_s is not None
    ]
    kill = [c.recovery_s for c in ours.cycles if c.kind == "kill" and c.recovery_s is not None]
    killed = [c.recovery_s for c in base.cycles if c.recovery_s is not None]
    odd = [c.reason for c in ours.cycles if c.kind == "notice" and c.reason not in ("", "notice")]
    sim = ctx.engine_sim("torchrun")  # the spotctl session runs the torchrun engine
    if notice:
        sim["notice_recovery_s"] = round(statistics.median(notice), 3)
    if kill:
        sim["hard_recovery_s"] = round(statistics.median(kill), 3)
    fail = failure_note(ours, base)
    m = f"{nodes}->{nodes - 1} nodes"
    return [
        row(
            "recovery",
            f"notice -> first step at new size ({m})",
            notice,
            killed,
            "s",
            join_note(
                "spotctl preempt --style aws (drain) vs plain torchrun with one agent "
                "SIGKILLed, default rdzv settings; issue 3 goal <= 5 s",
                f"{len(odd)} notice(s) ended as {odd}" if odd else "",
                fail,
            ),
        ),
        row(
            "recovery",
            f"hard kill -> first step at new size ({m})",
            kill,
            killed,
            "s",
            "spotctl kill, timed from the dead node's last heartbeat, vs the same baseline",
        ),
    ] + ft_session.rows(ctx, nodes, repeat, "recovery")
