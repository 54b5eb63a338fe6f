"""The head runs the reconcile loop ([rebalance] on_head, the default on local clusters):
a preempted node is replaced with nothing running on the controller after `up` returns
(no cron line, no `rebalance --watch`), judged by the nodes' own worker reports."""

from __future__ import annotations

import importlib.util
import json

import pytest

from spotctl.agent import proctree
from spotctl.head.client import HeadClient
from tests.conftest import wait_until

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                       reason="torchft is not installed (the 'ft' extra)"),
]  # fmt: skip


def _report(c, node: str) -> dict | None:
    try:
        return json.loads((c.cluster_dir / "nodes" / node / "status" / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None


def test_the_head_replaces_a_preempted_node_on_its_own(local_cluster):
    c = local_cluster("hreb")
    c.write_spec("2", engine="torchft", head_rebalances=True,
                 train_env={"TRAIN_DATASET_SIZE": "4096", "TRAIN_GLOBAL_BATCH": "32"})
    out = c.cli("up", "--wait", "120").stdout
    assert "the head replaces lost nodes itself" in out, out
    st = c.steps_advance(world=2, by=5, timeout=180)
    loop = st["rebalancer"]
    assert loop is not None and loop["running"], st
    head = json.loads((c.cluster_dir / "head" / "head.json").read_text())
    loop_pid = HeadClient(head["url"], (c.cluster_dir / "token").read_text().strip()).status()[
        "rebalancer"]["pid"]
    # the loop is the head's own child: it lives and dies with the head
    with open(f"/proc/{loop_pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == head["pid"]
    survivor = c.worker_pids(["n2"])

    # a notice on n1, then nothing more from this side: the head's loop launches n3
    c.cli("preempt", "n1", "--name", "hreb", "--style", "aws")
    wait_until(lambda: (r := _report(c, "n3")) is not None and r["replicas"] == 2
               and r["phase"] == "train", 180, "n3's worker training in a quorum of 2", 1.0,
               lambda: (c.cluster_dir / "head" / "rebalance.log").read_text()[-3000:]
               + c.debug())  # fmt: skip
    first = _report(c, "n3")
    wait_until(lambda: (r := _report(c, "n3")) is not None and r["step"] >= first["step"] + 5,
               60, "n3's worker stepping", 0.5)
    # the worker that left is the one that trained before the notice (its own report)
    left = _report(c, "n1")
    assert left is not None and left["phase"] == "drained", left
    # the survivor trained on through the notice and the join: same process
    assert c.worker_pids(["n2"]) == survivor
    launch = next(e for e in c.events("launch") if e["node"] == "n3")
    assert launch["reason"], launch
    log = (c.cluster_dir / "head" / "rebalance.log").read_text()
    runs = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    assert any("n3" in r.get("launched", []) for r in runs), log[-3000:]
    st = c.status()
    assert st["rebalancer"]["running"] and st["rebalancer"]["last_run_age_s"] is not None, st

    # down stops the loop with everything else: no process of the cluster left
    c.cli("down", "--name", c.name, "--yes")
    wait_until(lambda: c.processes() == [], 30, "no process of the cluster left", 0.2,
               lambda: str(c.processes()))
    assert not proctree.alive(loop_pid), "the reconcile loop outlived `down`"
