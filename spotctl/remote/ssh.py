"""SSH plumbing shared by the bootstrap, the `ssh` provider and the CLI.

Host keys are pinned per cluster: every connection verifies against the cluster's own
known_hosts file (never ~/.ssh/known_hosts, never disabled). The first contact with a
host records its key in that file (trust on first use, for that cluster only); a key that
differs from the recorded one refuses the host with an error naming host and fingerprints.
"""

from __future__ import annotations

import base64
import codecs
import fcntl
import hashlib
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from spotctl.errors import BootstrapError, NotFoundError

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

    from spotctl.state import NodeRow


@dataclass(frozen=True)
class HostTarget:
    """One machine to reach over SSH, as the node it becomes."""

    node_id: str  # the spotctl node id this host becomes (unique within the cluster)
    address: str  # hostname or IP the controller connects to
    port: int = 22
    user: str = "root"
    key_path: str = ""  # private key; "" = the user's ssh agent and default keys
    # The node's directory on the host. Relative paths are taken from the remote $HOME;
    # bootstrap resolves them before rendering, so render() always sees an absolute one.
    remote_dir: str = ""
    # The node's own interpreter its venv is made from, as the bootstrap's probe chose it
    # (spotctl.remote.interp); "" = the one the caller renders with.
    python: str = ""
    # that interpreter is older than some shipped pins allow: it installs older releases
    # of those from its package index (spotctl.remote.package)
    older_pins: bool = False

    @property
    def label(self) -> str:
        """How errors name the host: node id and where it is."""
        return f"{self.node_id} ({self.user}@{self.address}:{self.port})"

    @property
    def known_hosts_name(self) -> str:
        """The host's name in known_hosts, as OpenSSH and paramiko write it."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


@dataclass
class RemoteResult:
    """The outcome of one command run on a host."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style fingerprint, e.g. `SHA256:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU`."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# One lock per known_hosts path inside this process (threads of a parallel bootstrap),
# plus flock across processes (two `spotctl` commands on the same cluster).
_KH_LOCKS: dict[str, threading.Lock] = {}
_KH_LOCKS_GUARD = threading.Lock()


def _kh_lock(path: Path) -> threading.Lock:
    with _KH_LOCKS_GUARD:
        return _KH_LOCKS.setdefault(str(path.resolve()), threading.Lock())


class HostKeyChanged(BootstrapError):
    """The host offered a key other than the one pinned for this cluster."""


class PinnedHostKeyPolicy:
    """paramiko MissingHostKeyPolicy: record on first contact, refuse on mismatch.

    paramiko itself raises BadHostKeyException when the name is already known with a
    different key; this policy only sees names the client had not loaded. It re-reads the
    file under a lock, because another thread or process may have recorded the host since.
    """

    def __init__(self, known_hosts: Path):
        self.known_hosts = Path(known_hosts)

    def missing_host_key(self, client: Any, hostname: str, key: paramiko.PKey) -> None:
        import paramiko

        path = self.known_hosts
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _kh_lock(path), open(path.with_name(path.name + ".lock"), "w") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            keys = paramiko.HostKeys()
            if path.exists():
                keys.load(str(path))
            known = keys.lookup(hostname)
            if known is not None:
                ours = known.get(key.get_name()) or next(iter(known.values()), None)
                if ours is not None and ours != key:
                    raise HostKeyChanged(_changed_message(hostname, key, ours, path))
                if ours is not None:
                    return
            line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _changed_message(hostname: str, offered: Any, pinned: Any, path: Path) -> str:
    return (
        f"host key for {hostname} changed: it offered {offered.get_name()} "
        f"{fingerprint(offered)}, but this cluster pinned {pinned.get_name()} "
        f"{fingerprint(pinned)}; refusing the host (if it was rebuilt on purpose, "
        f"delete its line from {path})"
    )


def _retryable(exc: BaseException) -> bool:
    """Errors a booting VM produces (no listener yet, sshd starting, keys not installed)."""
    import paramiko

    if isinstance(exc, paramiko.BadHostKeyException | HostKeyChanged):
        return False
    return isinstance(exc, OSError | EOFError | paramiko.SSHException)


