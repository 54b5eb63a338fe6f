"""Issue 9, the fault matrix as tests: the scenarios of scripts/chaos (scripts/chaos_lib)
with assertions. The cluster scenarios share one 3-node local cluster per engine (run once
per module); each scenario is its own test so a failure names its scenario."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

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


@pytest.fixture(scope="module")
def cluster_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    # 16's garbage storm for 12 s, not scripts/chaos' 30 s: three 4 s liveness windows
    rows = local.run_cluster_scenarios(tmp_path_factory.mktemp("chaos"), log=lambda m: None,
                                       garbage_s=12.0, step_sleep_s=STEP_SLEEP_S)
    return {r.scenario.split()[0]: r for r in rows}


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
