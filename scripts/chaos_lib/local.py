"""Scenarios on one real local cluster (head, agents, torchrun, gloo workers), run in one
sequence so the suite stays short: each fault is followed by a recovery (`up`) that is
itself a scenario where it can be (CLI killed mid-up, two `up` at once).

Measures, per scenario:
- committed_steps_lost: newest step committed before the fault (COMMIT mtime) minus the
  step the job resumed from (for a corrupted newest checkpoint: the newest intact one).
- steps_replayed: from the workers' own records (every node's sample trace, see
  scripts/chaos_lib/replays.py): the trainings of a step number that an earlier worker
  group had trained already, counted from the fault until the new group is past every step
  trained before it. The head's rescale accounting (highest step it heard of minus the
  resume step, summed over the fault's rescales) stays beside it in detail, as a
  cross-check (detail["head_lost_steps"]; both in detail["replays_disagree"] if they differ).
- recover_s: fault -> training advancing again at the new world size.
- leaks: processes of nodes that should be gone, duplicate or untracked nodes.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import replays, trust
from .cluster import Cluster, Timeout
from .result import Result

WORLD = 3
EVERY = 20
AWS_HARD_STOP_S = 40  # EC2 gives 120 s; shorter so the victim is reclaimed within the run


def _new_rescales(c: Cluster, n0: int, world: int, timeout: float = 150) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    evs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        evs = c.events("rescale")[n0:]
        if any(e.get("to_world_size") == world for e in evs):
            return evs
        time.sleep(0.4)
    raise Timeout(f"no rescale to world {world}; new rescales: {evs}\n{c.debug()}")


def _cycle(
    c: Cluster,
    res: Result,
    fault: Callable[[], None],
    world: int,
    intact_before: Callable[[float], int] | None = None,
) -> None:
    """Inject `fault`, wait for the job to train at `world` again, fill in the measures."""
    n0 = len(c.events("rescale"))
    window = c.replay_window()
    pre = max(c.committed(), default=0) if intact_before is None else 0
    t0 = time.time()
    fault()
    # read now too: keep_last prunes pre-fault checkpoints within seconds of resuming
    before = max(pre, (intact_before or c.committed_before)(t0))
    # a save begun and not committed when the fault struck (a periodic one still
    # uploading, or a drain the fault broke): the steps since `before` are trained again
    in_flight = [s for s in c.uncommitted() if s > before]
    evs = _new_rescales(c, n0, world)
    resume = min(int(e["resume_step"]) for e in evs)
    c.training(world, past=max(int(e["resume_step"]) for e in evs) + 1)
    res.recover_s = round(time.time() - t0, 1)
    res.committed_steps_lost = max(0, before - resume)
    replays.fill(res, window, sum(int(e.get("lost_steps") or 0) for e in evs))
    res.detail.update(
        committed_before=before,
        uncommitted_at_fault=in_flight,
        resume_step=resume,
        rescales=[
            {
                k: e.get(k)
                for k in ("from_world_size", "to_world_size", "reason", "resume_step", "lost_steps")
            }
            for e in evs
        ],
    )
    res.survived = True


Mark = tuple[int, int, replays.Window | None]


def _mark(c: Cluster) -> Mark:
    """Where a fault-free scenario starts: (rescale events so far, newest committed step,
    the workers' trace so far)."""
    return len(c.events("rescale")), max(c.committed(), default=0), c.replay_window()


def _measure(c: Cluster, res: Result, mark: Mark) -> None:
    """The loss figures of a scenario that should not disturb training, measured, not
    assumed: the lowest step the job resumed from or trains at since `mark` (the rescale
    events' resume steps and the step it is at now) against the newest commit before it,
    and the steps the workers trained again since."""
    n0, before, window = mark
    evs = c.events("rescale")[n0:]
    lowest = min([int(e["resume_step"]) for e in evs] + [int(c.status()["step"])])
    res.committed_steps_lost = max(0, before - lowest)
    replays.fill(res, window, sum(int(e.get("lost_steps") or 0) for e in evs))
    res.detail["measured"] = {"committed_before": before, "lowest_step_after": lowest,
                              "rescales": len(evs)}


def _gone(c: Cluster, nodes: list[str], res: Result, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(c.node_pids(n) for n in nodes):
        time.sleep(0.3)
    for n in nodes:
        if c.node_pids(n):
            res.leaks.append(f"{n}: processes {c.node_pids(n)} still alive")


def _restore(c: Cluster) -> None:
    c.up()
    c.training(WORLD, past=c.status()["step"] + 3)


def _victim(c: Cluster, not_: tuple[str, ...] = ()) -> str:
    """A node training now (the newest first: the oldest nodes carry rank 0 more often)."""
    # live in the local cloud *and* running in the job: a node killed by an earlier
    # scenario whose last process is still being reaped is no victim (killing it again
    # changes nothing and the scenario waits for a rescale that never comes)
    training = {n["id"] for n in c.status()["nodes"] if n["state"] == "running"}
    live = [n for n in c.live_nodes() if n not in not_]
    nodes = [n for n in live if n in training] or live
    return sorted(nodes, key=lambda s: int(s[1:]))[-1]


def _post(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"{}")


# -- scenarios -------------------------------------------------------------------------------


def flaky_metadata(c: Cluster) -> Result:
    """11: garbage, 5xx and timeouts from a node's metadata endpoint: no false notice."""
    res = Result("11 flaky metadata replies")
    node = _victim(c)
    vm = c.vm(node)
    # the local "cloud's" control endpoint takes the controller's secret (not a node's)
    token = (c.cluster_dir / "token").read_text().strip()
    n_notices = len(c.events("notice"))
    n_rescales = len(c.events("rescale"))
    mark = _mark(c)
    st0 = c.status()
    t0 = time.time()
    for kind in ("garbage", "5xx", "timeout", "garbage", "5xx"):
        _post(vm["metadata_url"] + "/_spotctl/inject", token, {"kind": kind, "count": 20})
    st = c.training(WORLD, past=st0["step"] + 40, timeout=120)  # ~10 s of polls under faults
    pending = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(
                vm["metadata_url"] + "/_spotctl/state", headers={"Authorization": f"Bearer {token}"}
            ),
            timeout=5,
        ).read()
    )
    _post(vm["metadata_url"] + "/_spotctl/clear", token, {})
    false_notices = [e for e in c.events("notice")[n_notices:] if e.get("node") == node]
    rescales = c.events("rescale")[n_rescales:]
    alive = bool(c.node_pids(node))
    res.survived = not false_notices and not rescales and alive and st["world_size"] == WORLD
    _measure(c, res, mark)
    res.recover_s = 0.0
    res.detail |= {
        "node": node,
        "false_notices": false_notices,
        "rescales": len(rescales),
        "agent_alive": alive,
        "steps_during": st["step"] - st0["step"],
        "seconds": round(time.time() - t0, 1),
        "emulator_state": pending,
    }
    res.notes = f"{node}: 100 faulty replies, no notice, no rescale, agent alive"
    return res