def _describe(exc: BaseException) -> str:
    import paramiko

    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errs = {e.strerror or str(e) for e in exc.errors.values()}
        return "; ".join(sorted(errs)) or "connection failed"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed ({exc})"
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def connect(
    target: HostTarget,
    known_hosts: Path,
    *,
    wait_s: float = 0.0,
    attempt_timeout_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Connection:
    """Open an SSH connection with the cluster's pinned host keys.

    Retries with exponential backoff (1 s doubling to 10 s) for up to `wait_s` seconds
    while the host is unreachable or its sshd is still coming up. A changed host key is
    never retried. Raises BootstrapError naming the host.
    """
    import paramiko
    from fabric import Config, Connection

    deadline = time.monotonic() + max(0.0, wait_s)
    delay = 1.0
    attempts = 0
    while True:
        attempts += 1
        # load_ssh_configs off: what we connect to and verify must not depend on
        # whatever ~/.ssh/config says on the controller.
        kwargs: dict[str, Any] = {
            "banner_timeout": attempt_timeout_s,
            "auth_timeout": attempt_timeout_s,
        }
        if target.key_path:
            kwargs.update(
                key_filename=[str(Path(target.key_path).expanduser())],
                look_for_keys=False,
                allow_agent=False,
            )
        conn = Connection(
            host=target.address,
            user=target.user,
            port=target.port,
            config=Config(overrides={"load_ssh_configs": False}),
            connect_timeout=max(1, int(attempt_timeout_s)),
            connect_kwargs=kwargs,
        )
        conn.client.set_missing_host_key_policy(PinnedHostKeyPolicy(known_hosts))
        if Path(known_hosts).exists():
            conn.client.get_host_keys().load(str(known_hosts))
        try:
            conn.open()
            return conn
        except paramiko.BadHostKeyException as e:
            conn.close()
            raise HostKeyChanged(
                _changed_message(target.known_hosts_name, e.key, e.expected_key, known_hosts)
            ) from None
        except Exception as e:
            conn.close()
            if not _retryable(e):
                if isinstance(e, BootstrapError):
                    raise
                raise BootstrapError(f"{target.label}: ssh failed: {_describe(e)}") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BootstrapError(
                    f"{target.label}: ssh unreachable after {attempts} attempt"
                    f"{'s' if attempts > 1 else ''} over {wait_s:.0f}s: {_describe(e)}"
                ) from None
            sleep(min(delay, remaining))
            delay = min(delay * 2, 10.0)


def run(conn: Connection, command: str, timeout_s: float | None = None) -> RemoteResult:
    """Run one command; never raises on a non-zero exit. Stdin is not forwarded."""
    r = conn.run(command, hide=True, warn=True, in_stream=False, timeout=timeout_s)
    return RemoteResult(exit_code=int(r.exited), stdout=r.stdout, stderr=r.stderr)


def run_remote(
    target: HostTarget, command: str, known_hosts: Path, *, wait_s: float = 0.0
) -> RemoteResult:
    """Connect, run `command`, disconnect."""
    conn = connect(target, known_hosts, wait_s=wait_s)
    try:
        return run(conn, command)
    finally:
        conn.close()


def ssh_argv(target: HostTarget, known_hosts: Path, command: list[str] | None = None) -> list[str]:
    """The system `ssh` command line for a node, pinned to the cluster's known_hosts."""
    argv = [
        "ssh",
        "-o", f"UserKnownHostsFile={known_hosts}",
        # The global file is ignored too: this cluster's pins are the only truth.
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-p", str(target.port),
    ]  # fmt: skip
    if target.key_path:
        argv += ["-i", str(Path(target.key_path).expanduser()), "-o", "IdentitiesOnly=yes"]
    argv += ["-l", target.user, target.address]
    if command:
        argv += ["--", shlex.join(command)]
    return argv


def open_shell(target: HostTarget, known_hosts: Path, command: list[str] | None = None) -> None:
    """Replace this process with `ssh` to the node (an interactive shell, or `command`)."""
    if not Path(known_hosts).exists():
        raise NotFoundError(
            f"{target.label}: no pinned host key yet ({known_hosts} missing); "
            "bootstrap the node first"
        )
    argv = ssh_argv(target, known_hosts, command)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


def tail_log(
    target: HostTarget,
    path: str,
    known_hosts: Path,
    *,
    follow: bool = False,
    lines: int = 200,
    out: TextIO | None = None,
) -> int:
    """Copy the last `lines` lines of a file on the node to `out` (and keep following).

    Returns the remote exit status (0 when the file was read). Ctrl-C ends a follow.
    """
    out = out or sys.stdout
    conn = connect(target, known_hosts)
    try:
        cmd = f"tail -n {int(lines)} {'-F ' if follow else ''}-- {shlex.quote(path)}"
        chan = conn.client.get_transport().open_session()  # type: ignore[union-attr]
        chan.exec_command(cmd)
        # Read to EOF, not to the exit status: sshd may report the exit before the last
        # of the output has arrived.
        chan.settimeout(0.5)
        # incremental: a UTF-8 character may be split across two reads
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        try:
            while True:
                try:
                    data = chan.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                out.write(decode(data))
                out.flush()
        except KeyboardInterrupt:
            chan.close()
            return 0
        err = b""
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        code = chan.recv_exit_status()
        if code != 0:
            msg = err.decode(errors="replace").strip().splitlines()
            raise NotFoundError(
                f"{target.label}: cannot read {path}: {msg[-1] if msg else f'exit {code}'}"
            )
        return code
    finally:
        conn.close()


def target_from_node(row: NodeRow, remote_dir: str = "") -> HostTarget:
    """The SSH target of a journaled node (NodeRow.meta holds address/port/user/key)."""
    meta = row.meta or {}
    address = str(meta.get("address") or meta.get("ssh_address") or row.address or "")
    if not address:
        raise NotFoundError(f"node {row.id}: no SSH address recorded")
    return HostTarget(
        node_id=row.id,
        address=address,
        port=int(meta.get("port") or meta.get("ssh_port") or 22),
        user=str(meta.get("user") or meta.get("ssh_user") or "root"),
        key_path=str(meta.get("key") or meta.get("ssh_key") or ""),
        remote_dir=str(meta.get("remote_dir") or remote_dir),
    )
