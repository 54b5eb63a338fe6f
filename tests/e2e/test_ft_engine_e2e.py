"""A local cluster on the torchft engine ([train] engine = "torchft"), driven through the
CLI: 3 nodes, an AWS-style notice (the node's replica commits its step and leaves the
quorum), a hard kill, and a join by `up`; the survivor never restarts, never repeats or
skips a step, and every replica has the same model after every step."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.conftest import last_step, node_steps, up_ft_train, wait_until

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_torchft_notice_kill_join(local_cluster):
    c = local_cluster("ftr")
    logs = up_ft_train(c, 3)

    # notice: n1's replica commits its step and leaves; the others go on from memory
    c.cli("preempt", "n1", "--name", "ftr", "--style", "aws")
    c.wait_for("n1 left", lambda s: next(n for n in s["nodes"] if n["id"] == "n1")["state"]
               in ("left", "preempted", "lost"), 120)
    wait_until(lambda: last_step(logs, "n2") >= last_step(logs, "n1") + 10, 120, "n2 past n1's leave",
               0.5, c.debug)
    left_at = last_step(logs, "n1")

    # hard kill of n3: dropped at the next quorum
    k0 = last_step(logs, "n2")
    c.cli("kill", "n3", "--name", "ftr")
    wait_until(lambda: last_step(logs, "n2") >= k0 + 10, 120, "n2 past the kill", 0.5, c.debug)

    # join: `up` launches a node whose replica recovers from n2 while n2 trains
    j0 = last_step(logs, "n2")
    c.cli("up", "--wait", "120")
    joiner = wait_until(lambda: next((p.stem for p in logs.glob("n*.jsonl")
                                      if p.stem not in ("n1", "n2", "n3")
                                      and len(node_steps(logs, p.stem)) >= 5), None),
                        240, "a joined replica training", 0.5, c.debug)
    events = c.events()
    assert c.status()["engine"] == "torchft"
    c.cli("down", "--name", "ftr", "--yes")

    # the head drained nobody and killed nobody's workers: torchft regrouped by itself,
    # and every membership change is a rescale event naming the engine
    assert not [e for e in events if e["type"].startswith("drain-")], events
    rescales = [e for e in events if e["type"] == "rescale"]
    assert rescales and all(e["engine"] == "torchft" for e in rescales), rescales
    noticed = [e for e in rescales if e["reason"] == "notice"]
    assert noticed and noticed[0]["lost_steps"] == 0, rescales

    n2 = [s["step"] for s in node_steps(logs, "n2")]
    assert n2 == list(range(n2[0], n2[-1] + 1)), "the survivor lost or repeated a step"
    assert left_at + 1 in n2
    first = node_steps(logs, joiner)[0]["step"]
    assert first > j0, "the joiner started from scratch instead of a live peer's state"
    # same model on every replica after every step (its loss over the whole dataset)
    by_step: dict[int, float] = {s["step"]: s["full_loss"] for s in node_steps(logs, "n2")}
    for n in ("n1", "n3", joiner):
        for s in node_steps(logs, n):
            if s["step"] in by_step:
                assert math.isclose(s["full_loss"], by_step[s["step"]], rel_tol=1e-5), (n, s)