def notice(c: Cluster, style: str) -> Result:
    """1 (aws) / 2 (gcp, 30 s): graceful checkpoint-then-rescale, nothing lost."""
    res = Result(f"{1 if style == 'aws' else 2} {style.upper()} notice", notice=True)
    node = _victim(c)
    args = ["preempt", node, "--name", c.name, "--style", style]
    if style == "aws":
        args += ["--in", str(AWS_HARD_STOP_S)]
    _cycle(c, res, lambda: c.cli(*args), WORLD - 1)
    res.detail["victim"] = node
    res.notes = f"{node} left at a drain checkpoint"
    return res


def sigkill(c: Cluster) -> Result:
    """3: a node SIGKILLed, no notice: loss bounded by the checkpoint interval."""
    res = Result("3 SIGKILL of a node")
    node = _victim(c)
    _cycle(c, res, lambda: c.cli("kill", node, "--name", c.name), WORLD - 1)
    _gone(c, [node], res)
    res.detail["killed"] = node
    res.notes = f"{node} killed; replay <= {EVERY} (interval)"
    return res


def notice_and_kill(c: Cluster) -> Result:
    """4: two nodes lost at once, one with a notice, one killed."""
    res = Result("4 notice + kill at once")
    a = _victim(c)
    b = _victim(c, not_=(a,))

    def fault() -> None:
        # truly at once: the kill may land before the notice is seen, during the drain,
        # or after it committed; each order must end in one bounded restart
        kill = threading.Thread(target=c.cli, args=("kill", b, "--name", c.name))
        kill.start()
        c.cli("preempt", a, "--name", c.name, "--style", "gcp")
        kill.join()

    _cycle(c, res, fault, WORLD - 2)
    _gone(c, [b], res)
    res.notes = f"{a} notice + {b} kill; hard loss bounds the replay"
    return res


