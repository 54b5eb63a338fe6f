"""Issue 31 (4, 5): the head API survives hostile clients without a token.

The slow tests attack a real `spotctl head` process on loopback (tests/security/
head_attacks.py, which also prints the figures on docs/benchmarks.md) while a real
controller client asks for `status`; the fast ones check the caps on an in-process head."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotctl.head import server as head_server
from spotctl.head.client import HeadClient
from spotctl.head.server import HeadServer
from tests.conftest import send_and_read
from tests.security.conftest import serve_head
from tests.security.head_attacks import Head, real_head, run_header_flood, run_slowloris

SECRET = secrets.token_urlsafe(32)
AUTH = b"Authorization: Bearer " + SECRET.encode() + b"\r\n"


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    with serve_head(tmp_path, SECRET) as srv:
        yield srv


def _reply(head: HeadServer, data: bytes) -> bytes:
    return send_and_read("127.0.0.1", head.http_port, data)


@pytest.mark.parametrize("request_head", [
    b"GET /api/status HTTP/1.1\r\n" + b"X-A: b\r\n" * 65 + AUTH + b"\r\n",
    b"GET /api/status HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n" + AUTH + b"\r\n",
    b"GET /api/status HTTP/1.1\r\n" + (b"X-Mid: " + b"a" * 2000 + b"\r\n") * 5 + AUTH + b"\r\n",
    b"GET /api/status?" + b"a" * 5000 + b" HTTP/1.1\r\n" + AUTH + b"\r\n",
], ids=["65-headers", "one-9000-byte-header", "5x2000-byte-headers", "5000-byte-line"])
def test_oversized_request_heads_are_431_even_with_the_token(head: HeadServer,
                                                             request_head: bytes) -> None:
    """The caps hold before the token is read: a header block over 8 KiB or 64 lines, or
    a request line over 4 KiB, is answered 431 and closed (the token changes nothing)."""
    reply = _reply(head, request_head)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:120]
    assert HeadClient(head.url, SECRET).status()["nodes"] == {}


def test_a_request_under_the_caps_is_served(head: HeadServer) -> None:
    reply = _reply(head, b"GET /api/health HTTP/1.1\r\nConnection: close\r\n"
                   + b"X-A: b\r\n" * 40 + AUTH + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 200"), reply[:120]


def test_a_request_that_trickles_in_is_cut_off_at_its_deadline(
        head: HeadServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is per request, not per read: a client sending one byte every 0.2 s
    (well inside any per-read timeout) is closed once the request's deadline (1 s here)
    has passed. The 30 s bound only stops the test on a head that never closes it."""
    monkeypatch.setattr(head_server, "REQUEST_DEADLINE_S", 1.0)
    s = socket.create_connection(("127.0.0.1", head.http_port), timeout=5)
    s.sendall(b"GET /api/status HTTP/1.1\r\n")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < 30:
        try:
            s.sendall(b"X")
            s.settimeout(0.2)
            if s.recv(4096) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except OSError:
            closed = True
            break
    s.close()
    assert closed, "the head kept a trickling request open for 30 s"


# -- against a real head process (slow) -----------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    with real_head(tmp_path_factory.mktemp("attacked")) as h:
        yield h


@pytest.mark.slow
def test_a_slowloris_does_not_lock_the_controller_out(real: Head) -> None:
    """300 connections trickling a request (more than the head's 256 slots, all from
    loopback, the address every local client shares): the controller's `status` and a
    node's heartbeats are served throughout. Before: 256 held for good, `status` and
    heartbeats refused."""
    got = run_slowloris(real, n=300, duration_s=8.0)
    assert got["status_failed"] == 0, got
    assert got["status_ok"] >= 3, got
    assert got["status_max_s"] < 5.0, got  # generous: ms when this machine is idle
    # and a node's agent (its own token, from the same loopback) keeps reporting
    assert got["heartbeat_failed"] == 0 and got["heartbeat_ok"] >= 3, got
    # the attacker holds at most one address's share of the slots at any time
    assert got["connections_held_at_end"] <= head_server.PER_ADDRESS, got


@pytest.mark.slow
def test_a_header_flood_does_not_grow_the_head(real: Head) -> None:
    """250 connections each sending 60 headers of 16 KiB without a token and holding:
    the head answers 431 after 8 KiB and keeps nothing. Before: +240 MB (the same flood
    with Python's own caps, 100 x 64 KiB, took a head to 1.95 GB)."""
    got = run_header_flood(real, n=250, lines=60, line_bytes=16384, hold_s=2.0)
    assert got["rss_peak_mb"] - got["rss_before_mb"] < 100, got
    assert got["connections_held_at_end"] == 0, got
    assert got["status_failed"] == 0 and got["status_max_s"] < 5.0, got
