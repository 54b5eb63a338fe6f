"""Issue 9, the fault matrix as tests: the scenarios of scripts/chaos (scripts/chaos_lib)
with assertions. The cluster scenarios share one 3-node local cluster per engine (run once
per module); each scenario is its own test so a failure names its scenario."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.chaos_lib import cloud, disk, ft, local  # noqa: E402
from scripts.chaos_lib.result import Result, unmeasured  # noqa: E402
from tests.conftest import ENGINES  # noqa: E402

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(1200)]

CLUSTER = ["1", "2", "3", "4", "5", "6", "7", "8", "11", "12", "15", "16", "17"]
HARD = {"3", "4", "5", "6"}  # no notice for (all of) the loss: replay bounded by the interval
CALM = {"7", "8", "11"}  # joins drain, flaky metadata disturbs nothing: no step replayed


# Steps of 0.15 s of stand-in GPU work, not scripts/chaos' 0.05 s: the workers' steps are
# most of a cluster's CPU (a steady 3-node torchrun cluster: 222 steps and 11.3 CPU-s in
# 20 s at 0.05, 106 steps and 6.4 CPU-s at 0.15), while most scenarios wait out fixed
# times (hard stops, liveness windows, the garbage storm); the checks count steps, not
# seconds, so they hold the same
STEP_SLEEP_S = 0.15


class CycleRecords:
    """The probe of the torchrun sequence (local.run_cluster_scenarios): the cluster's own
    records read at the moments the rescale cycle's checks need them (issue 3's cycle,
    tests/e2e/test_rescale.py's before it ran here: the AWS notice is scenario 1, the join
    7, the GCP notice 2, the hard kill 3). Records only: test_rescale_cycle_on_the_cluster
    asserts on them."""

    def __init__(self) -> None:
        self.at: dict[str, Any] = {}
        self.errors: list[str] = []
        self.cluster: Any = None

    def __call__(self, when: str, c: Any, r: Result | None) -> None:
        try:
            self._read(when, c, r)
        except Exception as e:  # noqa: BLE001 - named by the test, never hides a scenario
            self.errors.append(f"{when}: {type(e).__name__}: {e}")

    def _read(self, when: str, c: Any, r: Result | None) -> None:
        from tests.e2e.test_rescale import _rendezvous_pids

        self.cluster = c
        if when == "up":
            self.at["up"] = {"status": c.status(), "processes": len(c.processes())}
        elif when.startswith("before "):
            running = [n["id"] for n in c.status()["nodes"] if n["state"] == "running"]
            self.at[when] = {"rescales": len(c.events("rescale")), "running": running,
                             "t": time.time()}
            if when == "before 1":  # the torchrun agents the store lists before the notice
                self.at[when]["listed"] = _rendezvous_pids(c)
            if when == "before 17":  # the last status before the cluster goes down, and
                # each node's processes then
                from spotctl.agent import proctree

                self.at[when]["status"] = c.status()
                self.at[when]["processes"] = {
                    d.name: proctree.tagged(c.tag(d.name))
                    for d in (c.cluster_dir / "nodes").iterdir()}
        elif when.startswith("after ") and r is not None:
            key = when.split()[1]
            n0 = self.at[f"before {key}"]["rescales"]
            rec: dict[str, Any] = {"rescales": c.events("rescale")[n0:], "events": c.events(),
                                   "victim": r.detail.get("victim"), "detail": r.detail}
            if key == "1":
                v = r.detail["victim"]
                nodes = c.cluster_dir / "nodes"
                rec["report"] = json.loads((nodes / v / "status" / "worker-0.json").read_text())
                rec["agent_log"] = (nodes / v / "agent.log").read_text()
                rec["leave_log"] = (nodes / v / "leave.log").read_text()
                rec["torchrun_logs"] = {
                    n: (nodes / n / "torchrun.log").read_text()
                    for n in self.at["before 1"]["running"] if n != v}
            self.at[when] = rec


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Result],
                                                                     CycleRecords]:
    # 16's garbage storm for 12 s, not scripts/chaos' 30 s: three 4 s liveness windows.
    # The rescale cycle's sizes and optimizer (tests/e2e/test_rescale.py): the newest
    # checkpoint must equal plain training of as many steps
    from tests.e2e.test_rescale import CLIP, LR, OPTIM, G, N

    probe = CycleRecords()
    rows = local.run_cluster_scenarios(
        tmp_path_factory.mktemp("chaos"), log=lambda m: None, garbage_s=12.0,
        step_sleep_s=STEP_SLEEP_S, probe=probe,
        train_env={"TRAIN_DATASET_SIZE": str(N), "TRAIN_GLOBAL_BATCH": str(G),
                   "TRAIN_OPTIM": OPTIM, "TRAIN_LR": LR, "TRAIN_CLIP": CLIP})
    return {r.scenario.split()[0]: r for r in rows}, probe


@pytest.fixture(scope="module")
def cluster_rows(cluster_run: tuple[dict[str, Result], CycleRecords]) -> dict[str, Result]:
    return cluster_run[0]


def _replays_from_workers(r: Result) -> None:
    """torchrun: steps_replayed is the workers' own count (their sample trace, every node's),
    complete (the new worker group got past every step trained before it), not the head's
    lost_steps (kept in detail["head_lost_steps"] as a cross-check)."""
    w = r.detail.get("workers_replayed")
    assert w is not None, f"{r.scenario}: no count from the workers' trace: {r.detail}"
    assert w["settled"] and r.steps_replayed == w["replayed"], r.detail


def _check(r: Result) -> None:
    assert r.survived, f"{r.scenario}: {r.notes}\n{r.detail}"
    # every figure was measured, or is declared not applicable and left null (never 0)
    assert unmeasured(r) == [], (r.scenario, unmeasured(r))
    if "committed_steps_lost" not in r.not_applicable:
        assert r.committed_steps_lost == 0, r.detail
    assert r.leaks == [], r.leaks


@pytest.mark.parametrize("key", CLUSTER)
def test_cluster_scenario(cluster_rows: dict[str, Result], key: str) -> None:
    assert key in cluster_rows, f"scenario {key} did not run: {sorted(cluster_rows)}"
    r = cluster_rows[key]
    _check(r)
    if key == "17":  # the cluster goes down: no replays to count
        return
    _replays_from_workers(r)
    if r.notice or key in CALM:
        assert r.steps_replayed == 0, r.detail
    if key in HARD:
        # back to the newest commit: the interval, and the step in flight; when a save had
        # begun and not committed at the fault (a periodic one uploading, or a drain the
        # kill broke: docs/concepts.md), the steps it covered too, up to one more interval
        most = local.EVERY + 1 + (local.EVERY if r.detail.get("uncommitted_at_fault") else 0)
        assert r.steps_replayed is not None and r.steps_replayed <= most, r.detail
    if key == "12":  # the newest checkpoint is unusable: back to the one before it
        assert r.steps_replayed is not None and r.steps_replayed <= 2 * local.EVERY + 1, r.detail
        # the workers had trained up to the corrupted step and trained the steps since the
        # previous checkpoint again: the count sees each of them
        assert r.steps_replayed >= r.detail["corrupted"] - r.detail["previous"], r.detail


def test_rescale_cycle_on_the_cluster(cluster_run: tuple[dict[str, Result], CycleRecords]) -> None:
    """Issue 3's checkpoint-then-rescale cycle on the torchrun sequence's cluster (it ran on
    a cluster of its own in tests/e2e/test_rescale.py): an AWS notice (scenario 1), the
    join back (7), a GCP notice (2) and a hard kill (3), judged by the workers' own
    records (their reports, the leaver's agent and leave logs, the survivors' torchrun
    logs, the sample trace) beside the head's events; then every sample of an epoch once
    and the newest checkpoint equal to plain training. The replay counts of each scenario
    are test_cluster_scenario's."""
    from tests.e2e.test_rescale import (
        _check_exactly_once,
        _check_matches_uninterrupted,
    )

    rows, probe = cluster_run
    assert not probe.errors, probe.errors
    at, c = probe.at, probe.cluster
    # three nodes in one worker group, and what `status --json` says of each
    st = at["up"]["status"]
    running = [n for n in st["nodes"] if n["state"] == "running"]
    assert {tuple(n["incarnations"]) for n in running} == {tuple(running[0]["incarnations"])}
    assert len(running[0]["incarnations"]) == 1, st
    assert st["world_size"] == sum(n["gpus"] for n in running) == 3, st
    assert {n["id"] for n in st["nodes"]} == {"n1", "n2", "n3"}
    assert st["provider"] == "local" and st["cost_per_hour"] == 0.0
    keys = {"id", "state", "zone", "instance_type", "gpus", "step", "heartbeat_age_s"}
    assert all(keys <= n.keys() and n["state"] == "running" for n in st["nodes"]), st
    assert at["up"]["processes"] > 6  # head + 3 x (vm, agent, torchrun, worker)

    # 1. AWS-style notice: the victim leaves, the survivors go on at 2 with no lost step
    one = at["after 1"]
    r = next(e for e in one["rescales"] if e["reason"] == "notice")
    assert (r["from_world_size"], r["to_world_size"]) == (3, 2) and r["lost_steps"] == 0, r
    v = one["victim"]
    # the checkpoint the survivors resumed from is the step the leaver's own worker
    # drained at (its report), not only what the head wrote into the event
    rep = one["report"]
    assert rep["phase"] == "drained" and rep["drain_step"] == r["resume_step"], (rep, r)
    assert r["notice_to_resume_s"] > 0
    # docs/operating.md: each rescale event carries the new workers' start-up and when
    # they were forked
    ws = r["worker_start"]
    assert {"imports", "process_group", "restore", "first_step", "started_at"} <= set(ws), r
    assert 0 < r["worker_spawned_after_s"] < r["notice_to_resume_s"], r
    assert all(ws[k] >= 0 for k in ("imports", "process_group", "restore", "first_step")), r
    # docs/concepts.md: the leaving node is out of the rendezvous (or silent for 4 s:
    # counted out) before the survivors are released
    evs = one["events"]
    notice = next(e for e in evs if e["type"] == "notice" and e["node"] == v
                  and e["ts"] >= at["before 1"]["t"])
    out = min(e["ts"] for e in evs if e.get("node") == v and e["ts"] >= notice["ts"]
              and e["type"] in ("leave", "node-unresponsive"))
    release = next(e for e in evs if e["type"] == "drain-release" and e["ts"] >= notice["ts"])
    assert out <= release["ts"] and release["why"] == "leavers gone", (out, release, evs[-20:])
    # its agent took its torchrun out of the rendezvous under the pid it is listed with
    # (forked by the zygote, torchrun is not the process the agent started), checked
    # against the rendezvous as the store held it before the notice (under load the
    # survivors may have counted the silent node out before its agent's leave ran, so
    # "listed before" can be False then)
    started = re.findall(r"torchrun started \(pid (\d+)\)", one["agent_log"])
    left = re.findall(r"rendezvous leave of \S+ pid (\d+): listed before (\w+), gone after "
                      r"(\w+)", one["leave_log"])
    assert started and left and "left the rendezvous (ok)" in one["agent_log"], (
        one["agent_log"][-3000:], one["leave_log"][-2000:])
    pid, _, gone = left[-1]
    listed = at["before 1"]["listed"]
    assert int(pid) in listed and pid != started[-1] and gone == "True", (listed, left)
    # each survivor's torchrun restarted its workers: because they exited non-zero, or
    # (the first survivor back in the rendezvous makes the other's torchrun see a new
    # round) because of that membership change; no worker ever exited 0 (done)
    exits: list[int] = []
    for n, log in one["torchrun_logs"].items():
        codes = [int(x) for x in re.findall(r"failed \(exitcode: (-?\d+)\)", log)]
        exits += codes
        assert 0 not in codes and (codes or "new nodes from group_rank" in log), (n, codes)
    assert exits, "no survivor's workers exited non-zero"

    # 7. the join: `up` (killed mid-launch, then again) reconciles back to 3 through a drain
    joins = [e for e in at["after 7"]["rescales"] if e["reason"] == "join"]
    assert joins and (joins[-1]["from_world_size"], joins[-1]["to_world_size"]) == (2, 3), joins
    assert all(e["lost_steps"] == 0 for e in joins), joins

    # 2. GCP-style notice (30 s to hard stop): committed well inside the window
    two = at["after 2"]
    r = next(e for e in two["rescales"] if e["reason"] == "notice")
    assert (r["from_world_size"], r["to_world_size"]) == (3, 2) and r["lost_steps"] == 0, r
    notice = [e for e in two["events"] if e["type"] == "notice" and e["node"] == two["victim"]
              and e["ts"] >= at["before 2"]["t"]][-1]
    committed = [e for e in two["events"]
                 if e["type"] == "drain-committed" and e["ts"] >= notice["ts"]][0]
    assert committed["ts"] - notice["ts"] < 15.0
    assert notice["deadline"] - notice["ts"] <= 31.0  # what the agent counts (GCP: 30)

    # 3. hard failure, no notice: the head's loss bounded by the checkpoint interval too
    r = next(e for e in at["after 3"]["rescales"] if e["reason"] == "failure")
    assert (r["from_world_size"], r["to_world_size"]) == (3, 2) and r["engine"] == "torchrun", r
    assert 0 <= r["lost_steps"] <= local.EVERY + 1, r

    # the ends: the GCP notice's node was reclaimed at its hard stop with all its
    # processes (no agent, torchrun, zygote or worker of it left), the killed node is
    # lost (no notice came for it)
    last = at["before 17"]["status"]
    state = {n["id"]: n["state"] for n in last["nodes"]}
    assert state[two["victim"]] in ("preempted", "lost"), state
    assert at["before 17"]["processes"][two["victim"]] == [], at["before 17"]["processes"]
    assert state[rows["3"].detail["killed"]] == "lost", state
    # 17 took the cluster down (its leaks: none): the journal has it, and `down` of an
    # unknown cluster says so in one line and fails with "not found" (3)
    assert any(e["type"] == "down" for e in c.events())
    p = c.cli("down", "--name", "nosuch", "--yes", check=False)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == [
        "error: no cluster named 'nosuch' (see `spotctl list`)"]
    # every sample of an epoch once, and the newest checkpoint equals plain training
    from spotctl.elastic.checkpoint import committed_steps

    _check_exactly_once(c.trace_dir)
    newest = committed_steps(c.ckpt_dir)[0]
    assert newest >= last["last_checkpoint_step"]
    _check_matches_uninterrupted(c, newest)