def sigstop(c: Cluster) -> Result:
    """5: a node frozen (SIGSTOP on all its processes). The head calls it unresponsive after
    4 s of missed heartbeats; survivors' workers are killed and re-form without it."""
    res = Result("5 SIGSTOP a node")
    node = _victim(c)
    _cycle(c, res, lambda: c.signal_node(node, signal.SIGSTOP), WORLD - 1)
    unresp = c.node_events("node-unresponsive", node)
    res.detail["unresponsive_events"] = len(unresp)
    if not unresp:
        res.survived = False
        res.notes = "no node-unresponsive event"
    # a frozen VM is then reclaimed: SIGKILL works on stopped processes
    c.cli("kill", node, "--name", c.name)
    _gone(c, [node], res)
    res.notes = res.notes or f"{node} frozen; bound: unresponsive after 4 s, then re-form"
    return res


def head_restart(c: Cluster) -> Result:
    """6: the head killed; `up` restarts it on the same ports (ports.json); agents restart
    torchrun when the store is back; the job resumes from the last committed checkpoint."""
    res = Result("6 head killed and restarted")
    ports = json.loads((c.cluster_dir / "head" / "ports.json").read_text())
    st0 = c.status()
    window = c.replay_window()
    t0 = time.time()
    killed = c.kill_head()
    before = c.committed_before(t0)  # now: keep_last prunes them soon after training resumes
    time.sleep(3)  # torchrun agents lose the store and exit; the spotctl agents wait
    c.up()
    head = json.loads((c.cluster_dir / "head" / "head.json").read_text())
    same_ports = head["store_port"] == ports["store"] and head["url"].endswith(f":{ports['http']}")
    st = c.wait_for(
        "training after the head restart",
        lambda s: (
            s["world_size"] == WORLD
            and s["step"] > 0
            and s["nodes"]
            and all((n.get("step") or 0) > 0 for n in s["nodes"] if n["state"] == "running")
        ),
        timeout=180,
    )
    # the new head's accounting of the first incarnation after the restart
    evs = [e for e in c.events() if e["ts"] >= t0 and "resume_step" in e]
    resume = min((int(e["resume_step"]) for e in evs), default=None)
    if resume is None:
        # no event with a resume step: read what the workers loaded from their logs
        resume = _resume_from_logs(c, t0)
    c.training(WORLD, past=st["step"] + 3)
    res.recover_s = round(time.time() - t0, 1)
    res.committed_steps_lost = None if resume is None else max(0, before - resume)
    # the head's figure here: its step before the kill minus the step the job resumed from
    replays.fill(res, window, None if resume is None else max(0, st0["step"] - resume))
    res.survived = same_ports and resume is not None and res.committed_steps_lost == 0
    res.detail.update(
        killed=killed,
        same_ports=same_ports,
        resume_step=resume,
        committed_before=before,
        step_before=st0["step"],
    )
    res.notes = f"same ports: {same_ports}; step before kill {st0['step']} (lower bound)"
    return res


def _resume_from_logs(c: Cluster, t0: float) -> int | None:
    """The lowest step the live nodes' workers resumed from since t0 (status files of nodes
    that left long ago still say what their first incarnation loaded: not theirs)."""
    found = []
    live = set(c.live_nodes())
    for p in c.cluster_dir.glob("nodes/*/status/worker-*.json"):
        try:
            if p.parent.parent.name not in live or p.stat().st_mtime < t0:
                continue
            w = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if "resume_step" in w:
            found.append(int(w["resume_step"]))
    return min(found) if found else None


