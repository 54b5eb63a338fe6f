"""Issue 31 (6, 8): the head believes a node only within bounds.

A node's own credential used to falsify the journal: a heartbeat with world 2^20 and step
2^62 made `status` show world 0 and step 4.6e18 and journaled a rescale to 1048576 with
4.6e18 lost steps; a `startup` without `started_at` was an HTTP 500 (and the real rescale
was lost); a node's events could push everyone else's out of the in-memory window. A real
HeadServer on loopback, requests over real sockets with the node's own token."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.head import server as head_server
from spotctl.head.auth import node_token
from spotctl.head.server import HeadServer
from tests.security.conftest import serve_head

SECRET = secrets.token_urlsafe(32)
CTL = f"Bearer {SECRET}"


def _node(nid: str) -> str:
    return f"Bearer {node_token(SECRET, nid)}"


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    with serve_head(tmp_path, SECRET) as srv:
        yield srv


def call(head: HeadServer, method: str, path: str, auth: str,
         body: Any = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(head.url + path, data=data, method=method)
    req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def worker(step: int = 0, world: int = 1, inc: str = "i1", **kw: Any) -> dict[str, Any]:
    return {"rank": 0, "world_size": world, "step": step, "phase": "train",
            "incarnation": inc, "first_step_at": time.time(), **kw}


def beat(head: HeadServer, nid: str, *ws: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return call(head, "POST", "/api/heartbeat", _node(nid),
                {"node_id": nid, "agent_state": "running", "workers": list(ws)})


def journal(head: HeadServer) -> list[dict[str, Any]]:
    with head.lock:
        head._flush_events()
    return [json.loads(x) for x in head.events_path.read_text().splitlines()]


def test_a_falsified_world_and_step_are_400_and_change_nothing(head: HeadServer) -> None:
    """The issue's attack: world 2^20 and step 2^62 from a node's own token."""
    assert beat(head, "n1", worker(100))[0] == 200
    assert beat(head, "n2")[0] == 200
    before = call(head, "GET", "/api/status", CTL)[1]
    for w in (worker(100, world=1 << 20), worker(1 << 62), worker(1 << 62, world=1 << 20),
              worker(100, world=1 << 20, inc="i2"), worker(1 << 40, inc="i2"),
              worker(100, resume_step=1 << 40), worker(100, last_ckpt=1 << 40),
              worker(100, drain_step=1 << 40)):
        code, reply = beat(head, "n1", w)
        assert code == 400, (w, reply)
    after = call(head, "GET", "/api/status", CTL)[1]
    assert (after["world_size"], after["step"]) == (before["world_size"], before["step"]) \
        == (1, 100)
    assert not [e for e in journal(head) if e["type"] == "rescale"]
    # another node cannot lift the bound by itself either (the cluster's steps bound it)
    assert beat(head, "n2", worker(1 << 40))[0] == 400
    # and the honest reports go on being believed
    assert beat(head, "n1", worker(150))[0] == 200
    assert call(head, "GET", "/api/status", CTL)[1]["step"] == 150


def test_world_is_bounded_by_the_specs_maximum(tmp_path: Path) -> None:
    with serve_head(tmp_path, SECRET, max_world=4) as srv:
        assert beat(srv, "n1", worker(1, world=5))[0] == 400
        assert beat(srv, "n1", worker(1, world=4))[0] == 200


def test_world_is_bounded_by_the_nodes_the_head_knows(head: HeadServer) -> None:
    """Without the spec's maximum (the largest any spec may ask: 10,000): a group is at
    most 64 GPUs for each node the head knows."""
    assert beat(head, "n1", worker(1, world=65))[0] == 400
    assert beat(head, "n1", worker(1, world=64))[0] == 200
    assert beat(head, "n1", worker(1, world=10_001))[0] == 400


def test_steps_may_go_down_and_grow_at_a_training_rate(head: HeadServer) -> None:
    assert beat(head, "n1", worker(5000))[0] == 200
    assert beat(head, "n1", worker(4000, inc="i2", resume_step=4000))[0] == 200  # a restore
    assert beat(head, "n1", worker(4000 + 1000, inc="i2"))[0] == 200
    assert beat(head, "n1", worker(10**9, inc="i2"))[0] == 400


def test_a_restarted_head_keeps_bounding_steps(tmp_path: Path) -> None:
    with serve_head(tmp_path, SECRET) as srv:
        assert beat(srv, "n1", worker(100))[0] == 200
    with serve_head(tmp_path, SECRET) as srv:  # the same directory: a restarted head
        assert beat(srv, "n1", worker(1 << 62))[0] == 400
        assert beat(srv, "n1", worker(1 << 40))[0] == 400
        assert beat(srv, "n1", worker(120))[0] == 200


def test_a_startup_without_started_at_is_400_and_the_real_rescale_is_kept(
        head: HeadServer) -> None:
    assert beat(head, "n1", worker(10, inc="i1"))[0] == 200
    for bad in ({"imports": 0.1}, {"started_at": "now"}, {"started_at": True},
                {"started_at": None}):
        code, reply = beat(head, "n1", worker(10, world=1, inc="i2", startup=bad))
        assert code == 400, (bad, reply)
    good = {"imports": 0.1, "started_at": time.time() + 5}  # after the head saw it
    assert beat(head, "n1", worker(10, inc="i2", startup=good))[0] == 200
    rescales = [e for e in journal(head) if e["type"] == "rescale"]
    assert len(rescales) == 1 and rescales[0]["worker_start"]["imports"] == 0.1


def test_one_nodes_events_cannot_evict_the_others(head: HeadServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A node flooding events (here rebalance recommendations about itself, with the rate
    limit lifted) pushes out only its own oldest from the window; all stay journaled."""
    monkeypatch.setattr(head_server, "MAX_EVENTS", 60)
    monkeypatch.setattr(head_server, "MAX_EVENTS_PER_NODE", 10, raising=False)
    head.rate = head_server.RateLimit(rate=1e6, burst=1e6)
    assert beat(head, "n2")[0] == 200
    assert call(head, "POST", "/api/event", CTL, {"type": "note", "message": "ctl"})[0] == 200
    for i in range(150):
        code, _ = call(head, "POST", "/api/event", _node("n1"),
                       {"type": "rebalance-recommendation", "node": "n1"})
        assert code == 200
        if i % 20 == 0:
            with head.lock:
                head._flush_events()
    with head.lock:
        head._flush_events()
    window = call(head, "GET", "/api/events", CTL)[1]["events"]
    assert [e for e in window if e.get("node") == "n2"], window[:5]
    assert [e for e in window if e.get("message") == "ctl"]
    assert len([e for e in window if e.get("node") == "n1"]) <= 10
    assert len([e for e in journal(head) if e["type"] == "rebalance-recommendation"]) == 150


def test_a_torchft_replicas_own_counts_reach_the_coordinator(head: HeadServer) -> None:
    """The replicas' own counts of redone steps (failed_steps) and their quorum size are
    what the head's lost steps come from on torchft: kept when in bounds, 400 otherwise."""
    ft = {"engine": "torchft", "replicas": 1, "failed_steps": 2}
    assert beat(head, "n1", worker(10, **ft))[0] == 200
    seen = head.coord.nodes["n1"].workers[0]
    assert (seen.engine, seen.replicas, seen.failed_steps) == ("torchft", 1, 2)
    for bad in ({"failed_steps": -1}, {"replicas": 1 << 20}, {"engine": "mpi"}):
        assert beat(head, "n1", worker(11, **{**ft, **bad}))[0] == 400, bad
