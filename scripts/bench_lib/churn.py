"""Churn: training under failures at random, for minutes (issue 58).

K replica groups (default 6, one node each, a tiny paced model: scripts/bench_lib/
train_churn.py) on spotctl's torchft engine, on a real local cluster driven through the CLI
with the head's own reconcile loop replacing lost nodes (`[rebalance] on_head`, its interval
shortened from 60 s to 5 s, the spec's minimum; a notice, a leave or a loss wakes it at
once anyway). Failures come at random (seeded), exponential gaps with a fixed mean:

    notice-60  a notice (`spotctl preempt NODE --style gcp`, a 30 s lead) every 60 s
    kill-60    a hard kill (`spotctl kill NODE`: SIGKILL of the node's tree) every 60 s
    both-15    one or the other at random every 15 s

each for `minutes` (default 10) on the same cluster, after a window with no failure whose
throughput is the reference (with another such window after the last setting: the
efficiency is against their mean, each printed). The baseline, in the same invocation
with the same schedule (drawn from the same seed): bare torchft (its own Lighthouse, its own loop:
train_torchft_bare.py, the same model and per-replica batch) where every failure is a
SIGKILL of the replica's tree (bare torchft has no notice path) and the replica is started
again RESTART_DELAY_S later, as the "Fault Tolerant Llama" run restarted its replicas.

Every figure comes from the replicas' own step records (one JSON line per step attempt:
time, pid, step, committed or not, quorum id, quorum size, samples), never from the
head's events:
- committed / attempted: distinct (quorum, step) committed over those attempted;
- efficiency: samples committed per second in the setting over the same in the no-failure
  window of the same run (steps committed again after going back are not counted);
- steps lost: steps committed and later run again (the job went back); "at notices": in
  the time after a notice until the next failure;
- pause at a failure: the longest gap in the committed-step timeline (all replicas) that
  holds the failure, minus the no-failure step time (0 when training did not stop: a
  gap of at most two steps is no pause; a gap holding two failures counts for the first);
- spurious regroupings: new quorums with no failure injected in the 30 s before them
  (SPURIOUS_WINDOW_S) that bring in no new process (a replacement's or restart's join);
- where the time went (below a goal): the time lost, split into stalls at failures, stalls
  ended by a join (heals), other stalls, failed attempts, steps run short of replicas
  (bare: fewer samples per step), slower steps (the setting's median step time over the
  no-failure one: on this machine the survivors share its cores with the replacements
  starting, and with whatever else runs), the rest; with the median time from a failure to
  its replacement's first committed step and the quorum's time per step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import LIB, REPO, Context, Row, row

SETTINGS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("notice-60", ("notice",), 60.0),
    ("kill-60", ("kill",), 60.0),
    ("both-15", ("notice", "kill"), 15.0),
)
GOALS = {"notice-60": 0.97, "kill-60": 0.95, "both-15": 0.80}
STEP_SLEEP_S = 0.1
BATCH = 16  # per replica group at full strength (train_torchft_bare.py's BATCH)
RESTART_DELAY_S = 5.0
HEAD_INTERVAL_S = 5.0
NOTICE_STYLE = "gcp"
# spotctl's engine reads a checkpoint only when no replica is left to heal from (bare
# torchft never: the blog's run had none)
CHECKPOINT_EVERY = 200
# a new quorum this long after a failure is that failure's doing (a kill's stall behind a
# dead peer is up to its 10 s timeout, and the regroupings that follow it)
SPURIOUS_WINDOW_S = 30.0


@dataclass
class Failure:
    t: float
    kind: str  # "notice" | "kill"
    node: str
    pid: int | None  # the victim's replica process (from its own records)


@dataclass
class Phase:
    name: str
    t0: float
    t1: float
    failures: list[Failure] = field(default_factory=list)
    skipped: int = 0  # planned failures with no replica to hit


@dataclass
class Session:
    ref: tuple[float, float] = (0.0, 0.0)  # the no-failure window
    ref_after: tuple[float, float] | None = None  # another, after the last setting
    phases: list[Phase] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    full_again: float | None = None  # settle_s: when all groups were in one quorum again
    loads: list[float] = field(default_factory=list)  # 1-min load average, each window

    def load(self) -> None:
        self.loads.append(round(os.getloadavg()[0], 1))


def plan(seed: int, kinds: tuple[str, ...], mean_s: float, duration_s: float
         ) -> list[tuple[float, str]]:
    """Failure times (seconds into the setting) with exponential gaps of mean `mean_s`, each
    of a kind drawn from `kinds`; none in the last 5 s (nothing would show it)."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_s)
        if t >= duration_s - 5.0:
            return out
        out.append((t, rng.choice(kinds)))