# The torchft engine (scripts/chaos --engine torchft): one more 3-node cluster, the
# scenarios that differ on torchft. Not here (to keep CI short; scripts/chaos runs them):
# 2 (1 with the other notice style), 4, and 6 (the head and its Lighthouse restarted:
# tests/e2e/test_rescale.py -k replica_groups restarts them under a torchft cluster and
# checks the same addresses and that no worker restarted).
FT_CLUSTER = ["11", "15", "16", "1", "7", "3", "8", "12", "5", "17"]
FT_CALM = {"7", "8", "11", "15", "16"}  # no step may be replayed
FT_KILLS = {"3", "5"}  # the step in flight fails and is run again: bounded, no restart
FT_KILL_REPLAY = 2


@pytest.fixture(scope="module")
def ft_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the 'ft' extra)")
    rows = ft.run_ft_cluster_scenarios(tmp_path_factory.mktemp("chaos-ft"),
                                       only=set(FT_CLUSTER), log=lambda m: None,
                                       garbage_s=12.0, step_sleep_s=STEP_SLEEP_S)
    return {r.scenario.split()[0]: r for r in rows}


def _garbage_only_moved_the_quorum(r: Result) -> bool:
    """16 on torchft, everything but the quorum: the head neither died nor restarted, no
    node went unresponsive, no 5xx, training advanced, no step failed."""
    d = r.detail
    return (not d["head_restarted"] and not d["unresponsive"]
            and not [k for k in d["answers"] if k.startswith("5") and k != "505"]
            and d["steps"][1] > d["steps"][0] and d["ft"]["failed_steps"] == [])


