"""The head's documented limits (docs/security.md: bodies at 1 MiB, connections
at 256, the in-memory event list at 10,000 with 1,000 per node, nodes at 1,024, 50
requests a second per node credential) are the ones a head built with no overrides
enforces. The other head tests swap in small values to stay quick; these keep the real
ones, exercised at the limit where that is cheap (over real sockets), so a limit
multiplied by 1,000 fails here."""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.head import validate
from spotctl.head.auth import node_token
from spotctl.head.server import HeadServer
from tests.security.conftest import serve_head

SECRET = secrets.token_urlsafe(32)
CTL = f"Bearer {SECRET}"
MIB = 1 << 20


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    with serve_head(tmp_path, SECRET) as srv:  # nothing overridden
        yield srv


def _node(nid: str) -> str:
    return f"Bearer {node_token(SECRET, nid)}"


def request(head: HeadServer, method: str, path: str, auth: str, body: bytes = b"",
            length: int | None = None) -> tuple[int, dict[str, Any]]:
    """One request on its own connection: (status, JSON reply). `length` overrides the
    Content-Length sent (the body is then not sent at all)."""
    n = len(body) if length is None else length
    head_part = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
                 f"Content-Length: {n}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", head.http_port), timeout=30) as s:
        s.sendall(head_part + (body if length is None else b""))
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    status = int(out.split(b" ", 2)[1])
    return status, json.loads(out.partition(b"\r\n\r\n")[2] or b"{}")


def heartbeat(nid: str) -> bytes:
    return json.dumps({"node_id": nid, "agent_state": "running", "workers": []}).encode()


def test_a_body_of_one_mib_is_read_and_one_byte_more_is_413(head: HeadServer) -> None:
    body = heartbeat("n1")
    exactly = body + b" " * (MIB - len(body))  # JSON allows trailing whitespace
    assert len(exactly) == MIB
    assert request(head, "POST", "/api/heartbeat", _node("n1"), exactly)[0] == 200
    code, reply = request(head, "POST", "/api/heartbeat", _node("n1"), length=MIB + 1)
    assert code == 413, reply
    assert str(MIB) in reply["error"]


def test_connections_are_capped_at_256(head: HeadServer) -> None:
    assert head.httpd.max_connections == 256


def test_the_event_window_keeps_10000_and_1000_per_node(head: HeadServer) -> None:
    with head.lock:
        for i in range(1_005):
            head.coord.record("rebalance-recommendation", node="n1", i=i)
        head._flush_events()
        mine = [e for e in head.coord.events if e.get("node") == "n1"]
        assert len(mine) == 1_000 and mine[0]["i"] == 5  # its own oldest went first
        for i in range(10_005):
            head.coord.record("note", message=f"m{i}")
        head._flush_events()
        assert len(head.coord.events) == 10_000
        assert head.coord.events[-1]["message"] == "m10004"
    # the reply holds the whole window, and the journal all of them
    code, reply = request(head, "GET", "/api/events?since=0", CTL)
    assert code == 200 and len(reply["events"]) == 10_000
    with open(head.events_path) as f:
        assert sum(1 for _ in f) >= 1_005 + 10_005


def test_the_head_knows_at_most_1024_nodes(head: HeadServer) -> None:
    with head.lock:
        for i in range(1_023):
            head.coord.heartbeat(validate.heartbeat(json.loads(heartbeat(f"k{i}"))))
    assert len(head.coord.nodes) == 1_023
    assert request(head, "POST", "/api/heartbeat", _node("last"), heartbeat("last"))[0] == 200
    code, reply = request(head, "POST", "/api/heartbeat", _node("extra"), heartbeat("extra"))
    assert code == 429 and "1024 nodes" in reply["error"], reply
    # a known node still reports
    assert request(head, "POST", "/api/heartbeat", _node("k0"), heartbeat("k0"))[0] == 200
    assert len(head.coord.nodes) == 1_024 and "extra" not in head.coord.nodes


def test_a_node_credential_gets_50_requests_a_second(head: HeadServer) -> None:
    # the head's own limiter, with its clock held still (no timing in this test)
    now = [1_000.0]
    head.rate.clock = lambda: now[0]
    codes = [request(head, "GET", "/api/health", _node("n1"))[0] for _ in range(101)]
    assert codes[:-1] == [200] * 100 and codes[-1] == 429  # a burst of 100 (2 s' worth)
    now[0] += 1.0
    codes = [request(head, "GET", "/api/health", _node("n1"))[0] for _ in range(51)]
    assert codes[:-1] == [200] * 50 and codes[-1] == 429  # one second refills 50
    # another node, and the controller, are not held back by n1's flood
    assert request(head, "GET", "/api/health", _node("n2"))[0] == 200
    assert request(head, "GET", "/api/status", CTL)[0] == 200