def cli_killed_mid_up(c: Cluster) -> Result:
    """7: `up` SIGKILLed while it launches; `up` again converges: no duplicate, no leak."""
    res = Result("7 CLI killed mid-up, rerun")
    mark = _mark(c)
    before = set(c.live_nodes())
    intent = c.cluster_dir / "launch-intent.json"
    nodes_dir = c.cluster_dir / "nodes"
    known = {p.name for p in nodes_dir.iterdir()}
    t0 = time.time()
    p = c.popen("up", "--wait", "150")
    saw_intent = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        if intent.exists():
            saw_intent = True
            break
        if {q.name for q in nodes_dir.iterdir()} - known:
            break
        time.sleep(0.002)
    p.kill()
    p.wait()
    intent_left = intent.exists()
    c.up()
    c.training(WORLD, past=c.status()["step"] + 3)
    res.recover_s = round(time.time() - t0, 1)
    live, gone = c.serving_nodes()
    new = sorted(set(live) - before)
    reqs: dict[str, list[str]] = {}
    for n in live:
        reqs.setdefault(c.vm(n)["request_id"], []).append(n)
    if len(live) != WORLD:
        res.leaks.append(f"{len(live)} live nodes, want {WORLD}: {live}")
    for d in nodes_dir.iterdir():
        if d.name not in live and d.name not in gone and c.node_pids(d.name):
            vm = c.vm(d.name)
            if vm.get("state") in ("running", "pending"):
                res.leaks.append(f"{d.name}: untracked live node")
    res.survived = len(live) == WORLD and not intent.exists()
    _measure(c, res, mark)  # the join drains: its rescale's resume step and replays
    res.detail |= {
        "killed_with_intent_on_disk": saw_intent or intent_left,
        "new_nodes": new,
        "request_ids": reqs,
    }
    res.notes = (
        f"killed {'with' if saw_intent or intent_left else 'without'} a launch "
        f"intent on disk; joined {new}"
    )
    return res


def two_ups(c: Cluster) -> Result:
    """8: two `up` (reconcile) runs at once: one acts, the other waits on the lock."""
    res = Result("8 two up/rebalance at once")
    mark = _mark(c)
    # from what the cloud runs: the head's world size may still count a node killed a
    # moment ago (torchft's quorum runs ahead of it)
    missing = WORLD - len(c.serving_nodes()[0])
    t0 = time.time()
    ps = [c.popen("up", "--wait", "150", "--json") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in ps]
    codes = [p.returncode for p in ps]
    launched = []
    for out, _err in outs:
        try:
            launched.append(json.loads(out).get("launched", []))
        except ValueError:
            launched.append(None)
    c.training(WORLD, past=c.status()["step"] + 3)
    res.recover_s = round(time.time() - t0, 1)
    running = [n["id"] for n in c.status()["nodes"] if n["state"] == "running"]
    if len(running) != WORLD:
        res.leaks.append(f"{len(running)} running nodes, want {WORLD}: {running}")
    res.survived = (
        codes == [0, 0] and len(running) == WORLD and sum(len(x or []) for x in launched) == missing
    )
    _measure(c, res, mark)
    res.detail |= {
        "exit_codes": codes,
        "missing": missing,
        "launched": launched,
        "stderr": [e.strip()[-300:] for _, e in outs if e.strip()],
    }
    res.notes = f"launched per run: {launched}"
    return res


def corrupt_newest(c: Cluster) -> Result:
    """12: the newest committed checkpoint corrupted: resume from the previous one."""
    res = Result("12 newest checkpoint corrupted")
    node = _victim(c)
    state: dict[str, Any] = {}

    def fault() -> None:
        c.cli("kill", node, "--name", c.name)  # survivors must reload from disk
        time.sleep(0.5)  # let an in-flight async save land first
        steps = c.committed()
        newest = steps[0]
        d = c.ckpt_dir / f"step-{newest:08d}"
        for f in d.iterdir():
            if f.name != "COMMIT":
                f.write_bytes(b"\0garbage" * 64)
        state.update(corrupted=newest, previous=steps[1] if len(steps) > 1 else 0, t=time.time())

    def intact_before(t0: float) -> int:
        return max(
            (s for s in c.committed() if s != state["corrupted"] and s <= state["corrupted"]),
            default=0,
        )

    _cycle(c, res, fault, WORLD - 1, intact_before)
    res.detail.update(state)
    ok = res.detail["resume_step"] == state["previous"]
    res.survived = res.survived and ok
    res.notes = (
        f"corrupted step {state['corrupted']}, resumed from "
        f"{res.detail['resume_step']} (previous committed {state['previous']})"
    )
    return res


Probe = Callable[[str, Cluster, Result | None], None]


