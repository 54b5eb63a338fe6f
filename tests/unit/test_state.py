from __future__ import annotations

import os
import stat

import pytest

from spotctl.errors import NotFoundError, StateError
from spotctl.state import NodeRow, Store


def test_clusters_nodes_events_roundtrip(tmp_path):
    s = Store(tmp_path)
    s.upsert_cluster("c1", "local", {"gpus": {"min": 1, "max": 2}}, "starting")
    s.set_cluster_state("c1", "running")
    row = s.get_cluster("c1")
    assert row.state == "running" and row.spec["gpus"]["max"] == 2
    n = NodeRow(id="n1", cluster="c1", provider="local", zone="z", instance_type="t", gpus=1,
                state="running", price=0.5, on_demand_price=1.0, launched_at=100.0,
                ended_at=None, request_id="r1", address="127.0.0.1", meta={"k": "v"})
    s.upsert_node(n)
    s.upsert_node(n)  # idempotent
    assert [x.id for x in s.nodes("c1")] == ["n1"]
    s.set_node_state("c1", "n1", "lost", ended=True)
    assert s.nodes("c1", include_ended=False) == []
    assert s.nodes("c1")[0].state == "lost" and s.nodes("c1")[0].ended_at is not None
    s.add_event("c1", "launch", {"node": "n1"}, ts=1.0)
    s.add_event("c1", "rescale", {"lost_steps": 0}, ts=2.0, source_key="head:1")
    s.add_event("c1", "rescale", {"lost_steps": 0}, ts=2.0, source_key="head:1")  # deduped
    assert [e["type"] for e in s.events("c1")] == ["launch", "rescale"]
    assert s.events("c1", "rescale")[0]["lost_steps"] == 0
    with pytest.raises(NotFoundError, match="nosuch"):
        s.get_cluster("nosuch")


def test_private_files_and_lock(tmp_path):
    s = Store(tmp_path)
    cd = s.cluster_dir("c1").ensure()
    tok = cd.token(create=True)
    assert len(tok) > 20 and cd.token() == tok
    assert stat.S_IMODE(os.stat(cd.token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(cd.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    with cd.lock("rebalance"):
        with pytest.raises(StateError, match="another rebalance"):
            with cd.lock("rebalance", wait=False):
                pass
