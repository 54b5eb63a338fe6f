"""Issue 9, security: the head's coordinator API lets in only the cluster token holder,
compares tokens in constant time and (local mode) listens on loopback only."""

from __future__ import annotations

import ast
import inspect
import json
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotctl.head import server as head_server
from spotctl.head.server import HeadServer

TOKEN = secrets.token_urlsafe(32)
GETS = ["/api/status", "/api/events", "/api/events?since=0", "/api/health", "/api/nope", "/"]
POSTS = {
    "/api/heartbeat": {"node_id": "n1", "agent_state": "running", "workers": []},
    "/api/notice": {"node_id": "n1", "notice": {"id": "x", "deadline": 0}},
    "/api/drain": {"reason": "intruder", "leavers": ["n1"]},
    "/api/forget": {"nodes": ["n1"]},
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


def test_tokens_are_compared_in_constant_time() -> None:
    """The check is hmac.compare_digest over the whole header, never `==`."""
    src = inspect.getsource(head_server)
    tree = ast.parse(src)
    auth = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_authorized"
    )
    calls = [ast.unparse(n.func) for n in ast.walk(auth) if isinstance(n, ast.Call)]
    assert "hmac.compare_digest" in calls
    assert not any(isinstance(n, ast.Compare) for n in ast.walk(auth)), "a == on the token"


def test_head_listens_on_loopback_by_default(head: HeadServer) -> None:
    assert head.httpd.server_address[0] == "127.0.0.1"
    assert inspect.signature(HeadServer).parameters["host"].default == "127.0.0.1"


def test_local_provider_starts_the_head_on_loopback() -> None:
    from spotctl.providers.local import provider as local

    src = inspect.getsource(local.LocalProvider.ensure_head)
    assert '"--host", self.host_addr' in src
    assert "--token-file" in src and '"--token"' not in src
    # loopback unless the nodes live in network namespaces of the cluster's own
    assert "self.host_addr = self.net.host_ip if self.net else \"127.0.0.1\"" in inspect.getsource(
        local.LocalProvider.__init__)