def run_cluster_scenarios(
    root: Path, only: set[str] | None = None, log: Callable[[str], None] = print,
    garbage_s: float = 30.0, step_sleep_s: float = 0.05,
    train_env: dict[str, str] | None = None, probe: Probe | None = None,
) -> list[Result]:
    """The whole sequence on one 3-node cluster. Returns one Result per scenario.
    garbage_s: how long scenario 16 feeds the head garbage (the tests use less: a few
    4 s liveness windows are what it must outlast). step_sleep_s: the training step's
    stand-in for GPU work; the workers' steps are most of such a cluster's CPU, and most
    scenarios wait out fixed times (hard stops, liveness windows), not step counts.
    train_env: added to the training script's environment (the tests: sizes and an
    optimizer whose result an uninterrupted run can match). probe(when, cluster, result):
    called with "up" once the cluster trains, then "before KEY" and "after KEY" around
    each scenario (result: the scenario's), to read the cluster's own records at those
    moments (tests/faults/test_fault_matrix.py checks the rescale cycle with them); it
    must not raise."""
    c = Cluster(
        root / "chaos",
        "chaos",
        f"2..{WORLD}",
        EVERY,
        train_env={"TRAIN_DATASET_SIZE": "4096", "TRAIN_GLOBAL_BATCH": "24",
                   "TRAIN_STEP_SLEEP_S": str(step_sleep_s), **(train_env or {})},
        # a preemption blocks its zone for cooldown_s (default 15 min): replacements must be
        # launchable at once here
        extra_toml="\n[rebalance]\ncooldown_s = 0\n",
    )
    out: list[Result] = []
    plan: list[tuple[str, Callable[[], Result], bool]] = [
        ("11", lambda: flaky_metadata(c), False),
        ("15", lambda: trust.forged_notice(c, WORLD), False),
        ("16", lambda: trust.head_garbage(c, WORLD, garbage_s), False),
        ("1", lambda: notice(c, "aws"), False),
        ("7", lambda: cli_killed_mid_up(c), False),  # also the join back to 3
        ("2", lambda: notice(c, "gcp"), False),
        ("8", lambda: two_ups(c), False),  # also the join back to 3
        ("3", lambda: sigkill(c), True),
        ("4", lambda: notice_and_kill(c), True),
        ("5", lambda: sigstop(c), True),
        ("6", lambda: head_restart(c), False),
        ("12", lambda: corrupt_newest(c), False),
    ]
    victims: list[str] = []
    try:
        t = time.time()
        c.up()
        c.training(WORLD, past=EVERY + 5, timeout=240)
        log(f"cluster up and training at world {WORLD} in {time.time() - t:.0f}s")
        look = probe or (lambda when, c, r: None)
        look("up", c, None)
        for key, run, restore in plan:
            if only and key not in only:
                continue
            t = time.time()
            look(f"before {key}", c, None)
            try:
                r = run()
            except Exception as e:  # one broken scenario must not hide the others
                r = Result(f"{key} (failed)", notes=f"{type(e).__name__}: {str(e)[:300]}")
                r.detail["error"] = str(e)[-4000:]
            look(f"after {key}", c, r)
            out.append(r)
            victims += [v for v in (r.detail.get("victim"),) if v]
            log(
                f"{r.scenario}: survived={r.survived} lost={r.committed_steps_lost} "
                f"replayed={r.steps_replayed} recover={r.recover_s}s ({time.time() - t:.0f}s)"
            )
            if not r.survived and "error" in r.detail:
                try:  # get back to a known state for the next scenario
                    _restore(c)
                except Exception:
                    break
            elif restore:
                try:
                    _restore(c)
                except Exception as e:
                    r.survived = False
                    r.notes = f"restore after it failed: {str(e)[:200]}"
                    break
        # notice victims are reclaimed at their hard stop: none may linger
        deadline = time.monotonic() + AWS_HARD_STOP_S + 10
        while time.monotonic() < deadline and any(c.node_pids(v) for v in victims):
            time.sleep(1)
        for r in out:
            v = r.detail.get("victim")
            if v and c.node_pids(v):
                r.leaks.append(f"{v}: alive after its hard stop")
        if not only or "17" in only:  # last: it takes the cluster down
            look("before 17", c, None)
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
