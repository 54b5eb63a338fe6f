"""Fault 14: a node cut off from the network. Nodes run in network namespaces of the
test's own (`[local] netns = true`); taking one node's link down must not hang the
survivors: the head declares it unresponsive, their workers are restarted without it
and training goes on at the smaller world size, losing at most a checkpoint interval."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from spotctl.providers.base import ProviderContext
from spotctl.providers.local.provider import LocalProvider
from spotctl.spec import ClusterSpec
from spotctl.state import Store

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(400)]


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    p = subprocess.run(["ip", "netns", "add", "spotctl-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "spotctl-probe"], capture_output=True)
    return None if p.returncode == 0 else f"cannot create a network namespace: {p.stderr}"


@pytest.mark.skipif(_netns_ok() is not None, reason=str(_netns_ok()))
def test_node_cut_off_from_the_network(local_cluster):
    c = local_cluster("part")
    c.write_spec("2..3", checkpoint_every=10, extra="[local]\nnetns = true\n")
    c.cli("up", "--wait", "150")
    st = c.steps_advance(world=3, by=10, timeout=200)
    c.assert_one_world(st)
    n3 = next(n for n in st["nodes"] if n["id"] == "n3")
    assert n3["zone"]  # nodes really live at their own addresses:
    store = Store(c.home)
    spec = ClusterSpec.model_validate(store.get_cluster("part").spec)
    prov = LocalProvider(ProviderContext("part", spec, store.cluster_dir("part")))
    addrs = {i.id: i.address for i in prov.list("part")}
    assert len(set(addrs.values())) == 3 and "127.0.0.1" not in addrs.values()

    prov.isolate("n3")
    r = c.wait_event("rescale", 1, timeout=180)[-1]
    assert (r["from_world_size"], r["to_world_size"], r["reason"]) == (3, 2, "failure")
    assert 0 <= r["lost_steps"] <= 10 + 1
    st = c.steps_advance(world=2, by=10, timeout=120)
    assert next(n for n in st["nodes"] if n["id"] == "n3")["state"] == "unresponsive"
    assert any(e["type"] == "node-unresponsive" and e["node"] == "n3" for e in c.events())
    c.cli("down", "--name", "part", "--yes")
    assert c.processes() == []
    assert prov.net is not None and prov.net.leftovers() == []
