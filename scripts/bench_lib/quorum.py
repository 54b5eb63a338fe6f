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

Straggler (issue 28): 3 replica groups, one of them late to 8 % of its quorums by
0.5-1.5 s (tests/elastic/ft_jitter_train.py, FT_JITTER) while its Manager heartbeats, no
membership change: the quorums a steady replica got, from its own quorum log, each one
after the first a spurious regrouping (the late replica left out, then healed back in).
spotctl's Lighthouse timing (join timeout 60 s, heartbeat timeout 250 ms, a heartbeat
every 50 ms) against the one before (join timeout 100 ms, heartbeat timeout 1 s, every
100 ms) as the baseline.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
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


JITTER = "0.08,0.5,1.5"
BEFORE = {"SPOTCTL_FT_JOIN_TIMEOUT_MS": "100", "SPOTCTL_FT_HEARTBEAT_TIMEOUT_MS": "1000",
          "SPOTCTL_FT_HEARTBEAT_INTERVAL_MS": "100"}


def _watch_heartbeats(address: str, stop: threading.Event, ages: list[float]) -> None:
    """The Lighthouse's age of each replica's last heartbeat, from its status page every
    20 ms: how close a live replica came to the heartbeat timeout."""
    import re
    import urllib.request

    while not stop.wait(0.02):
        try:
            with urllib.request.urlopen(f"{address}/status", timeout=2) as r:
                page = r.read().decode(errors="replace")
        except OSError:
            continue
        ages.extend(float(a) for a in re.findall(r"seen ([0-9.]+)s ago", page))


@dataclass
class StragglerRun:
    """One straggler session, from the steady replica's and the late one's quorum logs."""

    regroupings_per_1000: float  # NaN when the session failed
    heals: int  # times the late replica healed back in (its quorum log)
    error: str
    oldest_heartbeat_s: float  # the oldest heartbeat of a live replica the Lighthouse saw
    load: float  # the machine's one-minute load average when the session ended


def _straggler_session(ctx: Context, steps: int, env: dict[str, str]) -> StragglerRun:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import json

    from spotctl.head.lighthouse import LighthouseTiming
    from tests.elastic.ft_harness import FtReplicas

    saved = {k: os.environ.get(k) for k in [*env, "FT_QUORUM_LOG", "FT_JITTER",
                                            "SPOTCTL_FT_START_REPLICAS"]}
    tag = "before" if env else "spotctl"
    d = ctx.subdir(f"straggler-{tag}")
    os.environ.update(env, FT_QUORUM_LOG=str(d / "{replica}.quorums.jsonl"),
                      SPOTCTL_FT_START_REPLICAS="3")
    c = FtReplicas(d, max_steps=steps + 40, every=1_000_000, delay=0.02,
                   timing=LighthouseTiming.from_env(), script=REPO / "tests" / "elastic" /
                   "ft_jitter_train.py")
    stop, ages = threading.Event(), [0.0]
    assert c.lh is not None
    watch = threading.Thread(target=_watch_heartbeats, args=(c.lh.address, stop, ages),
                             daemon=True)
    try:
        c.start("s0")
        c.start("s1")
        os.environ["FT_JITTER"] = JITTER
        c.start("late")
        os.environ.pop("FT_JITTER")
        c.wait("three replicas in one quorum", lambda: any(
            s["replicas"] == 3 for s in c.steps("s0")), timeout=300)
        watch.start()
        c.wait("the last steps", lambda: c.last_step("s0") >= steps + 30, timeout=900)
        stop.set()
        c.finish(["s0", "s1", "late"], timeout=900)

        def log(n: str) -> list[dict[str, Any]]:
            p = d / f"{n}.quorums.jsonl"
            return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

        q = log("s0")
        full = next(i for i, x in enumerate(q) if x["replicas"] == 3)  # all three in
        q = q[full:]
        changes = sum(1 for a, b in zip(q, q[1:], strict=False) if a["quorum"] != b["quorum"])
        heals = sum(1 for x in log("late") if x["step"] > x["step_before"] > 0)
        ctx.log(f"straggler ({tag}): {changes} regroupings in {len(q)} steps, {heals} heals, "
                f"oldest heartbeat {max(ages) * 1000:.0f} ms")
        return StragglerRun(1000 * changes / max(1, len(q)), heals, "", max(ages),
                            os.getloadavg()[0])
    except (AssertionError, StopIteration, OSError) as e:
        err = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        ctx.log(f"straggler session ({tag}) failed: {err}")
        return StragglerRun(float("nan"), 0, err, max(ages), os.getloadavg()[0])
    finally:
        stop.set()
        c.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench(ctx: Context, nodes: int = 3, steps: int | None = None,
          short: bool = False) -> list[Row]:
    """The quorum's price and, on a full run (`steps` None), its stability with a
    straggler. `short` (scripts/bench quorum --short): the same rows from a few dozen
    steps a session, a check of the plumbing, not figures for the docs."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        return [Row("quorum", "(skipped)", None, None, "", "torchft not installed (the 'ft' extra)")]
    n = steps if steps is not None else 30 if short else ctx.reps(1) * 200
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
        # (the full benchmark only: a smoke run's step count is too short for stragglers)
        *(straggler(ctx, 60 if short else None) if steps is None else []),
    ]


def straggler(ctx: Context, steps: int | None = None) -> list[Row]:
    n = steps if steps is not None else ctx.reps(1) * 300
    ours = [_straggler_session(ctx, n, {}) for _ in range(ctx.reps(1))]
    before = [_straggler_session(ctx, n, BEFORE) for _ in range(ctx.reps(1))]
    return [straggler_row(n, ours, before)]


def straggler_row(steps: int, ours: list[StragglerRun], before: list[StragglerRun]) -> Row:
    """The stability row of docs/benchmarks.md from the sessions of one run: the
    regroupings of each side, and beside them (the `quorum-stability` table reads them)
    the late replica's heals per run (the median over the side's sessions that finished)
    and the oldest heartbeat the Lighthouse saw of a live replica under spotctl's timing,
    in ms by the load it was seen at."""
    ok_ours, ok_before = [x for x in ours if not x.error], [x for x in before if not x.error]
    errors = "; ".join(x.error for x in ours + before if x.error)

    def heals(runs: list[StragglerRun]) -> float | None:
        return statistics.median(x.heals for x in runs) if runs else None

    oldest: dict[str, float] = {}
    for x in ok_ours:
        k = f"{x.load:.0f}"
        oldest[k] = max(oldest.get(k, 0.0), round(x.oldest_heartbeat_s * 1000))
    note = (f"3 replicas, one late to 8 % of its quorums by 0.5-1.5 s, {steps} steps; goal 0; "
            f"heals of the late replica per run: {heals(ok_ours)} (before: {heals(ok_before)}); "
            f"oldest heartbeat the Lighthouse saw of a live replica: "
            f"{max((x.oldest_heartbeat_s for x in ok_ours), default=0) * 1000:.0f} ms "
            f"(timeout 250 ms); baseline: join timeout 100 ms"
            + (f"; error: {errors}" if errors else ""))
    return row("quorum", "torchft: spurious regroupings per 1,000 steps, jittery replica",
               [x.regroupings_per_1000 for x in ok_ours],
               [x.regroupings_per_1000 for x in ok_before], "", note,
               extra={"heals": {"spotctl": heals(ok_ours), "baseline": heals(ok_before)},
                      "oldest_heartbeat_ms": oldest})
