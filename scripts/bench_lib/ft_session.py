"""The torchft engine's figures for recovery, lost and join (issue 17): N replica groups
(one real torchrun each, CPU/gloo, the head's Lighthouse module on loopback) running the
same spotctl.elastic script as the tests (tests/elastic/ft_train.py); per cycle a notice
(N -> N-1), a join (N-1 -> N), a SIGKILL of a replica's whole tree (N -> N-1) and a join.
Joiners are started ahead, gated after their imports (as the agent's warm zygote would
have them), so a join measures the membership change, not interpreter start-up.

Every figure comes from a survivor's own step log: pause = the longest gap between its
committed steps in the few steps after the event, minus its median step time; steps lost
= committed steps the survivor had to run again (its log going back), which the torchft
engine should never do. Goals (issue 17): notice <= 0.3 s with 0 lost, kill <= 1 s,
join <= 0.2 s.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from .core import LIB, REPO, Context, Row, row


@dataclass
class FtFigures:
    notice: list[float] = field(default_factory=list)
    kill: list[float] = field(default_factory=list)
    join: list[float] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    error: str = ""


def _lost(steps: list[int]) -> int:
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if b <= a)


def run(ctx: Context, nodes: int, repeat: int | None, bare: bool = False) -> FtFigures:
    """bare: torchft's own loop (train_torchft_bare.py), where a noticed node simply dies:
    its 'notice' is a SIGKILL."""

    def make() -> FtFigures:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
        try:
            import torchft  # noqa: F401
        except ImportError:
            return FtFigures(error="torchft not installed (the 'ft' extra)")
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from tests.elastic.ft_harness import FtReplicas, pause_at

        cycles = ctx.reps(2)
        tag = "bare torchft" if bare else "torchft"
        out = FtFigures()
        kw = {"script": LIB / "train_torchft_bare.py"} if bare else {}
        c = FtReplicas(ctx.subdir("torchft-bare" if bare else "torchft"), max_steps=1_000_000,
                       every=50, delay=0.03, **kw)
        names = [f"r{i}" for i in range(nodes)]
        joiner = 0

        def new_joiner() -> str:
            nonlocal joiner
            joiner += 1
            n = f"j{joiner}"
            c.start(n, gated=True)
            return n

        try:
            for n in names:
                c.start(n)
            nxt = new_joiner()
            ctx.log(f"{tag}: {nodes} replica groups starting")
            c.wait(f"{nodes} replicas in one quorum",
                   lambda: all(any(s["replicas"] == nodes for s in c.steps(n)) for n in names),
                   timeout=300)
            witness = names[-1]  # never noticed, killed or replaced

            def settle(k: int = 10) -> None:
                s0 = c.last_step(witness)
                c.wait("survivor steps", lambda: c.last_step(witness) >= s0 + k, timeout=120)

            victims = names[:-1]
            for i in range(cycles):
                settle()
                v = victims.pop(0)
                if bare:  # no notice path: the noticed node dies
                    t = c.kill(v)
                else:
                    t = c.notice(v)
                    c.finish([v], timeout=60)
                left_at = c.last_step(v)
                settle()
                after = [s["step"] for s in c.steps(witness) if s["t"] > t]
                out.lost.append(max(0, left_at - (after[0] - 1)) if after else -1)
                out.notice.append(pause_at(c.steps(witness), t, nodes - 1))
                ctx.log(f"{tag}: notice {i + 1}/{cycles}: {out.notice[-1]:.3f} s")
                t = c.open_gate(nxt)
                victims.append(nxt)
                j = nxt
                c.wait("joiner training", lambda j=j: len(c.steps(j)) >= 3, timeout=120)
                nxt = new_joiner()
                settle()
                out.join.append(pause_at(c.steps(witness), t, nodes))
                ctx.log(f"{tag}: join {i + 1}/{cycles}: {out.join[-1]:.3f} s")
                v = victims.pop(0)
                t = c.kill(v)
                settle()
                out.kill.append(pause_at(c.steps(witness), t, nodes - 1))
                ctx.log(f"{tag}: kill {i + 1}/{cycles}: {out.kill[-1]:.3f} s")
                t = c.open_gate(nxt)
                victims.append(nxt)
                j = nxt
                c.wait("joiner training", lambda j=j: len(c.steps(j)) >= 3, timeout=120)
                nxt = new_joiner()
                settle()
                out.join.append(pause_at(c.steps(witness), t, nodes))
            if _lost([s["step"] for s in c.steps(witness)]):
                out.error = "the survivor ran committed steps again"
        except AssertionError as e:
            out.error = str(e).splitlines()[0][:200]
            ctx.log(f"torchft session failed: {out.error}")
        finally:
            c.stop()
            time.sleep(0.5)
        return out

    return ctx.cached(f"torchft-{nodes}-{repeat}-{bare}", make)  # type: ignore[no-any-return]


def rows(ctx: Context, nodes: int, repeat: int | None, which: str) -> list[Row]:
    """The torchft engine's rows for `which` (recovery, lost, join), measured on the same
    machine in the same run as the rows above them."""
    f, b = run(ctx, nodes, repeat), run(ctx, nodes, repeat, bare=True)
    for x in (f, b):  # a change the step log never showed is left out, not a NaN
        x.notice, x.kill, x.join = ([v for v in xs if v == v] for xs in (x.notice, x.kill, x.join))
        x.lost = [v for v in x.lost if v >= 0]
    note = (f"torchft engine vs bare torchft (its own loop: per-replica batches, a noticed "
            f"node dies), {nodes} replica groups, survivor's step log")
    if f.error or b.error:
        note += f"; {f.error or ''} {('bare: ' + b.error) if b.error else ''}"
    m_down, m_up = f"{nodes}->{nodes - 1}", f"{nodes - 1}->{nodes}"
    # the simulator's torchft pauses; not its hard_recovery_s: a SIGKILL here closes the
    # sockets at once, a VM that vanishes does not (spotctl.simulate.model.ENGINE_DEFAULTS)
    sim = ctx.engine_sim("torchft")
    if which == "recovery" and f.notice:
        sim["notice_recovery_s"] = round(statistics.median(f.notice), 3)
    if which == "join" and f.join:
        sim["join_pause_s"] = round(statistics.median(f.join), 3)
    if which == "recovery":
        return [
            row("recovery", f"torchft: pause at a notice ({m_down})", f.notice, b.notice, "s",
                note + "; goal <= 0.3 s"),
            row("recovery", f"torchft: pause after a hard kill ({m_down})", f.kill, b.kill, "s",
                note + "; goal <= 1 s"),
        ]
    if which == "lost":
        return [row("lost", "torchft: steps lost per notice", f.lost, b.lost, "steps",
                    note + "; goal 0")]
    return [row("join", f"torchft: training pause at a join ({m_up})", f.join, b.join, "s",
                note + "; joiner pre-started (imports done); goal <= 0.2 s")]
