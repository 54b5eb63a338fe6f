"""Issue 14: who may do what at the head, and the head survives what a client sends.

A real HeadServer on loopback; requests over real sockets. Per-node credentials speak
for their own node only; controller routes need the cluster secret; every field is
validated and garbage gets a 4xx while the head keeps serving."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.head import server as head_server
from spotctl.head.auth import node_token
from spotctl.head.client import HeadClient
from spotctl.head.server import HeadServer
from tests.conftest import last_char_changed, wait_until
from tests.security.conftest import serve_head

SECRET = secrets.token_urlsafe(32)
CTL = f"Bearer {SECRET}"


def _bearer(nid: str) -> str:
    return f"Bearer {node_token(SECRET, nid)}"


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    with serve_head(tmp_path, SECRET) as srv:
        yield srv


def call(head: HeadServer, method: str, path: str, auth: str | None,
         body: Any = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(head.url + path, data=data, method=method)
    if auth:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def hb(nid: str, **kw: Any) -> dict[str, Any]:
    return {"node_id": nid, "agent_state": "running", "workers": [], **kw}


def raw(head: HeadServer, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return whatever the head answers until it closes (or times out)."""
    with socket.create_connection(("127.0.0.1", head.http_port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out:
                    head_part, _, rest = out.partition(b"\r\n\r\n")
                    n = next((int(x.split(b":")[1]) for x in head_part.split(b"\r\n")
                              if x.lower().startswith(b"content-length:")), 0)
                    if len(rest) >= n:
                        break
        except TimeoutError:
            pass
        return out


def status_code(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0


# -- who may do what ------------------------------------------------------------------------


def test_a_node_speaks_for_itself_only(head: HeadServer) -> None:
    assert call(head, "POST", "/api/heartbeat", _bearer("n1"), hb("n1"))[0] == 200
    assert call(head, "POST", "/api/heartbeat", _bearer("n2"), hb("n2"))[0] == 200
    before = json.dumps(head.coord.status(), sort_keys=True, default=str)
    n_events = len(head.coord.events)
    # n1 forging n2: heartbeat marking it left, a notice draining it
    assert call(head, "POST", "/api/heartbeat", _bearer("n1"),
                hb("n2", agent_state="left"))[0] == 403
    assert call(head, "POST", "/api/notice", _bearer("n1"),
                {"node_id": "n2", "notice": {"id": "x", "deadline": time.time() + 30}})[0] == 403
    assert call(head, "POST", "/api/event", _bearer("n1"),
                {"type": "rebalance-recommendation", "node": "n2"})[0] == 403
    assert head.coord.nodes["n2"].state == "running" and head.coord.nodes["n2"].notice is None
    assert len(head.coord.events) == n_events
    del before
    # its own notice is fine
    assert call(head, "POST", "/api/notice", _bearer("n1"),
                {"node_id": "n1", "notice": {"id": "x", "deadline": time.time() + 30}})[0] == 200
    assert head.coord.nodes["n1"].notice is not None


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/api/status", None),
    ("GET", "/api/events", None),
    ("POST", "/api/drain", {"reason": "rebalance", "leavers": ["n2"]}),
    ("POST", "/api/forget", {"nodes": ["n2"]}),
    ("POST", "/api/rebalance", {"action": "pause", "ttl_s": 600}),
    ("POST", "/api/event", {"type": "note", "message": "hi"}),
])
def test_controller_routes_refuse_node_credentials(head: HeadServer, method: str, path: str,
                                                    body: Any) -> None:
    call(head, "POST", "/api/heartbeat", CTL, hb("n2"))
    code, reply = call(head, method, path, _bearer("n1"), body)
    assert code == 403, reply
    assert head.coord.nodes["n2"].state == "running"
    assert call(head, method, path, CTL, body)[0] == 200  # the controller may


@pytest.mark.parametrize("token", [
    node_token("another-cluster-secret", "n1"),  # signed by someone else
    last_char_changed(node_token(SECRET, "n1")),  # MAC altered
    node_token(SECRET, "n1").replace("node:n1:", "node:n2:"),  # id swapped
    "node:n1",
    "node::" + node_token(SECRET, "n1").rsplit(":", 1)[1],
], ids=["other-secret", "mac-altered", "id-swapped", "no-mac", "no-id"])
def test_forged_node_credentials_are_401(head: HeadServer, token: str) -> None:
    for nid in ("n1", "n2"):
        assert call(head, "POST", "/api/heartbeat", f"Bearer {token}", hb(nid))[0] == 401
    assert head.coord.nodes == {}


def test_a_node_credential_cannot_be_turned_into_another() -> None:
    a, b = node_token(SECRET, "n1"), node_token(SECRET, "n2")
    assert SECRET not in a and a.rsplit(":", 1)[1] != b.rsplit(":", 1)[1]
    with pytest.raises(ValueError):
        node_token(SECRET, "n1\nExecStart=/bin/sh")


# -- events: allowed types and fields only, seq/ts are the head's ----------------------------


@pytest.mark.parametrize("body", [
    {"type": "intruder"},
    {"type": "note", "seq": 10**9},
    {"type": "note", "ts": "x"},
    {"type": "note", "message": {"nested": 1}},
    {"type": "rebalance-recommendation", "node": "n1\nx"},
    {"type": ["note"]},
    {},
])
def test_event_fields_are_allow_listed_and_typed(head: HeadServer, body: dict[str, Any]) -> None:
    n = len(head.coord.events)
    code, _ = call(head, "POST", "/api/event", CTL, body)
    assert code == 400
    assert len(head.coord.events) == n
    assert all(isinstance(e["ts"], float) for e in head.coord.events)


def test_event_seq_and_ts_are_the_heads(head: HeadServer) -> None:
    head.coord.record("note", seq=10**9, ts="x", type="forged")
    ev = head.coord.events[-1]
    assert ev["type"] == "note" and ev["seq"] < 10**9 and isinstance(ev["ts"], float)


# -- every field validated -------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"node_id": "n1", "notice": {"id": "x", "deadline": "soon"}},
    {"node_id": "n1", "notice": {"id": "x", "deadline": 1e400}},
    {"node_id": "n1", "notice": "x"},
    {"node_id": ["n1"], "notice": {}},
    {"node_id": "n1\n", "notice": {}},
    {"node_id": "-oProxyCommand=x", "notice": {}},
])
def test_bad_notices_are_400_and_the_head_keeps_ticking(head: HeadServer,
                                                        body: dict[str, Any]) -> None:
    call(head, "POST", "/api/heartbeat", CTL, hb("n1"))
    code, _ = call(head, "POST", "/api/notice", CTL, body)
    assert code == 400
    head.coord.tick()
    assert call(head, "GET", "/api/status", CTL)[0] == 200
    assert head.coord.nodes["n1"].notice is None