def _late_replica_only_moved_the_quorum(r: Result, key: str) -> bool:
    """11 / 15 on torchft, everything but the quorum: the fault was ignored (no false
    notice, the agent alive) or refused (every forged call 401/403, no notice recorded),
    and no step failed or ran twice and no process restarted. What may move the quorum on
    a loaded 2-core machine was a replica more than the join timeout (then 100 ms) late to
    one quorum: torchft formed it without that replica, which healed back at the next (seen
    once in CI, scenario 15: 2 new quorums). Since issue 28 a late replica that heartbeats
    is waited for (join timeout 60 s); only heartbeats more than 250 ms apart
    (SPOTCTL_FT_HEARTBEAT_TIMEOUT_MS) would still move it."""
    d = r.detail
    ft_ok = (d["ft"]["failed_steps"] == [] and d["ft"]["replayed_commits"] == 0
             and d["ft"]["processes_started"] == 0)
    if key == "15":
        own = all(c in (401, 403) for c in d["codes"].values()) and not d["forged_notices"]
    else:
        own = not d["false_notices"] and d["agent_alive"]
    return ft_ok and own


@pytest.mark.parametrize("key", FT_CLUSTER)
def test_torchft_scenario(ft_rows: dict[str, Result], key: str) -> None:
    assert key in ft_rows, f"scenario {key} did not run: {sorted(ft_rows)}"
    r = ft_rows[key]
    # 11, 15, 16 may move the quorum on this loaded machine (a replica taken for gone, see
    # above), and then only that: nothing lost, replayed, failed or restarted. Whether it
    # moved is no pass/fail figure (an xfail(strict=False) test of it
    # could never fail); scripts/chaos --engine torchft reports it. A scenario that raised
    # has no figures to weigh: _check reports its error
    if key == "16" and "error" not in r.detail:
        r = dataclasses.replace(r, survived=r.survived or _garbage_only_moved_the_quorum(r))
    if key in ("11", "15") and "error" not in r.detail:
        r = dataclasses.replace(
            r, survived=r.survived or _late_replica_only_moved_the_quorum(r, key))
    _check(r)
    if key == "17":
        return
    # measured from the replicas' own step logs
    assert "ft" in r.detail, r.detail
    if r.notice:  # the replica's own graceful leave: nothing lost, nothing run twice,
        assert r.steps_replayed == 0, r.detail  # the survivors never restarted
        assert r.detail["restarted_survivors"] == [], r.detail
        assert r.detail["ft"]["failed_steps"] == [], r.detail
    if key in FT_CALM:
        assert r.steps_replayed == 0, r.detail
    if key in {"7", "8"}:  # the joiner healed from a live peer: nobody restarted
        assert r.detail["restarted_survivors"] == [], r.detail
    if key in FT_KILLS:
        assert r.steps_replayed is not None and r.steps_replayed <= FT_KILL_REPLAY, r.detail
        assert r.detail["restarted_survivors"] == [], r.detail
    if key == "12":  # no live peer left: back to the checkpoint before the corrupted one
        assert r.detail["ft"]["resume"] == r.detail["previous"], r.detail
        assert r.steps_replayed is not None and r.steps_replayed <= 2 * ft.EVERY + 1, r.detail


