"""The local provider's launch is idempotent by request id, also after a launch that was
interrupted half-way (the CLI killed between making a node and starting it)."""

from __future__ import annotations

import json
import time

import pytest

from spotctl.agent import proctree
from spotctl.providers.base import ProviderContext
from spotctl.providers.local.provider import LocalProvider
from spotctl.spec import ClusterSpec
from spotctl.state import Store, write_json_atomic

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def provider(tmp_path):
    (tmp_path / "train.py").write_text("")
    spec = ClusterSpec.model_validate({"name": "lp", "gpus": "1..8",
                                       "train": {"script": str(tmp_path / "train.py"),
                                                 "engine": "torchrun"}})
    (tmp_path / "home").mkdir()
    store = Store(tmp_path / "home")
    cdir = store.cluster_dir("lp")
    p = LocalProvider(ProviderContext("lp", spec, cdir))
    p.prepare()
    cdir.head_dir.mkdir(parents=True)
    # a head address nobody answers at: the agents just keep retrying until terminated
    write_json_atomic(cdir.head_dir / "head.json",
                      {"url": "http://127.0.0.1:9", "store_host": "127.0.0.1", "store_port": 9})
    yield p
    p.terminate([i.id for i in p.all_instances()])
    deadline = time.monotonic() + 60  # the node trees end on their signals, not at once (a loaded machine: seconds)
    while proctree.tagged_prefix(str(cdir.path) + "/") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proctree.tagged_prefix(str(cdir.path) + "/") == []


def test_launch_is_idempotent_and_completes_interrupted_requests(provider):
    offer = provider.offers()[0]
    first = provider.launch(offer, 2, "req-1")
    assert [i.id for i in first] == ["n1", "n2"]
    again = provider.launch(offer, 2, "req-1")
    assert [i.id for i in again] == ["n1", "n2"]
    # an interrupted launch of req-2: n3 complete but never started, n4 half-made (its
    # vm.json written, the launch killed before the rename that completes a node)
    nodes = provider.nodes_dir
    (nodes / ".n4.partial").mkdir()
    write_json_atomic(nodes / ".n4.partial" / "vm.json", {
        "node_id": "n4", "request_id": "req-2", "zone": offer.zone, "gpus": 1, "price": 0.0,
        "on_demand_price": 0.0, "launched_at": time.time(), "state": "pending", "pid": None})
    (nodes / "n3").mkdir()
    write_json_atomic(nodes / "n3" / "vm.json", {
        "node_id": "n3", "request_id": "req-2", "zone": offer.zone, "gpus": 1, "price": 0.0,
        "on_demand_price": 0.0, "launched_at": time.time(), "state": "pending", "pid": None})
    (nodes / "n3" / "token").write_text(provider.cdir.token())
    (nodes / "n3" / "agent.json").write_text((nodes / "n1" / "agent.json").read_text()
                                              .replace("/n1", "/n3").replace('"n1"', '"n3"'))
    done = provider.launch(offer, 2, "req-2")
    assert [i.id for i in done] == ["n3", "n4"]
    assert not (nodes / ".n4.partial").exists()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {n: json.loads((nodes / n / "vm.json").read_text())["state"]
                  for n in ("n1", "n2", "n3", "n4")}
        if set(states.values()) == {"running"}:
            break
        time.sleep(0.3)
    assert set(states.values()) == {"running"}, states
    assert sorted(i.id for i in provider.list("lp")) == ["n1", "n2", "n3", "n4"]
    provider.terminate(["n2", "n2", "nosuch"])  # repeated and unknown ids are no-ops
    assert sorted(i.id for i in provider.list("lp")) == ["n1", "n3", "n4"]