@pytest.mark.parametrize("patch", [
    {"agent_state": "pwned"},
    {"workers": "x"},
    {"workers": [{"rank": "0", "world_size": 1, "phase": "train"}]},
    {"workers": [{"rank": 0, "world_size": 0, "phase": "train"}]},
    {"workers": [{"rank": 0, "world_size": 1, "phase": "x"}]},
    {"workers": [{"rank": 0, "world_size": 1, "phase": "train", "step": -1}]},
    {"workers": [{"rank": 0, "world_size": 1, "phase": "train", "first_step_at": "x"}]},
    {"workers": [{"rank": 0, "world_size": 1, "phase": "train"}] * 65},
    {"drain_gen": "1"},
    {"ready": "yes"},
    {"addr": "x" * 1000},
])
def test_bad_heartbeats_are_400_and_change_nothing(head: HeadServer,
                                                   patch: dict[str, Any]) -> None:
    code, _ = call(head, "POST", "/api/heartbeat", CTL, {**hb("n1"), **patch})
    assert code == 400
    assert head.coord.nodes == {}


def test_a_worker_reporting_nan_loss_is_kept_without_it(head: HeadServer) -> None:
    """A diverging run reports NaN (python's json writes it): the node stays alive, the
    value is dropped; NaN/Infinity anywhere else is a 400."""
    w = {"rank": 0, "world_size": 1, "phase": "train", "incarnation": "i1",
         "loss": float("nan"), "throughput": float("inf")}
    assert call(head, "POST", "/api/heartbeat", CTL, hb("n1", workers=[w]))[0] == 200
    assert head.coord.nodes["n1"].workers[0].loss is None
    code, status = call(head, "GET", "/api/status", CTL)
    assert code == 200 and status["nodes"]["n1"]["workers"][0]["throughput"] is None
    w2 = {**w, "first_step_at": float("nan")}
    assert call(head, "POST", "/api/heartbeat", CTL, hb("n1", workers=[w2]))[0] == 400
    assert call(head, "POST", "/api/heartbeat", CTL, hb("n1", drain_gen=float("inf")))[0] == 400


