"""What an unauthenticated client can send torchft's listeners (the head's Lighthouse, a
replica's Manager), with no torchft client: raw HTTP/1.1 and raw HTTP/2 with prior
knowledge (frames built here, headers HPACK-encoded). Shared by tests/security and
scripts/chaos."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import send_and_read

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _hostport(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    assert u.hostname is not None and u.port is not None, url
    return u.hostname, u.port


@dataclass
class Answer:
    """What came back: `closed` when the connection ended with no response headers."""

    status: str = ""  # ":status" (HTTP/2) or the status code (HTTP/1)
    grpc_status: str = ""
    closed: bool = False


def http1(url: str, method: str, path: str, timeout: float = 10.0) -> Answer:
    host, port = _hostport(url)
    data = send_and_read(host, port, f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                         f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode(), timeout)
    m = re.match(rb"HTTP/1\.[01] (\d+)", data)
    return Answer(status=m.group(1).decode()) if m else Answer(closed=True)


def _frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + sid.to_bytes(4, "big") + payload


def grpc_call(url: str, path: str, message: bytes = b"", timeout: float = 10.0) -> Answer:
    """One unary gRPC call over HTTP/2 with prior knowledge (what tonic serves): the
    response's :status and grpc-status, or `closed`."""
    from hpack import Decoder, Encoder

    host, port = _hostport(url)
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
               (":authority", f"{host}:{port}"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    out = Answer(closed=True)
    dec = Decoder()
    with socket.create_connection((host, port), timeout) as s:
        s.sendall(PREFACE + _frame(0x4, 0, 0, b"")  # SETTINGS
                  + _frame(0x1, 0x4, 1, Encoder().encode(headers))  # HEADERS, END_HEADERS
                  + _frame(0x0, 0x1, 1, body))  # DATA, END_STREAM
        buf = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n = int.from_bytes(buf[:3], "big")
                    ftype, flags, sid, payload = buf[3], buf[4], buf[5:9], buf[9:9 + n]
                    buf = buf[9 + n:]
                    if ftype == 0x4 and not flags & 0x1:  # their SETTINGS: acknowledge
                        s.sendall(_frame(0x4, 0x1, 0, b""))
                    if ftype == 0x1 and int.from_bytes(sid, "big") == 1:
                        got = {str(k): str(v) for k, v in dec.decode(payload)}
                        out.closed = False
                        out.status = got.get(":status", out.status)
                        out.grpc_status = got.get("grpc-status", out.grpc_status)
                        if out.grpc_status:
                            return out
                    if ftype == 0x7:  # GOAWAY
                        return out
        except OSError:
            pass
    return out


def kill_request(msg: str = "attack") -> bytes:
    """torchft's KillRequest {string msg = 1}."""
    raw = msg.encode()
    return b"\x0a" + bytes([len(raw)]) + raw


def lighthouse_members(status_page: str) -> dict[str, str]:
    """Replica id -> Manager address, from the Lighthouse's status page (torchft 0.2.0)."""
    return dict(re.findall(r"<b>([^<]+)</b> <br/>\s*Step: \d+ <br/>\s*Manager: (\S+) <br/>",
                           status_page))


FAKE_REPLICA = Path(__file__).with_name("fake_replica.py")
# what a replica logs when it refuses the fake's pickle (spotctl.elastic.peerload)
REFUSED_HEAL = "a peer's heal named posix.system"


def refused_heals(cluster_dir: Path) -> int:
    """Heals the replicas of a local cluster have refused so far (their torchrun logs)."""
    return sum(p.read_text(errors="replace").count(REFUSED_HEAL)
               for p in cluster_dir.glob("nodes/*/torchrun.log"))


def run_fake_replica(lighthouse: str, marker: Path, cluster_dir: Path, want: int, log: Path,
                     env: dict[str, str], timeout: float = 120.0) -> int:
    """Run tests/security/fake_replica.py (torchft's own Manager at a very high step, its
    state a pickle that creates `marker` when loaded) against `lighthouse` until the
    cluster's replicas have refused `want` more heals, the payload ran, or `timeout`; then
    kill it. Returns the heals refused meanwhile."""
    before = refused_heals(cluster_dir)
    with socket.socket() as sk:  # the fake replica group's own store
        sk.bind(("127.0.0.1", 0))
        store_port = sk.getsockname()[1]
    with open(log, "ab") as out:
        fake = subprocess.Popen([sys.executable, str(FAKE_REPLICA), lighthouse, str(marker),
                                 str(store_port)], stdout=out, stderr=subprocess.STDOUT,
                                env=dict(env, RUST_LOG="warn"))
    try:
        deadline = time.monotonic() + timeout
        while (refused_heals(cluster_dir) - before < want and not marker.exists()
               and time.monotonic() < deadline):
            time.sleep(0.5)
    finally:
        fake.kill()
        fake.wait()
    return refused_heals(cluster_dir) - before
