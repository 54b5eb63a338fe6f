"""Issue 14: a running head survives whatever a client sends. Hypothesis throws random
routes, methods, headers and bodies (with and without valid credentials) at a real
HeadServer over real sockets for a bounded time; afterwards the head still serves, every
answer was an HTTP status below 500, and its state is intact (the nodes registered
before the storm are there, unchanged by anyone who could not speak for them)."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotctl.head.auth import node_token
from spotctl.head.client import HeadClient
from spotctl.head.server import HeadServer
from tests.conftest import last_char_changed

SECRET = secrets.token_urlsafe(32)
ROUTES = ["/api/heartbeat", "/api/notice", "/api/event", "/api/drain", "/api/forget",
          "/api/status", "/api/events", "/api/health", "/", "/api/", "/api/../api/status"]
FIELDS = ["node_id", "agent_state", "workers", "notice", "deadline", "type", "seq", "ts",
          "nodes", "leavers", "reason", "drain_gen", "ready", "addr", "message", "node"]

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8),
                                             c, max_size=5)), max_leaves=20)
body_obj = st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=6)


@st.composite
def requests(draw: Any) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS",
                                   "BREW", "G\x00T"]))
    path = draw(st.sampled_from(ROUTES) | st.text(min_size=0, max_size=30).map(lambda s: "/" + s))
    if draw(st.booleans()):
        path += "?since=" + draw(st.sampled_from(["0", "-1", "x", "1e9", "9" * 30, ""]))
    auth = draw(st.sampled_from([
        None, f"Bearer {SECRET}", f"Bearer {node_token(SECRET, 'n1')}",
        f"Bearer {last_char_changed(node_token(SECRET, 'victim'))}", "Bearer ", "Basic x",
        f"Bearer {node_token('other', 'victim')}",
    ]))
    kind = draw(st.sampled_from(["json", "garbage", "none"]))
    if kind == "json":
        body = json.dumps(draw(body_obj)).encode()
    elif kind == "garbage":
        body = draw(st.binary(max_size=200))
    else:
        body = b""
    length = draw(st.sampled_from(["ok", "ok", "negative", "huge", "text", "missing"]))
    cl = {"ok": str(len(body)), "negative": "-1", "huge": "99999999999", "text": "abc",
          "missing": None}[length]
    lines = [f"{method} {path} HTTP/1.1", "Host: head"]
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    if cl is not None:
        lines.append(f"Content-Length: {cl}")
    for _ in range(draw(st.integers(0, 3))):
        lines.append(draw(st.sampled_from(["X-Junk: " + "y" * 100, "Transfer-Encoding: chunked",
                                           "Connection: keep-alive", "Expect: 100-continue"])))
    head = "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n"
    return head + body


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    srv = HeadServer(tmp_path, SECRET, with_store=False)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    c = HeadClient(srv.url, node_token(SECRET, "victim"))
    c.heartbeat({"node_id": "victim", "agent_state": "running", "workers": []})
    yield srv
    srv.stop()
    t.join(5)


def _send(srv: HeadServer, data: bytes) -> int:
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # no more body: a short Content-Length gets an answer
        try:
            reply = s.recv(64)
        except (TimeoutError, ConnectionResetError):
            return 0
    if not reply.startswith(b"HTTP/1."):
        return 0  # closed without an answer (over a cap, or a malformed request line)
    return int(reply.split(b" ", 2)[1])


def test_head_survives_random_requests_and_its_state_is_intact(head: HeadServer) -> None:
    # the storm and the checks after it are one test: as two, the checks relied on running
    # after the storm in the same process, which pytest-xdist does not promise (seen in a
    # fresh-clone CI run: "the fuzz test ran first" failed when they went to two workers)
    codes: list[int] = []

    @settings(max_examples=400, deadline=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow])
    @given(req=requests())
    def storm(req: bytes) -> None:
        code = _send(head, req)
        codes.append(code)
        assert code < 500 or code == 505, req[:300]

    storm()
    assert len(codes) >= 100, len(codes)  # the storm ran
    ctl = HeadClient(head.url, SECRET)
    t0 = time.monotonic()
    assert ctl.health()["ok"] and time.monotonic() - t0 < 5
    status = ctl.status()
    victim = status["nodes"]["victim"]
    # nobody could speak for the victim (the fuzzer's node credentials are n1's or forged;
    # its controller requests name random ids): it is still there, with no notice, no
    # leave; only its silence since the storm began may have made it unresponsive
    assert victim["state"] in ("running", "unresponsive"), victim
    assert victim["notice"] is None
    assert status["drain"] is None or "victim" not in status["drain"]["leavers"]
    evs = ctl.events(0)
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(isinstance(e["ts"], float) and isinstance(e["type"], str) for e in evs)
    assert threading.active_count() < 100
    json.dumps(status, allow_nan=False)  # nothing non-finite got into the state