def test_the_training_librarys_own_report_is_accepted(head: HeadServer) -> None:
    """The exact shape spotctl.elastic writes (extra keys, a flag among the timings)."""
    w = {"rank": 0, "local_rank": 0, "world_size": 2, "step": 5, "phase": "train",
         "incarnation": "abc", "resume_step": 0, "first_step_at": time.time(), "last_ckpt": 0,
         "loss": 0.5, "throughput": 10.0, "drain_step": None, "pid": 123, "epoch": 0,
         "offset": 7, "startup": {"imports": 0.0, "process_group": 0.2, "restore": 0.01,
                                  "started_at": time.time(), "forked_warm": True,
                                  "first_step": 0.3}}
    code, reply = call(head, "POST", "/api/heartbeat", _bearer("n1"), hb("n1", workers=[w]))
    assert code == 200, reply
    assert head.coord.nodes["n1"].workers[0].startup["forked_warm"] is True


@pytest.mark.parametrize("path,body", [
    ("/api/heartbeat", {**hb("n1"), "agent_sate": "left"}),  # a field the route has not
    ("/api/notice", {"node_id": "n1", "notice": {}, "extra": 1}),
    ("/api/notice", {"node_id": "n1"}),
    ("/api/drain", {"type": "note", "message": "hi"}),  # no reason, no leavers: no drain
    ("/api/drain", {"reason": "rebalance"}),
    ("/api/forget", {}),
    ("/api/forget", {"type": "note"}),
    ("/api/rebalance", {}),
    ("/api/rebalance", {"action": "pause", "ttl": 5}),
    ("/api/rebalance", {"action": "stop"}),  # (this head runs no loop: still refused)
    ("/api/rebalance", {"action": "pause", "ttl_s": True}),
])
def test_a_body_holds_only_and_all_of_its_routes_fields(head: HeadServer, path: str,
                                                        body: dict[str, Any]) -> None:
    """Even with the controller's secret, a body meant for another route (or missing what
    the route needs) is refused, never read with defaults."""
    call(head, "POST", "/api/heartbeat", CTL, hb("n1"))
    n = len(head.coord.events)
    code, reply = call(head, "POST", path, CTL, body)
    assert code == 400, reply
    assert len(head.coord.events) == n and head.coord.drain is None
    assert head.coord.nodes["n1"].state == "running"


@pytest.mark.parametrize("query", ["since=x", "since=-1", "since=1e3", "since=" + "9" * 40])
def test_bad_event_queries_are_400(head: HeadServer, query: str) -> None:
    assert call(head, "GET", "/api/events?" + query, CTL)[0] == 400


# -- sizes, connections, timeouts ------------------------------------------------------------


