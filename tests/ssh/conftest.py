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
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class Head:
    """The real head (`spotctl head`) as a child process on loopback."""

    def __init__(self, base: Path):
        import secrets

        self.dir = base / "head"
        self.dir.mkdir(mode=0o700)
        self.token = secrets.token_urlsafe(32)
        self.token_file = base / "head-token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, self.token.encode())
        os.close(fd)
        # What the agents' torchrun runs in bootstrap tests: nothing, for a long time.
        self.script = base / "idle_train.py"
        self.script.write_text("import time\ntime.sleep(3600)\n")
        http_port, store_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{http_port}"
        self.store_port = store_port
        self.log = self.dir / "head.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spotctl.cli.app",
                "head",
                "--dir",
                str(self.dir),
                "--token-file",
                str(self.token_file),
                "--host",
                "127.0.0.1",
                "--http-port",
                str(http_port),
                "--store-port",
                str(store_port),
            ],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"head did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _get(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return dict(json.load(r))

    def healthy(self) -> bool:
        try:
            return bool(self._get("/api/health").get("ok"))
        except OSError:
            return False

    def status(self) -> dict[str, Any]:
        return self._get("/api/status")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    h = Head(tmp_path)
    try:
        yield h
    finally:
        h.close()