def read_records(logs: Path, suffix: str = ".jsonl") -> list[dict[str, Any]]:
    """Every replica's step records under `logs`, each with its node ("node"), by time;
    a line still being written is skipped."""
    out: list[dict[str, Any]] = []
    for p in sorted(logs.glob(f"*{suffix}")):
        node = p.name[: -len(suffix)]
        for line in p.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and "t" in r and "pid" in r:
                r["node"] = node
                out.append(r)
    out.sort(key=lambda r: r["t"])
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def redone(recs: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """(quorum, step) commits of a step some other quorum had already committed: the job
    went back and ran committed steps again."""
    best: dict[str, int] = {}  # quorum -> highest step it committed so far
    out: set[tuple[str, int]] = set()
    for r in recs:
        if not r.get("ok"):
            continue
        q, s = str(r["q"]), int(r["step"])
        if any(m >= s for k, m in best.items() if k != q) and best.get(q, 0) < s:
            out.add((q, s))
        best[q] = max(best.get(q, 0), s)
    return out


def _commits(recs: list[dict[str, Any]]) -> list[tuple[float, tuple[str, int]]]:
    """Each (quorum, step) committed, with when the first replica committed it, by time."""
    first: dict[tuple[str, int], float] = {}
    for r in recs:
        if r.get("ok"):
            first.setdefault((str(r["q"]), int(r["step"])), r["t"])
    return sorted((t, k) for k, t in first.items())


def _timeline(recs: list[dict[str, Any]]) -> list[float]:
    """When each (quorum, step) was first committed by any replica."""
    return [t for t, _ in _commits(recs)]


def step_time(recs: list[dict[str, Any]], t0: float, t1: float) -> float:
    ts = [t for t in _timeline(recs) if t0 <= t < t1]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return statistics.median(gaps) if gaps else 0.0


def samples_per_s(recs: list[dict[str, Any]], t0: float, t1: float) -> float:
    bad = redone(recs)
    n = sum(int(r.get("samples", 0)) for r in recs
            if r.get("ok") and t0 <= r["t"] < t1 and (str(r["q"]), int(r["step"])) not in bad)
    return n / (t1 - t0) if t1 > t0 else 0.0


def step_samples(recs: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Mean samples committed per step (all replicas) in [t0, t1): the epoch's last
    batch may be short, so the no-failure window's mean, not the nominal batch, is what a
    step at full strength commits."""
    per = _samples_by_step([r for r in recs if t0 <= r["t"] < t1 and "ok" in r],
                           redone(recs))
    return sum(per.values()) / len(per) if per else 0.0


def analyse(recs: list[dict[str, Any]], phase: Phase, ref_rate: float, step_s: float,
            groups: int, ref_step_samples: float | None = None) -> dict[str, Any]:
    """The figures of one setting (see the module's docstring). ref_step_samples: samples
    per step with no failure (default: BATCH a group)."""
    t0, t1 = phase.t0, phase.t1
    win = [r for r in recs if t0 <= r["t"] < t1 and "ok" in r]
    attempted = {(str(r["q"]), int(r["step"])) for r in win}
    committed = {(str(r["q"]), int(r["step"])) for r in win if r["ok"]}
    failed = attempted - committed
    bad = redone(recs)
    lost = sorted(k for k in bad if k in committed)
    fails = sorted(phase.failures, key=lambda f: f.t)
    bounds = [f.t for f in fails[1:]] + [t1]
    lost_at: dict[str, int] = {"notice": 0, "kill": 0}
    for f, nxt in zip(fails, bounds, strict=True):
        lost_at[f.kind] += sum(1 for r in win if r["ok"] and f.t <= r["t"] < nxt
                               and (str(r["q"]), int(r["step"])) in bad)
    # new processes (replacements, restarts) and their first commits: joins
    starts = {r["pid"]: r["t"] for r in recs if r.get("start")}
    first_commit: dict[int, float] = {}
    first_key: dict[int, tuple[str, int]] = {}
    for r in recs:
        if r.get("ok"):
            first_commit.setdefault(r["pid"], r["t"])
            first_key.setdefault(r["pid"], (str(r["q"]), int(r["step"])))
    new = sorted((t, pid) for pid, t in starts.items() if t0 <= t < t1)
    joins = {first_key[pid] for _, pid in new if pid in first_key}
    # stalls: gaps in the committed-step timeline (all replicas) longer than two steps,
    # each counted once: to the first failure inside it (1 s of slack: the failure's
    # command runs before it takes effect), else to a join it ends (a heal), else other
    cs = _commits(recs)
    per_failure: dict[int, float] = {i: 0.0 for i in range(len(fails))}
    stalls = {"failure": 0.0, "join": 0.0, "other": 0.0}
    for (x, _), (y, key) in zip(cs, cs[1:], strict=False):
        if y <= t0 or x >= t1 or y - x <= 2 * step_s:
            continue
        excess = min(y, t1) - max(x, t0) - step_s
        if excess <= 0:
            continue
        i = next((i for i, f in enumerate(fails) if x - 1.0 <= f.t <= y), None)
        if i is not None:
            per_failure[i] = max(per_failure[i], excess)
            stalls["failure"] += excess
        elif key in joins:
            stalls["join"] += excess
        else:
            stalls["other"] += excess
    pauses = [per_failure[i] for i in range(len(fails))]
    # each failure's replacement: the first new process started after it, not yet matched
    taken: set[int] = set()
    replacement: list[float] = []
    for f in fails:
        m = next(((t, pid) for t, pid in new if t >= f.t and pid not in taken), None)
        if m is not None and m[1] in first_commit:
            taken.add(m[1])
            replacement.append(first_commit[m[1]] - f.t)
    # regroupings: quorums in order of first appearance, with their members
    members: dict[str, set[int]] = {}
    first_t: dict[str, float] = {}
    for r in recs:
        if "ok" in r:
            members.setdefault(str(r["q"]), set()).add(r["pid"])
            first_t.setdefault(str(r["q"]), r["t"])
    order = sorted(first_t, key=lambda q: first_t[q])
    seen: set[int] = set()
    spurious = 0
    regroupings = 0
    for a, b in zip(order, order[1:], strict=False):
        seen |= members[a]
        tb = first_t[b]
        if not t0 <= tb < t1:
            continue
        regroupings += 1
        joined = bool(members[b] - seen)  # a process new to the job: a replacement joins
        near = any(f.t - 1.0 <= tb <= f.t + SPURIOUS_WINDOW_S for f in fails)
        if not joined and not near:
            spurious += 1
    duration = t1 - t0
    rate = samples_per_s(recs, t0, t1)
    eff = rate / ref_rate if ref_rate else 0.0
    # where the time went, in seconds of the setting
    full = ref_step_samples if ref_step_samples is not None else float(BATCH * groups)
    per_step = _samples_by_step(win, bad)
    short = max(0.0, full * len(per_step) - sum(per_step.values()))
    phase_step = step_time(recs, t0, t1)
    where = {
        "lost_s": duration * (1 - eff),
        "stalls_at_failures_s": stalls["failure"],
        "stalls_at_joins_s": stalls["join"],
        "other_stalls_s": stalls["other"],
        "failed_attempts_s": len(failed) * step_s,
        "slower_steps_s": max(0.0, phase_step - step_s) * len(committed),
        "short_of_replicas_s": short / ref_rate if ref_rate else 0.0,
        "replacement_s_median": statistics.median(replacement) if replacement else None,
    }
    where["other_s"] = where["lost_s"] - sum(
        v for k, v in where.items() if k not in ("lost_s", "replacement_s_median") and v)
    qs = [float(r["quorum_s"]) for r in win if r.get("ok") and r.get("quorum_s") is not None]
    if qs:
        where["quorum_s_p50"] = statistics.median(qs)
        where["quorum_s_max"] = max(qs)
    return {
        "setting": phase.name, "duration_s": duration, "failures": len(fails),
        "notices": sum(1 for f in fails if f.kind == "notice"),
        "kills": sum(1 for f in fails if f.kind == "kill"), "skipped": phase.skipped,
        "committed": len(committed), "attempted": len(attempted),
        "ratio": len(committed) / len(attempted) if attempted else 0.0,
        "efficiency": eff, "samples_per_s": rate, "ref_samples_per_s": ref_rate,
        "lost": len(lost), "lost_at_notices": lost_at["notice"],
        "lost_at_kills": lost_at["kill"], "pauses": pauses,
        "pause_p50": statistics.median(pauses) if pauses else None,
        "pause_p95": _pct(pauses, 0.95) if pauses else None,
        "pause_max": max(pauses) if pauses else None,
        "replacement_s": replacement,
        "regroupings": regroupings, "spurious": spurious, "where": where,
    }


def _samples_by_step(win: list[dict[str, Any]], bad: set[tuple[str, int]]
                     ) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for r in win:
        k = (str(r["q"]), int(r["step"]))
        if r["ok"] and k not in bad:
            out[k] = out.get(k, 0) + int(r.get("samples", 0))
    return out


# -- the two sessions -----------------------------------------------------------------------


def _drive(ctx: Context, tag: str, name: str, schedule: list[tuple[float, str]],
           duration_s: float, hit: Callable[[str], Failure | None],
           tick: Callable[[], None] = lambda: None) -> Phase:
    """Run one setting: the failures of `schedule` at their times, `tick` in between."""
    ph = Phase(name, time.time(), 0.0)
    for off, kind in schedule:
        while time.time() < ph.t0 + off:
            tick()
            time.sleep(0.1)
        f = hit(kind)
        if f is None:
            ph.skipped += 1
            ctx.log(f"{tag} {name}: no replica to hit at +{off:.0f} s")
            continue
        ph.failures.append(f)
        ctx.log(f"{tag} {name}: {kind} on {f.node} at +{f.t - ph.t0:.1f} s")
    while time.time() < ph.t0 + duration_s:
        tick()
        time.sleep(0.1)
    ph.t1 = ph.t0 + duration_s
    return ph


def _victim(recs: list[dict[str, Any]], alive: set[str], rng: random.Random
            ) -> tuple[str, int] | None:
    """One of `alive` that committed in the last 5 s (by its own records, not the head's
    status, which a loaded machine can keep waiting), with its replica's pid."""
    now = time.time()
    last: dict[str, dict[str, Any]] = {}
    for r in recs:
        if r.get("ok"):
            last[r["node"]] = r
    ok = sorted(n for n, r in last.items() if r["t"] > now - 5 and n in alive)
    if not ok:
        return None
    n = rng.choice(ok)
    return n, int(last[n]["pid"])


def _full(recs: list[dict[str, Any]], groups: int, since: float) -> bool:
    return any(r.get("ok") and r["replicas"] >= groups and r["t"] > since for r in recs)


def _wait(what: str, pred: Callable[[], bool], timeout: float,
          tick: Callable[[], None] = lambda: None) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        tick()
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_spotctl(ctx: Context, groups: int, settings: list[tuple[str, list[tuple[float, str]]]],
                duration_s: float, ref_s: float, seed: int, settle_s: float = 0.0,
                ref_after: bool = False) -> Session:
    """settle_s: after the last setting, wait up to this long for all `groups` in one
    quorum again (the head's loop has replaced every node lost) and record when.
    ref_after: then a second no-failure window (the machine's load drifts)."""
    from . import spotctl_session

    work = ctx.subdir("churn-spotctl")
    c = spotctl_session.Cluster(work, groups, CHECKPOINT_EVERY)
    logs = work / "steps"
    logs.mkdir(exist_ok=True)
    shutil.copy(LIB / "train_churn.py", c.project / "train.py")
    env = {"CHURN_STEP_LOG": f"{logs}/{{node}}.jsonl", "CHURN_STEP_SLEEP_S": f"{STEP_SLEEP_S}",
           "CHURN_GLOBAL_BATCH": str(BATCH * groups), "OMP_NUM_THREADS": "1"}
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    (c.project / "spotctl.toml").write_text(
        f'name = "{c.name}"\nprovider = "local"\ngpus = "{groups}"\n\n'
        f'[train]\nengine = "torchft"\nscript = "train.py"\ncheckpoint_every = {CHECKPOINT_EVERY}\n'
        f"env = {{ {env_toml} }}\n\n"
        f"[rebalance]\non_head = true\non_head_interval_s = {HEAD_INTERVAL_S:g}\n"
        "cooldown_s = 0\n\n[local]\nprivate_network = false\n")
    s = Session()
    rng = random.Random(seed)
    try:
        ctx.log(f"churn spotctl: up, {groups} nodes on the torchft engine")
        c.cli("up", "--wait", "300", timeout=420)
        t = time.time()
        _wait(f"{groups} replicas in one quorum", lambda: _full(read_records(logs), groups, t),
              300)
        t = time.time()
        s.load()
        time.sleep(ref_s)
        s.ref = (t, time.time())

        hit_nodes: set[str] = set()  # a node is hit once (a replacement is a new node)

        def hit(kind: str) -> Failure | None:
            recs = read_records(logs)
            v = _victim(recs, {r["node"] for r in recs} - hit_nodes, rng)
            if v is None:
                return None
            hit_nodes.add(v[0])
            t = time.time()
            if kind == "notice":
                c.cli("preempt", v[0], "--name", c.name, "--style", NOTICE_STYLE)
            else:
                c.cli("kill", v[0], "--name", c.name)
            return Failure(t, kind, v[0], v[1])

        for name, sched in settings:
            t = time.time()
            _wait(f"{groups} replicas back before {name}",
                  lambda t=t: _full(read_records(logs), groups, t), 300)
            s.load()
            s.phases.append(_drive(ctx, "churn spotctl", name, sched, duration_s, hit))
            s.load()
        if settle_s or ref_after:
            t = time.time()
            _wait(f"{groups} replicas back after the last setting",
                  lambda: _full(read_records(logs), groups, t), settle_s or 300)
            s.full_again = time.time()
        if ref_after:
            t = time.time()
            time.sleep(ref_s)
            s.ref_after = (t, time.time())
            s.load()
    except (RuntimeError, OSError) as e:
        s.error = str(e).splitlines()[0][:300]
        ctx.log(f"churn spotctl failed: {e}")
    finally:
        s.records = read_records(logs)
        ctx.log("churn spotctl: down")
        c.down()
    return s


def run_bare(ctx: Context, groups: int, settings: list[tuple[str, list[tuple[float, str]]]],
             duration_s: float, ref_s: float, seed: int, ref_after: bool = False) -> Session:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.elastic.ft_harness import FtReplicas

    work = ctx.subdir("churn-bare")
    c = FtReplicas(work, max_steps=1 << 40, every=1000, delay=STEP_SLEEP_S,
                   script=LIB / "train_torchft_bare.py")
    names = [f"r{i}" for i in range(groups)]
    down: dict[str, float] = {}  # replica -> when to start it again
    s = Session()
    rng = random.Random(seed)
    env = {"FT_LOG_ATTEMPTS": "1"}

    def tick() -> None:
        for n, at in list(down.items()):
            if time.time() >= at:
                del down[n]
                c.killed.discard(n)
                c.start(n, extra_env=env)

    def hit(kind: str) -> Failure | None:
        v = _victim(read_records(work, ".steps.jsonl"), set(names) - set(down), rng)
        if v is None:
            return None
        t = c.kill(v[0])  # bare torchft has no notice path: every failure is a SIGKILL
        down[v[0]] = t + RESTART_DELAY_S
        return Failure(t, kind, v[0], v[1])

    try:
        ctx.log(f"churn bare torchft: {groups} replica groups")
        for n in names:
            c.start(n, extra_env=env)
        t = time.time()
        _wait(f"{groups} replicas in one quorum",
              lambda: _full(read_records(work, ".steps.jsonl"), groups, t), 300)
        t = time.time()
        s.load()
        time.sleep(ref_s)
        s.ref = (t, time.time())
        for name, sched in settings:
            t = time.time()
            _wait(f"{groups} replicas back before {name}",
                  lambda t=t: _full(read_records(work, ".steps.jsonl"), groups, t), 300, tick)
            s.load()
            s.phases.append(_drive(ctx, "churn bare", name, sched, duration_s, hit, tick))
            s.load()
        if ref_after:
            t = time.time()
            _wait(f"{groups} replicas back after the last setting",
                  lambda: _full(read_records(work, ".steps.jsonl"), groups, t), 300, tick)
            t = time.time()
            time.sleep(ref_s)
            s.ref_after = (t, time.time())
            s.load()
    except (RuntimeError, OSError, AssertionError) as e:
        s.error = str(e).splitlines()[0][:300]
        ctx.log(f"churn bare failed: {e}")
    finally:
        s.records = read_records(work, ".steps.jsonl")
        c.stop()
    return s


def _refs(s: Session) -> list[tuple[float, float]]:
    return [s.ref] + ([s.ref_after] if s.ref_after else [])


def ref_rates(s: Session) -> list[float]:
    """Samples committed per second in each no-failure window."""
    return [samples_per_s(s.records, *w) for w in _refs(s)]


def figures(s: Session, groups: int) -> list[dict[str, Any]]:
    """Each setting's figures against the mean of the no-failure windows."""
    ws = _refs(s)
    ref_rate = statistics.mean(ref_rates(s))
    step_s = statistics.mean(step_time(s.records, *w) for w in ws)
    full = statistics.mean(step_samples(s.records, *w) for w in ws)
    return [analyse(s.records, ph, ref_rate, step_s, groups, full) for ph in s.phases]


def reanalyse(result: Path, work: Path) -> list[Row]:
    """The rows again from a kept run (`scripts/bench churn --keep`): its
    out/bench-churn.json (windows and failures) and the replicas' records in its work
    directory, read with this module's analysis."""
    d = json.loads(result.read_text())
    sessions = []
    for who, logs, suffix in (("spotctl", work / "churn-spotctl" / "steps", ".jsonl"),
                              ("bare", work / "churn-bare", ".steps.jsonl")):
        r = d["runs"][who]
        after = r.get("ref_after")
        s = Session(ref=(r["ref"][0], r["ref"][1]), records=read_records(logs, suffix),
                    ref_after=(after[0], after[1]) if after else None,
                    error=d["errors"][who], full_again=r.get("full_again"),
                    loads=r.get("load_average_1m", []))
        s.phases = [Phase(p["name"], p["t0"], p["t1"], [Failure(**f) for f in p["failures"]],
                          p["skipped"]) for p in r["phases"]]
        sessions.append(s)
    return _rows(sessions[0], sessions[1], int(d["groups"]), float(d["minutes"]))


def _run_json(s: Session) -> dict[str, Any]:
    """When each window ran and what was hit (to read the records again)."""
    return {"ref": list(s.ref), "ref_after": list(s.ref_after) if s.ref_after else None,
            "ref_samples_per_s": ref_rates(s),
            "full_again": s.full_again, "load_average_1m": s.loads,
            "phases": [{"name": p.name, "t0": p.t0, "t1": p.t1, "skipped": p.skipped,
                        "failures": [vars(f) for f in p.failures]} for p in s.phases]}


def _where(f: dict[str, Any]) -> str:
    w = f["where"]
    parts = [f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in w.items()
             if k.endswith("_s") and k != "lost_s" and v is not None and abs(v) >= 0.5]
    rep = w.get("replacement_s_median")
    txt = f"{w['lost_s']:.0f} s lost: " + (", ".join(parts) or "-")
    if rep is not None:
        txt += f"; failure -> replacement's first step {rep:.0f} s (median)"
    if "quorum_s_p50" in w:
        txt += f"; quorum {w['quorum_s_p50'] * 1000:.0f} ms p50, {w['quorum_s_max']:.1f} s max"
    return txt


def bench(ctx: Context, groups: int = 6, minutes: float = 10.0, seed: int = 58,
          ref_s: float = 60.0) -> list[Row]:
    duration = minutes * 60.0
    settings = [(name, plan(seed + i, kinds, mean, duration))
                for i, (name, kinds, mean) in enumerate(SETTINGS)]
    ref_s = min(ref_s, max(20.0, duration / 4))
    ours = run_spotctl(ctx, groups, settings, duration, ref_s, seed, ref_after=True)
    base = run_bare(ctx, groups, settings, duration, ref_s, seed, ref_after=True)
    fo, fb = figures(ours, groups), figures(base, groups)
    (ctx.out / "bench-churn.json").parent.mkdir(parents=True, exist_ok=True)
    (ctx.out / "bench-churn.json").write_text(json.dumps(
        {"groups": groups, "minutes": minutes, "seed": seed, "spotctl": fo, "bare": fb,
         "errors": {"spotctl": ours.error, "bare": base.error},
         "runs": {"spotctl": _run_json(ours), "bare": _run_json(base)}}, indent=2) + "\n")
    return _rows(ours, base, groups, minutes)


def _rows(ours: Session, base: Session, groups: int, minutes: float) -> list[Row]:
    fo, fb = figures(ours, groups), figures(base, groups)
    short = "" if minutes >= 10 else f"; SHORT RUN: {minutes:g} min per setting, not 10"
    rows: list[Row] = []
    for name, _, _ in SETTINGS:
        o = next((f for f in fo if f["setting"] == name), None)
        b = next((f for f in fb if f["setting"] == name), None)

        def v(f: dict[str, Any] | None, k: str) -> list[float]:
            return [] if f is None or f.get(k) is None else [float(f[k])]

        note = (f"{groups} groups, torchft engine, head's loop every {HEAD_INTERVAL_S:g} s vs "
                f"bare torchft (SIGKILL, restart after {RESTART_DELAY_S:g} s)")
        if o:
            note += (f"; {o['failures']} failures ({o['notices']} notices, {o['kills']} kills"
                     + (f", {o['skipped']} skipped" if o["skipped"] else "") + ")")
        note += short
        rates = [f"{who} " + "/".join(f"{r:.0f}" for r in ref_rates(sess))
                 for who, sess in (("spotctl", ours), ("bare", base)) if sess.records]
        note += "; no-failure samples/s before/after: " + ", ".join(rates)
        loads = ours.loads + base.loads
        if loads:
            note += f"; load average {min(loads):g}..{max(loads):g} on {os.cpu_count()} cores"
        for x, who in ((ours, "spotctl"), (base, "bare")):
            if x.error:
                note += f"; {who} error: {x.error}"
        goal = GOALS[name]
        eff_note = f"goal >= {goal}; " + note
        if o and o["efficiency"] < goal:
            eff_note += f"; spotctl missed: {_where(o)}"
        if b:
            eff_note += f"; bare: {_where(b)}"
        rows += [
            row("churn", f"{name}: efficiency", v(o, "efficiency"), v(b, "efficiency"),
                "x no-failure", eff_note),
            row("churn", f"{name}: committed / attempted", v(o, "ratio"), v(b, "ratio"), "",
                note),
            row("churn", f"{name}: steps lost", v(o, "lost"), v(b, "lost"), "steps",
                (f"at notices {o['lost_at_notices']} (goal 0), at kills {o['lost_at_kills']}; "
                 if o else "") + note),
            row("churn", f"{name}: pause at a failure", (o or {}).get("pauses") or [],
                (b or {}).get("pauses") or [], "s",
                (f"p95 {o['pause_p95']:.2f} s" if o and o["pause_p95"] is not None else "")
                + (f", bare p95 {b['pause_p95']:.2f} s" if b and b["pause_p95"] is not None
                   else "") + "; median (min..max); " + note),
            row("churn", f"{name}: spurious regroupings", v(o, "spurious"), v(b, "spurious"),
                "", (f"of {o['regroupings']} regroupings" if o else "")
                + (f" (bare of {b['regroupings']})" if b else "") + "; " + note),
        ]
    return rows