def test_negative_or_huge_content_length_is_answered_at_once(head: HeadServer) -> None:
    auth = f"Authorization: {CTL}\r\n".encode()
    for length in (b"-1", b"abc", b"99999999999"):
        t0 = time.monotonic()
        reply = raw(head, b"POST /api/heartbeat HTTP/1.1\r\nHost: x\r\n" + auth
                    + b"Content-Length: " + length + b"\r\n\r\n", timeout=8)
        assert status_code(reply) in (400, 413), reply[:100]
        assert time.monotonic() - t0 < 5  # answered without waiting for a body
    # and without a token nothing is read either: 401 at once, connection closed
    reply = raw(head, b"POST /api/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000"
                b"\r\n\r\n", timeout=8)
    assert status_code(reply) == 401


def test_garbage_requests_get_4xx_and_the_head_still_serves(head: HeadServer) -> None:
    for junk in (b"\x00\xff" * 100 + b"\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                 b"POST /api/heartbeat HTTP/1.1\r\nContent-Length: 5\r\nAuthorization: "
                 + CTL.encode() + b"\r\n\r\n{{{{{",
                 b"GET /api/status HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n"):
        reply = raw(head, junk)
        code = status_code(reply)
        assert reply == b"" or 400 <= code < 500 or code == 505, reply[:200]
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    reply = raw(head, b"POST /api/event HTTP/1.1\r\nAuthorization: " + CTL.encode()
                + b"\r\nContent-Length: " + str(len(deep)).encode() + b"\r\n\r\n" + deep)
    assert status_code(reply) == 400
    assert HeadClient(head.url, SECRET).health()["ok"]


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _health_on(s: socket.socket) -> bytes:
    """One keep-alive GET /api/health on `s`, with the controller's token: the reply."""
    s.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\nAuthorization: " + CTL.encode()
              + b"\r\n\r\n")
    out = b""
    while b"}" not in out and (chunk := s.recv(4096)):
        out += chunk
    return out


def _keepalive(head: HeadServer) -> socket.socket:
    """A connection that authenticated with the controller's token and stays open."""
    s = socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
    assert _health_on(s).startswith(b"HTTP/1.1 200")
    return s


def test_connections_are_capped_and_the_oldest_idle_one_makes_room(head: HeadServer) -> None:
    """A flood of idle sockets neither exhausts threads nor holds the head: over the cap
    the oldest connection that has not authenticated is closed by the head, so a newcomer
    (the controller) is served at once; threads stay bounded."""
    head.httpd.max_connections = 8
    idle = [socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
            for _ in range(8)]
    assert _wait(lambda: head.httpd.connections()["open"] == 8)
    extra = socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
    assert idle[0].recv(10) == b""  # the oldest: closed by the head for the newcomer
    assert HeadClient(head.url, SECRET).health()["ok"]  # and a client is served at once
    assert threading.active_count() < 8 + 20
    for s in [*idle, extra]:
        s.close()
    assert _wait(lambda: head.httpd.connections()["open"] == 0), head.httpd.connections()


def test_authenticated_connections_are_not_evicted(head: HeadServer) -> None:
    """Only connections that have not shown a token make room; when every slot holds an
    authenticated one a newcomer is refused (closed at once), and a node credential holds
    at most PER_NODE_TRUSTED of them."""
    head.httpd.max_connections = 4
    kept = [_keepalive(head) for _ in range(4)]
    assert _wait(lambda: head.httpd.connections()["trusted"] == 4)
    extra = socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
    assert extra.recv(10) == b""  # refused
    for s in kept:  # and none of the authenticated ones was touched
        assert _health_on(s).startswith(b"HTTP/1.1 200")
        s.close()
    extra.close()
    assert _wait(lambda: head.httpd.connections()["open"] == 0), head.httpd.connections()


