"""Issue 9, security: the head's coordinator API lets in only holders of a cluster
credential, and (local mode) its API and store refuse clients from outside loopback."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotctl.head.server import HeadServer

TOKEN = secrets.token_urlsafe(32)
GETS = ["/api/status", "/api/events", "/api/events?since=0", "/api/health", "/api/nope", "/"]
POSTS = {
    "/api/heartbeat": {"node_id": "n1", "agent_state": "running", "workers": []},
    "/api/notice": {"node_id": "n1", "notice": {"id": "x", "deadline": 0}},
    "/api/drain": {"reason": "intruder", "leavers": ["n1"]},
    "/api/forget": {"nodes": ["n1"]},
    "/api/rebalance": {"action": "pause", "ttl_s": 600},
    "/api/event": {"type": "intruder"},
    "/api/nope": {},
}
BAD_AUTH = {
    "none": None,
    "empty-bearer": "Bearer ",
    "wrong-same-length": "Bearer " + "A" * len(TOKEN),
    "prefix": "Bearer " + TOKEN[:-1],
    "suffix": "Bearer " + TOKEN + "x",
    "no-scheme": TOKEN,
    "basic": "Basic " + TOKEN,
    "lowercase-scheme-extra-space": "bearer  " + TOKEN,
}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadServer]:
    d = tmp_path_factory.mktemp("head")
    srv = HeadServer(Path(d), TOKEN, with_store=False)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(5)


def _call(url: str, method: str, auth: str | None, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if auth is not None:
        req.add_header("Authorization", auth)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize("auth", list(BAD_AUTH), ids=list(BAD_AUTH))
@pytest.mark.parametrize("path", GETS)
def test_get_without_the_token_is_401(head: HeadServer, path: str, auth: str) -> None:
    code, body = _call(head.url + path, "GET", BAD_AUTH[auth])
    assert code == 401, body
    assert "nodes" not in body and "events" not in body


@pytest.mark.parametrize("auth", list(BAD_AUTH), ids=list(BAD_AUTH))
@pytest.mark.parametrize("path", list(POSTS))
def test_post_without_the_token_is_401_and_changes_nothing(
    head: HeadServer, path: str, auth: str
) -> None:
    before = (len(head.coord.events), dict(head.coord.nodes))
    code, _ = _call(head.url + path, "POST", BAD_AUTH[auth], POSTS[path])
    assert code == 401
    assert (len(head.coord.events), dict(head.coord.nodes)) == before


def test_the_token_opens_every_endpoint(head: HeadServer) -> None:
    # the 401s above are the token's doing, not broken endpoints
    ok = f"Bearer {TOKEN}"
    for path in ("/api/status", "/api/events", "/api/health"):
        assert _call(head.url + path, "GET", ok)[0] == 200
    assert _call(head.url + "/api/heartbeat", "POST", ok, POSTS["/api/heartbeat"])[0] == 200
    assert _call(head.url + "/api/nope", "GET", ok)[0] == 404


# A listener bound to 127.0.0.1 alone refuses a client that comes to another address of
# this machine; one bound to every interface (0.0.0.0) accepts it. 127.0.0.2 is such an
# other address that stays inside loopback (tests never leave it): a connection there
# that succeeds means the port is open on every interface, eth0 included.
OUTSIDE = "127.0.0.2"


def _outside_addresses() -> list[str]:
    """Addresses of this machine a loopback-only (127.0.0.1) listener must refuse."""
    return [OUTSIDE]


def test_the_outside_probe_can_fail() -> None:
    """The probe does reach a listener that binds every interface (so its refusals mean
    something)."""
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    try:
        socket.create_connection((OUTSIDE, s.getsockname()[1]), timeout=2).close()
    finally:
        s.close()


def test_head_refuses_connections_from_outside_loopback(head: HeadServer) -> None:
    """A client reaching this machine on another address does not get in."""
    outside = _outside_addresses()
    assert head.host == "127.0.0.1"
    for ip in outside:
        with pytest.raises(OSError):
            socket.create_connection((ip, head.http_port), timeout=2).close()
    socket.create_connection(("127.0.0.1", head.http_port), timeout=2).close()


def test_head_store_refuses_connections_from_outside_loopback(tmp_path: Path) -> None:
    """The rendezvous store (no auth, unpickled by torch) takes loopback clients only."""
    outside = _outside_addresses()
    srv = HeadServer(tmp_path, TOKEN)  # with its TCPStore
    try:
        for ip in outside:
            with pytest.raises(OSError):
                socket.create_connection((ip, srv.store_port), timeout=2).close()
        socket.create_connection(("127.0.0.1", srv.store_port), timeout=2).close()
    finally:
        srv.httpd.server_close()
