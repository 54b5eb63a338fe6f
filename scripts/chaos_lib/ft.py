"""The cluster scenarios on the torchft engine (`scripts/chaos --engine torchft`): the same
3-node local cluster, `[train] engine = "torchft"`, the template's model under
scripts/chaos_lib/ft_train.py (one JSON line per step attempt per replica).

On torchft a membership change is a new quorum, not a restart: a notice is the node's own
graceful leave (survivors go on from memory), a kill drops the replica at the next quorum
(the step in flight fails and is run again by everyone), a join heals from a live peer.
The head's rescale events are recorded from what the workers report and do not see failed
steps, so every figure here is measured from the replicas' step logs:

- committed_steps_lost: newest checkpoint committed before the fault minus the lowest step
  any new quorum (or restarted replica) continued from: as on torchrun, > 0 only if the
  job went back behind a committed checkpoint.
- steps_replayed: steps computed again: steps committed in an earlier quorum and committed
  again in a new one, plus step attempts that failed the commit vote (distinct quorum and
  step) after the fault.
- recover_s: fault -> the first step committed by a new quorum of the expected size.

Scenario by scenario (keys as in scripts/chaos):
 1/2 notice: the replica commits the step in flight and leaves; survivors never restart.
 3   kill: the quorum drops the replica; the failed step is the replay.
 4   notice + kill at once: 3 -> 1 replica.
 5   SIGSTOP: the frozen replica stops heartbeating; survivors give their collective up
     once its heartbeats are 2 s stale (spotctl.elastic.ftwatch) and fail that step, or,
     frozen outside a collective, it is just not in the next quorum; either way the
     others re-form without it.
 6   head (and with it the Lighthouse) killed and restarted by `up`: the replicas' managers
     ask again until the restarted Lighthouse answers, and go on from memory.
 7/8 joins (CLI killed mid-up; two `up` at once): the joiner heals from a live peer.
 11/15/16/18 must not disturb training: no new quorum, no failed step (18: the
     Lighthouse dashboard's kill route, POSTed for every replica over HTTP/1.1 and HTTP/2).
 19  a fake replica (torchft's own Manager) at a very high step with a pickle payload:
     every replica refuses its heal, the payload never runs, no worker restarts.
 12  every replica's workers killed at once (the only case torchft reads a checkpoint)
     with the newest checkpoint corrupted: resume from the one before it.
 17  rebalance racing down: engine-independent, run as on torchrun.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import local, trust
from .cluster import Cluster, Timeout
from .result import Result

WORLD = local.WORLD
EVERY = local.EVERY
SCRIPT = Path(__file__).resolve().parent / "ft_train.py"
KEYS = ("11", "15", "16", "18", "19", "1", "7", "2", "8", "3", "4", "5", "6", "12", "17")


def make_cluster(root: Path, step_sleep_s: float = 0.05) -> Cluster:
    steps = root / "chaos-ft" / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    return Cluster(
        root / "chaos-ft",
        "chaosft",
        f"2..{WORLD}",
        EVERY,
        train_env={"TRAIN_DATASET_SIZE": "4096", "TRAIN_GLOBAL_BATCH": "24",
                   "CHAOS_STEP_LOG": f"{steps}/{{node}}.jsonl",
                   "TRAIN_STEP_SLEEP_S": str(step_sleep_s)},
        extra_toml="\n[rebalance]\ncooldown_s = 0\n",
        engine="torchft",
        script=SCRIPT,
    )


# -- the replicas' step logs ----------------------------------------------------------------


def records(c: Cluster) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in sorted((c.root / "steps").glob("*.jsonl")):
        for line in p.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            if isinstance(r, dict) and "t" in r:
                r["node"] = p.stem
                out.append(r)
    out.sort(key=lambda r: r["t"])
    return out


def analyse(c: Cluster, t0: float, world: int | None = None) -> dict[str, Any]:
    """What the step logs say about the job since t0 (see the module's docstring)."""
    recs = records(c)
    commits = [r for r in recs if r.get("ok")]
    # where the job was at the fault: its latest commit (not the highest step ever: an
    # earlier scenario's replay may still be catching up)
    last_pre = next((r for r in reversed(commits) if r["t"] < t0), None)
    pre = last_pre["step"] if last_pre else 0
    since = last_pre["t"] if last_pre else 0.0
    # a segment: consecutive commits of one process in one quorum
    last_q: dict[int, str] = {}
    starts: list[dict[str, Any]] = []
    for r in commits:
        if last_q.get(r["pid"]) != r["q"]:
            last_q[r["pid"]] = r["q"]
            if r["t"] >= t0:
                starts.append(r)
    replayed_commits = 0
    for s in starts:
        done_elsewhere = max((r["step"] for r in commits
                              if since <= r["t"] < s["t"] and r["q"] != s["q"]), default=0)
        replayed_commits = max(replayed_commits, done_elsewhere - (s["step"] - 1))
    failed = {(r["q"], r["step"]) for r in recs if r.get("ok") is False and r["t"] >= t0}
    resume = min((s["step"] - 1 for s in starts), default=None)
    recovered = None
    if world is not None and starts:
        first_new = min(s["t"] for s in starts)
        recovered = next((r for r in commits if r["t"] >= first_new
                          and r.get("replicas") == world), None)
    after = ({r["step"] for r in commits if r["t"] > recovered["t"]} if recovered else set())
    starts_at = [r["t"] for r in recs if r.get("start") and r["t"] >= t0]
    return {
        "pre": pre,
        "resume": resume,
        "replayed_commits": replayed_commits,
        "failed_steps": sorted(failed, key=lambda x: (x[1], x[0])),
        "new_quorums": sorted({s["q"] for s in starts}),
        "recovered_at": recovered["t"] if recovered else None,
        "steps_after_recovery": len(after),
        "processes_started": len(starts_at),
        "restored": [r.get("restored") for r in recs if r.get("start") and r["t"] >= t0],
        "newest": max((r["step"] for r in commits), default=0),
        # each node's replica process: the one of its newest commit
        "pid": {r["node"]: r["pid"] for r in commits},
    }


def wait_world(c: Cluster, t0: float, world: int, past: int = 3,
               timeout: float = 150) -> dict[str, Any]:
    """Wait until a new quorum (or restarted replicas) of `world` replicas has committed
    `past` steps since t0; return analyse()'s view."""
    deadline = time.monotonic() + timeout
    m: dict[str, Any] = {}
    while time.monotonic() < deadline:
        m = analyse(c, t0, world)
        if m["recovered_at"] is not None and m["steps_after_recovery"] >= past:
            return m
        time.sleep(0.4)
    raise Timeout(f"no quorum of {world} replicas training since the fault: "
                  f"{ {k: m.get(k) for k in ('pre', 'resume', 'new_quorums', 'newest')} }"
                  f"\n{c.debug()}")


def wait_steps(c: Cluster, t0: float, n: int, timeout: float = 120) -> dict[str, Any]:
    """Wait until the job has committed n more steps (in any quorum) from now; return
    analyse()'s view of the time since t0."""
    start = analyse(c, t0)["newest"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = analyse(c, t0)
        if m["newest"] >= start + n:
            return m
        time.sleep(0.4)
    raise Timeout(f"the job did not advance {n} steps from {start}\n{c.debug()}")


def training_at(c: Cluster, world: int, past: int, timeout: float = 240) -> None:
    """Wait until the newest step is past `past` and was committed by `world` replicas."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        commits = [r for r in records(c) if r.get("ok")]
        if commits and commits[-1]["step"] > past and commits[-1].get("replicas") == world:
            return
        time.sleep(0.4)
    raise Timeout(f"not training at {world} replicas past step {past}\n{c.debug()}")


def ckpts(c: Cluster, t0: float) -> list[int]:
    """The checkpoint steps committed before t0 (read at the fault: keep_last prunes)."""
    from spotctl.elastic.checkpoint import COMMIT

    out = []
    for s in c.committed():
        try:
            if (c.ckpt_dir / f"step-{s:08d}" / COMMIT).stat().st_mtime <= t0:
                out.append(s)
        except OSError:
            continue
    return out


def fill(res: Result, m: dict[str, Any], committed: list[int], t0: float,
         recover: bool = True) -> None:
    """The figures from analyse()'s view `m` of the time since t0. committed: the
    checkpoints committed before the fault; the newest one not past the job's step at the
    fault counts (a newer one is an earlier scenario's, left from before a replay)."""
    ckpt_before = max((s for s in committed if s <= m["pre"]), default=0)
    resume = m["pre"] if m["resume"] is None else m["resume"]
    res.committed_steps_lost = max(0, ckpt_before - resume)
    res.steps_replayed = m["replayed_commits"] + len(m["failed_steps"])
    if recover:
        res.recover_s = round(m["recovered_at"] - t0, 2)
    else:
        res.recover_s = None
        res.not_applicable = sorted(set(res.not_applicable) | {"recover_s"})
    res.detail["ft"] = {k: m[k] for k in ("pre", "resume", "replayed_commits", "failed_steps",
                                          "new_quorums", "processes_started", "restored")}
    res.detail["ft"]["checkpoint_before"] = ckpt_before


def head_rescales(c: Cluster, n0: int) -> list[dict[str, Any]]:
    """The head's rescale events since n0, read defensively (their fields change)."""
    try:
        evs = c.events("rescale")[n0:]
    except AssertionError:
        return []
    keys = ("from_world_size", "to_world_size", "reason", "resume_step", "lost_steps", "engine")
    return [{k: e.get(k) for k in keys} for e in evs]


def _restarted(m_before: dict[str, Any], m_after: dict[str, Any], gone: set[str]) -> list[str]:
    """Nodes (not in `gone`) whose replica process changed across the fault: restarted."""
    return sorted(n for n, pid in m_after["pid"].items()
                  if n not in gone and n in m_before["pid"] and pid != m_before["pid"][n])


# -- scenarios -------------------------------------------------------------------------------


def _cycle(c: Cluster, res: Result, fault: Callable[[], object], world: int,
           gone: set[str]) -> dict[str, Any]:
    n0 = len(c.events("rescale"))
    t0 = time.time()
    before = analyse(c, t0)
    ckpt = ckpts(c, t0)
    fault()
    m = wait_world(c, t0, world)
    fill(res, m, sorted(set(ckpt) | set(ckpts(c, t0))), t0)
    restarted = _restarted(before, m, gone)
    res.detail.update(restarted_survivors=restarted, rescale_events=head_rescales(c, n0))
    res.survived = not restarted
    if restarted:
        res.notes = f"survivors restarted: {restarted}; "
    return m


def notice(c: Cluster, style: str) -> Result:
    res = Result(f"{1 if style == 'aws' else 2} {style.upper()} notice", notice=True)
    node = local._victim(c)
    args = ["preempt", node, "--name", c.name, "--style", style]
    if style == "aws":
        args += ["--in", str(local.AWS_HARD_STOP_S)]
    _cycle(c, res, lambda: c.cli(*args), WORLD - 1, {node})
    res.detail["victim"] = node
    res.notes += f"{node}'s replica left the quorum; survivors went on from memory"
    return res


def sigkill(c: Cluster) -> Result:
    res = Result("3 SIGKILL of a node")
    node = local._victim(c)
    _cycle(c, res, lambda: c.cli("kill", node, "--name", c.name), WORLD - 1, {node})
    local._gone(c, [node], res)
    res.notes += f"{node} killed; dropped at the next quorum"
    return res


def notice_and_kill(c: Cluster) -> Result:
    import threading

    res = Result("4 notice + kill at once")
    a = local._victim(c)
    b = local._victim(c, not_=(a,))

    def fault() -> None:
        kill = threading.Thread(target=c.cli, args=("kill", b, "--name", c.name))
        kill.start()
        c.cli("preempt", a, "--name", c.name, "--style", "gcp")
        kill.join()

    _cycle(c, res, fault, WORLD - 2, {a, b})
    local._gone(c, [b], res)
    res.notes += f"{a} notice + {b} kill: 3 -> 1 replica"
    return res


def sigstop(c: Cluster) -> Result:
    res = Result("5 SIGSTOP a node")
    node = local._victim(c)
    n_unresp = len(c.events("node-unresponsive"))
    _cycle(c, res, lambda: c.signal_node(node, signal.SIGSTOP), WORLD - 1, {node})
    unresp = c.node_events("node-unresponsive", node, skip=n_unresp)
    res.detail["unresponsive_events"] = len(unresp)
    c.cli("kill", node, "--name", c.name)
    local._gone(c, [node], res)
    if not unresp:
        res.survived = False
        res.notes += "no node-unresponsive event; "
    failed = len(res.detail["ft"]["failed_steps"])
    res.notes += f"{node} frozen; the quorum re-formed without it ({failed} failed step(s))"
    return res


def head_restart(c: Cluster) -> Result:
    """6: the head and its Lighthouse killed, `up` restarts them on the same ports."""
    res = Result("6 head killed and restarted")
    hj = c.cluster_dir / "head" / "head.json"
    ports = json.loads((c.cluster_dir / "head" / "ports.json").read_text())
    lighthouse0 = json.loads(hj.read_text()).get("lighthouse")
    # a noticed node that still waits for its hard stop makes the `up` right after the
    # restart drain a healthy node (reported separately): this scenario is about the
    # Lighthouse, so it starts once such nodes are reclaimed
    t_wait = time.monotonic()
    while time.monotonic() - t_wait < local.AWS_HARD_STOP_S + 10:
        running = {n["id"] for n in c.status()["nodes"] if n["state"] == "running"}
        if set(c.live_nodes()) <= running:
            break
        time.sleep(1)
    res.detail["waited_for_reclaim_s"] = round(time.monotonic() - t_wait, 1)
    t0 = time.time()
    before = analyse(c, t0)
    killed = c.kill_head()
    ckpt = ckpts(c, t0)
    time.sleep(3)
    c.up()
    head = json.loads(hj.read_text())
    same_ports = (head.get("store_port") == ports.get("store")
                  and str(head.get("url", "")).endswith(f":{ports.get('http')}"))
    # the replicas' managers retry their quorum call (SPOTCTL_FT_QUORUM_RETRY_S) until the
    # restarted Lighthouse answers; if they gave up instead, they would wait out their
    # quorum timeout (SPOTCTL_FT_QUORUM_TIMEOUT_S, 120 s) and restart from the checkpoint
    m = _back_after_restart(c, t0, hj.stat().st_mtime)
    fill(res, m, ckpt, t0)
    restarted = _restarted(before, m, set())
    res.survived = same_ports and res.committed_steps_lost == 0
    res.detail.update(killed=killed, same_ports=same_ports, lighthouse=[lighthouse0,
                      head.get("lighthouse")], restarted_replicas=restarted,
                      same_quorum=bool(m.get("same_quorum")))
    how = (f"replicas restarted from the checkpoint ({sorted(set(m['restored']))})"
           if restarted else "replicas came back from memory")
    if m.get("same_quorum"):
        how += " in the same quorum (the restarted Lighthouse's first had them all)"
    res.notes = f"same ports: {same_ports}; {how}"
    return res


def _back_after_restart(c: Cluster, t0: float, t_head: float,
                        timeout: float = 300) -> dict[str, Any]:
    """wait_world for a head restart, which may re-form nothing: when every replica asks
    the restarted Lighthouse for its first quorum together, that quorum has the id (1) and
    the members of the one before the kill, so the replicas go on in it (torchft keeps its
    process group). Then the recovery is the first commit of all of them after the
    restarted head wrote its head.json, with no failed step since the kill."""
    deadline = time.monotonic() + timeout
    m: dict[str, Any] = {}
    while time.monotonic() < deadline:
        m = analyse(c, t0, WORLD)
        if m["recovered_at"] is not None and m["steps_after_recovery"] >= 3:
            return m
        after = [r for r in records(c) if r.get("ok") and r["t"] > t_head
                 and r.get("replicas") == WORLD]
        if len({r["step"] for r in after}) >= 4 and not m["failed_steps"]:
            m["recovered_at"] = after[0]["t"]
            m["same_quorum"] = True
            return m
        time.sleep(0.4)
    raise Timeout(f"no quorum of {WORLD} replicas training since the restart: "
                  f"{ {k: m.get(k) for k in ('pre', 'resume', 'new_quorums', 'newest')} }"
                  f"\n{c.debug()}")


def join(c: Cluster, which: str) -> Result:
    """7 / 8: the torchrun scenario (convergence, no duplicate, no leak) with the figures
    measured from the step logs: the joiner heals from a live peer, nobody replays."""
    t0 = time.time()
    ckpt = ckpts(c, t0)
    before = analyse(c, t0)
    commits = [r for r in records(c) if r.get("ok")]
    full = bool(commits) and commits[-1].get("replicas") == WORLD  # nobody to join
    res = local.cli_killed_mid_up(c) if which == "7" else local.two_ups(c)
    res.detail["head_figures"] = {"committed_steps_lost": res.committed_steps_lost,
                                  "steps_replayed": res.steps_replayed}
    if full:
        m = wait_steps(c, t0, 3)
        fill(res, m, ckpt, t0, recover=False)
    else:
        m = wait_world(c, t0, WORLD)
        fill(res, m, ckpt, t0)
    restarted = _restarted(before, m, set())
    joiners = [n for n in m["pid"] if n not in before["pid"]]
    res.detail.update(restarted_survivors=restarted, joiners=joiners)
    if restarted:
        res.survived = False
        res.notes = f"survivors restarted: {restarted}; " + res.notes
    return res


def head_settled(c: Cluster, world: int = WORLD, quiet_s: float = 2.0,
                 timeout: float = 90) -> None:
    """Wait until the head's view has caught up with the replicas: it says `world`, its
    newest membership event (train-start / rescale) is at `world`, and no such event came
    for quiet_s. The replicas' step logs run ahead of the head (it records a new quorum
    once rank 0's report of its first step arrives), so a scenario that counts the head's
    rescale events starts from here, or it counts the last join's late event as its own."""
    deadline = time.monotonic() + timeout
    seen: int | None = None
    since = time.monotonic()
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = c.status()
        evs = [e for e in c.events() if e.get("type") in ("rescale", "train-start")]
        if len(evs) != seen:
            seen, since = len(evs), time.monotonic()
        newest = evs[-1] if evs else {}
        at = newest.get("to_world_size", newest.get("world_size"))
        if st.get("world_size") == world and at == world and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.4)
    raise Timeout(f"the head never settled at {world} replicas (status world "
                  f"{st.get('world_size')}, {seen} membership events)\n{c.debug()}")


def calm(c: Cluster, key: str, run: Callable[[], Result]) -> Result:
    """11 / 15 / 16 / 18: faults that must not disturb training: no new quorum, no failed step."""
    head_settled(c)
    t0 = time.time()
    ckpt = ckpts(c, t0)
    res = run()
    res.detail["head_figures"] = {"committed_steps_lost": res.committed_steps_lost,
                                  "steps_replayed": res.steps_replayed}
    m = wait_steps(c, t0, 3)
    fill(res, m, ckpt, t0, recover=False)
    if m["new_quorums"]:
        res.survived = False
        res.notes = f"new quorums {m['new_quorums']}; " + res.notes
    return res


def fake(c: Cluster) -> Result:
    """19: a fake replica with a pickle (trust.fake_replica); afterwards the job trains at
    WORLD replicas again, which is its recovery."""
    head_settled(c)
    t0 = time.time()
    ckpt = ckpts(c, t0)
    res = trust.fake_replica(c, WORLD)
    survived = res.survived
    m = wait_world(c, t0, WORLD)
    fill(res, m, ckpt, t0, recover=False)
    res.survived = survived and res.committed_steps_lost == 0
    return res


def members(c: Cluster) -> dict[str, int]:
    """The replicas of the newest quorum: node -> its process (local rank 0, the only
    worker of a 1-GPU node)."""
    commits = [r for r in records(c) if r.get("ok")]
    if not commits:
        return {}
    q = commits[-1]["q"]
    return {r["node"]: r["pid"] for r in commits if r["q"] == q}


def all_replicas_corrupt_newest(c: Cluster) -> Result:
    """12 on torchft: a checkpoint is read only when no live peer is left, so every
    replica's workers are SIGKILLed at once (the agents restart them) and the newest
    committed checkpoint is corrupted: the job resumes from the one before it."""
    import os

    res = Result("12 all replicas killed, newest checkpoint corrupted")
    state: dict[str, Any] = {}
    t0 = time.time()
    before = analyse(c, t0)

    def fault() -> None:
        quorum = members(c)
        pids = sorted(quorum.values())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)  # let an in-flight async save land first
        steps = c.committed()
        newest = steps[0]
        d = c.ckpt_dir / f"step-{newest:08d}"
        for f in d.iterdir():
            if f.name != "COMMIT":
                f.write_bytes(b"\0garbage" * 64)
        state.update(killed=pids, nodes=sorted(quorum), corrupted=newest,
                     previous=steps[1] if len(steps) > 1 else 0)

    fault()
    m = wait_world(c, t0, WORLD, timeout=240)
    fill(res, m, [state["previous"]], t0)
    restored = sorted(set(m["restored"]))
    restarted = _restarted(before, m, set())
    # every replica restarted (none was left to heal from) and the job went back to the
    # previous checkpoint, not behind it; a late replica may restore a newer one since
    res.survived = (m["resume"] == state["previous"] and state["previous"] in restored
                    and set(state["nodes"]) <= set(restarted))
    res.detail["restarted"] = restarted
    res.detail.update(state)
    res.notes = (f"corrupted step {state['corrupted']}; replicas restored {restored}, "
                 f"job resumed from {m['resume']} (previous committed {state['previous']})")
    return res


def _restore(c: Cluster) -> None:
    t0 = time.time()
    c.up()
    wait_world(c, t0, WORLD, timeout=240)


def run_ft_cluster_scenarios(
    root: Path, only: set[str] | None = None, log: Callable[[str], None] = print,
    garbage_s: float = 30.0, step_sleep_s: float = 0.05,
) -> list[Result]:
    """The torchft sequence on one 3-node cluster; one Result per scenario run.
    step_sleep_s: the training step's stand-in for GPU work (local.run_cluster_scenarios)."""
    c = make_cluster(root, step_sleep_s)
    # (key, scenario, needs 3 replicas back after it): a join (`up`) is the recovery from
    # the loss before it where it can be; a restore runs only if a scenario follows
    plan: list[tuple[str, Callable[[], Result], bool]] = [
        ("11", lambda: calm(c, "11", lambda: local.flaky_metadata(c)), False),
        ("15", lambda: calm(c, "15", lambda: trust.forged_notice(c, WORLD)), False),
        ("16", lambda: calm(c, "16", lambda: trust.head_garbage(c, WORLD, garbage_s)), False),
        ("18", lambda: calm(c, "18", lambda: trust.torchft_kill_route(c)), False),
        ("19", lambda: fake(c), False),
        ("1", lambda: notice(c, "aws"), True),
        ("7", lambda: join(c, "7"), False),
        ("3", lambda: sigkill(c), True),
        ("8", lambda: join(c, "8"), False),
        ("12", lambda: all_replicas_corrupt_newest(c), False),
        ("6", lambda: head_restart(c), False),
        ("2", lambda: notice(c, "gcp"), True),
        ("4", lambda: notice_and_kill(c), True),
        ("5", lambda: sigstop(c), True),
    ]
    keys = [k for k, _, _ in plan if not only or k in only]
    out: list[Result] = []
    victims: list[str] = []
    try:
        t = time.time()
        c.up()
        training_at(c, WORLD, past=EVERY + 5)
        log(f"torchft cluster up and training at {WORLD} replicas in {time.time() - t:.0f}s")
        for key, run, restore in plan:
            if only and key not in only:
                continue
            t = time.time()
            try:
                r = run()
            except Exception as e:  # one broken scenario must not hide the others
                r = Result(f"{key} (failed)", notes=f"{type(e).__name__}: {str(e)[:300]}")
                r.detail["error"] = str(e)[-4000:]
            out.append(r)
            victims += [v for v in (r.detail.get("victim"),) if v]
            log(f"{r.scenario}: survived={r.survived} lost={r.committed_steps_lost} "
                f"replayed={r.steps_replayed} recover={r.recover_s}s ({time.time() - t:.0f}s)")
            after = keys[keys.index(key) + 1:]
            if after and after[0] in ("7", "8") and "error" not in r.detail:
                restore = False  # the join that follows is the recovery
            if after and (restore or (not r.survived and "error" in r.detail)):
                try:
                    _restore(c)
                except Exception as e:
                    r.survived = False
                    r.notes = f"restore after it failed: {str(e)[:200]}"
                    break
        deadline = time.monotonic() + local.AWS_HARD_STOP_S + 10
        while time.monotonic() < deadline and any(c.node_pids(v) for v in victims):
            time.sleep(1)
        for r in out:
            v = r.detail.get("victim")
            if v and c.node_pids(v):
                r.leaks.append(f"{v}: alive after its hard stop")
        if not only or "17" in only:
            try:
                r = trust.rebalance_racing_down(c)
            except Exception as e:
                r = Result("17 (failed)", notes=f"{type(e).__name__}: {str(e)[:300]}")
            out.append(r)
            log(f"{r.scenario}: survived={r.survived} lost={r.committed_steps_lost} "
                f"leaks={r.leaks}")
    finally:
        leaks = c.down()
        if out:
            out[-1].leaks += leaks
        elif leaks:
            out.append(Result("down", leaks=leaks))
    return out
