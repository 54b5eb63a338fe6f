"""Issue 7 e2e: local capacity drops (the job shrinks through a notice), a cron-style
`rebalance` launches nothing while capacity is short, and brings the job back to the
maximum when capacity returns; events and cost figures are checked."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]

CAPACITY = """
[rebalance]
cooldown_s = 5

[local]
price_per_node = 0.9
on_demand_price_per_node = 3.0
capacity = [{ at_s = 0, nodes = 3 }, { at_s = 60, nodes = 2 }, { at_s = 110, nodes = 3 }]
"""


def test_rebalance_follows_capacity(local_cluster):
    c = local_cluster("rebal")
    c.write_spec("2..3", checkpoint_every=10, extra=CAPACITY)
    t0 = time.time()
    c.cli("up", "--wait", "120")
    c.steps_advance(world=3, by=5, timeout=55)

    # capacity 3 -> 2 at 60 s: the newest node gets a notice and the job shrinks
    r = c.wait_event("rescale", 1, timeout=120)[-1]
    assert (r["from_world_size"], r["to_world_size"], r["reason"]) == (3, 2, "notice")
    assert r["lost_steps"] == 0
    reclaim = c.events("capacity-reclaim")
    assert reclaim and reclaim[0]["nodes"] == ["n3"]

    # while capacity is short, rebalance launches nothing
    out = json.loads(c.cli("rebalance", "--name", "rebal", "--json").stdout)
    assert [a for a in out["actions"] if a["type"] == "launch"] == []
    assert len([e for e in c.events("launch")]) == 3

    # capacity returns at 110 s: a cron-style rebalance brings the job back to the maximum
    while time.time() - t0 < 113:
        time.sleep(1)
    deadline = time.time() + 90
    while True:
        out = json.loads(c.cli("rebalance", "--name", "rebal", "--json").stdout)
        if [a for a in out["actions"] if a["type"] == "launch"]:
            break
        assert time.time() < deadline, f"rebalance never launched: {out}"
        time.sleep(3)
    launch = [a for a in out["actions"] if a["type"] == "launch"][0]
    assert launch["count"] == 1 and launch["price"] == 0.9
    r = c.wait_event("rescale", 2, timeout=150)[-1]
    assert (r["from_world_size"], r["to_world_size"], r["reason"]) == (2, 3, "join")
    assert r["lost_steps"] == 0
    c.steps_advance(world=3, by=5)
    # a second rebalance at the maximum does nothing (idempotent)
    out = json.loads(c.cli("rebalance", "--name", "rebal", "--json").stdout)
    assert [a for a in out["actions"] if a["type"] == "launch"] == []

    cost = json.loads(c.cli("cost", "--name", "rebal", "--json").stdout)
    assert cost["spent_usd"] > 0
    assert cost["on_demand_usd"] > cost["spent_usd"]
    assert abs(cost["saved_usd"] - (cost["on_demand_usd"] - cost["spent_usd"])) < 1e-6
    st = c.status()
    assert st["cost_per_hour"] == pytest.approx(0.9 * 3)
    c.cli("down", "--name", "rebal", "--yes")
    assert c.processes() == []
