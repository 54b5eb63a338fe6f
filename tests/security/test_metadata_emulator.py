"""Issue 31 (8): the local metadata emulator (each local node's IMDS / GCE metadata
server) refuses a wait it cannot honour and caps its connections. `timeout_sec=nan` used
to spin a thread at 60 % CPU (no comparison with nan is true, so the wait loop never
ended), and every connection got a thread."""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from spotctl.providers.local import metadata
from spotctl.providers.local.metadata import MetadataServer


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    with MetadataServer() as srv:
        yield srv


def _gcp(server: MetadataServer, query: str) -> int:
    req = urllib.request.Request(
        server.url + "/computeMetadata/v1/instance/preempted" + query,
        headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "1e9"])
def test_a_wait_it_cannot_honour_is_400(server: MetadataServer, value: str) -> None:
    """Answered at once (nan used to hang the request, spinning, until the value changed)."""
    assert _gcp(server, f"?wait_for_change=true&timeout_sec={value}") == 400
    assert server.waiters == 0
    assert _gcp(server, "?wait_for_change=true&timeout_sec=0.1") == 200


def test_connections_are_capped(server: MetadataServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the cap a connection is closed at once (no thread); the slots come back."""
    assert server._httpd is not None
    monkeypatch.setattr(server._httpd, "slots", threading.BoundedSemaphore(4), raising=False)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    deadline = time.monotonic() + 10  # until the server has admitted all four (a thread each)
    while len(server._httpd._held) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server._httpd._held) == 4
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert extra.recv(10) == b""  # closed by the server
    extra.close()
    for s in idle:
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # the closed connections' threads give their slots back once they notice: until
        # then a new connection is itself closed at once (over the cap), which is fine
        try:
            if _gcp(server, "") == 200:
                break
        except (OSError, http.client.HTTPException):  # reset, refused (URLError)
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the server did not serve again once the connections closed")
    assert metadata.MAX_CONNECTIONS <= 256