# on the default engine (torchft): the torchrun engine's run of it (a minute) was cut for
# CI time; its drains are test_rescale's and the cluster scenarios', and the empty pool is
# the controller's, the same for both (scripts/chaos runs it on either)
@pytest.mark.parametrize("engine", ENGINES[1:])
def test_capacity_exhausted_while_training(tmp_path: Path, engine: str) -> None:
    r = cloud.capacity_everywhere(tmp_path, engine)
    _check(r)
    # measured on the training job: the reclaim was a notice (no replay), the replacement
    # launched nothing while the pool was empty and the job kept training at 2
    assert r.not_applicable == [] and r.steps_replayed == 0, r.detail
    assert r.detail["exhausted_up"]["out"]["launched"] == [], r.detail
    assert r.detail["steps_at_2_while_exhausted"] >= 5, r.detail
    assert all(z in m for z, m in r.detail["api"]["errors"].items()), r.detail
    # from the replicas' step logs: a graceful leave, then a heal from a live peer
    for cycle in (r.detail["reclaim"], r.detail["join"]):
        assert cycle["restarted_survivors"] == [], cycle
        assert cycle["ft"]["failed_steps"] == [] and cycle["ft"]["replayed_commits"] == 0


def test_throttling_and_5xx_are_retried() -> None:
    r = cloud.throttling()
    _check(r)
    # no job trains in this one: its job figures are null, not a made-up 0
    assert r.committed_steps_lost is None and r.steps_replayed is None
    assert r.recover_s is not None and r.detail["insert_calls"] == 3