def test_every_connection_is_forgotten_when_it_ends(head: HeadServer) -> None:
    """Closed, evicted and refused connections all leave the table (no slot leaks)."""
    head.httpd.max_connections = 3
    head.httpd.per_address = 2
    socks = [socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
             for _ in range(6)]
    assert _wait(lambda: head.httpd.evictions >= 4), head.httpd.connections()
    assert [s.recv(10) for s in socks[:4]] == [b""] * 4  # the 4 oldest made room
    assert head.httpd.connections()["open"] <= 3
    for s in socks:
        s.close()
    assert _wait(lambda: head.httpd.connections()["open"] == 0), head.httpd.connections()
    assert HeadClient(head.url, SECRET).health()["ok"]


def test_the_in_memory_event_list_is_bounded(head: HeadServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_server, "MAX_EVENTS", 50)
    for i in range(200):
        head.coord.record("note", message=str(i))
        if i % 40 == 0:
            with head.lock:
                head._flush_events()
    with head.lock:
        head._flush_events()
    assert len(head.coord.events) <= 50
    lines = head.events_path.read_text().splitlines()
    assert len(lines) >= 200  # the journal has them all


# -- a poisoned journal never keeps the head down --------------------------------------------


def test_a_poisoned_events_journal_does_not_stop_the_head(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(
        b'{"seq": 7, "ts": 1, "type": "x"}\n'
        b"garbage\n[1,2]\n\"str\"\n{\"seq\": \"x\"}\n{\"seq\": 1e999}\n{\"seq\": NaN}\n"
        b'{"seq": 99999999999999999999999999}\n' + b"[" * 50_000 + b"\n\xff\xfe\n"
        b'{"seq": 9, "ts": "x", "type": 3}\n'
    )
    srv = HeadServer(tmp_path, SECRET, with_store=False)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "head.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        evs = HeadClient(srv.url, SECRET).events(0)
        restart = [e for e in evs if e["type"] == "head-restart"]
        assert restart and restart[0]["previous_seq"] == 9 and restart[0]["seq"] == 10
    finally:
        srv.stop()
        t.join(5)


# -- no proxy for cluster traffic -----------------------------------------------------------


def test_head_client_ignores_proxy_settings(head: HeadServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in the environment would see the token: the client never uses one."""
    seen: list[bytes] = []
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    trap.settimeout(0.2)

    def watch() -> None:
        try:
            c, _ = trap.accept()
            seen.append(c.recv(4096))
            c.close()
        except OSError:
            pass

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    proxy = f"http://127.0.0.1:{trap.getsockname()[1]}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert HeadClient(head.url, SECRET).health()["ok"]
    w.join(1)
    trap.close()
    assert seen == []


def test_a_flooding_node_is_throttled_and_slows_nobody_else(head: HeadServer) -> None:
    # a slow refill, so the flood outruns it however loaded this machine is
    head.rate = head_server.RateLimit(rate=1.0, burst=20.0)
    codes = [call(head, "POST", "/api/heartbeat", _bearer("n1"), hb("n1"))[0]
             for _ in range(40)]
    assert 429 in codes and codes[0] == 200
    # another node and the controller are served at once
    assert call(head, "POST", "/api/heartbeat", _bearer("n2"), hb("n2"))[0] == 200
    assert call(head, "GET", "/api/status", CTL)[0] == 200
    # and the flooder gets its share back over time (one token a second)
    wait_until(lambda: call(head, "POST", "/api/heartbeat", _bearer("n1"), hb("n1"))[0] == 200,
               10, "the flooder's next accepted heartbeat", 0.5)


def test_rate_limit_refills_at_its_rate() -> None:
    now = [0.0]
    rl = head_server.RateLimit(rate=2.0, burst=3.0, clock=lambda: now[0])
    assert [rl.allow("a") for _ in range(4)] == [True, True, True, False]
    assert rl.allow("b")
    now[0] += 0.5
    assert rl.allow("a") and not rl.allow("a")
