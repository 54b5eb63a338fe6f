"""Fixtures for the `ssh` marker: real OpenSSH sshd processes on loopback.

Each sshd runs as a non-daemon child (`sshd -D -e -f <config>`) on a free 127.0.0.1 port,
with its own ed25519 host key and one authorized test key. Tests skip only when sshd is
missing and cannot be installed (scripts/install-sshd).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SSHD = "/usr/sbin/sshd"


def _ensure_sshd() -> str | None:
    """Return why sshd is unusable, or None. Tries scripts/install-sshd once."""
    if not (os.path.exists(SSHD) and shutil.which("ssh-keygen")):
        subprocess.run([str(REPO / "scripts" / "install-sshd")], capture_output=True)
    if not os.path.exists(SSHD):
        return "OpenSSH sshd is not installed and scripts/install-sshd could not install it"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spotctl-test", "-f", str(path)],
        check=True,
    )
    return path


@dataclass
class Sshd:
    """A running sshd on 127.0.0.1:port."""

    port: int
    host_key: Path  # private host key; the public one is host_key.with_suffix(".pub")
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def host_pub(self) -> str:
        return Path(str(self.host_key) + ".pub").read_text().split()[1]


class SshdFactory:
    def __init__(self, base: Path, client_key: Path):
        self.base = base
        self.client_key = client_key
        self.started: list[Sshd] = []
        self.n = 0

    def start(self, port: int | None = None, host_key: Path | None = None) -> Sshd:
        self.n += 1
        d = self.base / f"sshd{self.n}"
        d.mkdir(mode=0o700)
        port = port or free_port()
        host_key = host_key or keygen(d / "host_ed25519")
        auth = d / "authorized_keys"
        auth.write_text(Path(str(self.client_key) + ".pub").read_text())
        sftp = next(
            (
                p
                for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server")
                if os.path.exists(p)
            ),
            "internal-sftp",
        )
        cfg = d / "sshd_config"
        cfg.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
            f"PidFile {d / 'sshd.pid'}\nAuthorizedKeysFile {auth}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\nPermitRootLogin yes\nStrictModes no\nUsePAM no\n"
            f"Subsystem sftp {sftp}\nLogLevel VERBOSE\nMaxStartups 50\n"
        )
        # sshd insists on its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = d / "sshd.log"
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(cfg)],
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        sshd = Sshd(port, host_key, proc, log)
        self.started.append(sshd)
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return sshd
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd not listening: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop_all(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture(scope="session")
def client_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = _ensure_sshd()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("client")
    return keygen(d / "id_ed25519")


@pytest.fixture
def sshd_factory(tmp_path: Path, client_key: Path) -> Iterator[SshdFactory]:
    f = SshdFactory(tmp_path, client_key)
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture
def sshd(sshd_factory: SshdFactory) -> Sshd:
    return sshd_factory.start()


class StandinHead:
    """A stand-in for the head's coordinator API: token-checked heartbeats and status.

    Used while the lead's head (spotctl/head) is not there; it speaks the planned API:
    `POST /api/heartbeat {"node_id": ...}` and `GET /api/status` -> {"nodes": {...}}.
    """

    def __init__(self, token: str):
        self.token = token
        self.nodes: dict[str, dict[str, float]] = {}
        self.rejected = 0
        head = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _auth(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {head.token}":
                    head.rejected += 1
                    self.send_response(401)
                    self.end_headers()
                    return False
                return True

            def do_GET(self) -> None:
                if not self._auth():
                    return
                body = json.dumps({"nodes": head.nodes}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if not self._auth():
                    return
                n = int(self.headers.get("Content-Length") or 0)
                data = json.loads(self.rfile.read(n) or b"{}")
                head.nodes[data["node_id"]] = {"last_heartbeat": time.time(), "state": "up"}
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def head() -> Iterator[StandinHead]:
    h = StandinHead("tok-" + os.urandom(16).hex())
    try:
        yield h
    finally:
        h.close()


def agent_argv(node_dir: str) -> list[str]:
    """How the test agents are started: the stand-in (see standin_agent.py)."""
    return [
        sys.executable,
        str(Path(__file__).with_name("standin_agent.py")),
        "--config",
        f"{node_dir}/agent.json",
    ]