def test_unmeasured_figures_fail_the_check() -> None:
    made_up = Result("x", survived=True, recover_s=1.0)  # lost/replayed never filled in
    assert unmeasured(made_up) == ["committed_steps_lost", "steps_replayed"]
    with pytest.raises(AssertionError):
        _check(made_up)
    zero_for_na = Result("y", survived=True, committed_steps_lost=0, steps_replayed=0,
                         recover_s=1.0, not_applicable=["steps_replayed"])  # fmt: skip
    assert unmeasured(zero_for_na) == ["steps_replayed (not applicable, yet set)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_disk_full(tmp_path: Path, engine: str) -> None:
    """On torchft the periodic checkpoint is the only one (a one-replica cluster): its
    failed save must not fail a step either (a failed step would count as replayed)."""
    r = disk.disk_full(tmp_path, engine)
    if r.blocked:
        pytest.skip(r.blocked)
    _check(r)
    assert r.detail["steps_while_full"] >= 3 * disk.EVERY
    assert r.steps_replayed == 0, r.detail  # a failed save fails no step
    if engine == "torchrun":
        _replays_from_workers(r)
    else:  # the replica's own reports: no failed step, the same process throughout
        assert r.detail["restarted_replicas"] == [] and "head_lost_steps" in r.detail, r.detail


# 14 (a node cut off from the network) runs in tests/e2e/test_network_partition.py (both
# engines), with the same mechanism scripts/chaos uses (nodes in network namespaces, one
# link taken down).
