"""How agents on the user's own hosts (the `ssh` provider) reach a head that runs on the
controller and listens on the controller's 127.0.0.1 only: a reverse SSH forward per host.

For each host a detached process (`python -m spotctl.remote.revtunnel SPEC.json`) logs in
with the host key pinned in the cluster's known_hosts and asks sshd for remote forwards
bound to the *host's* loopback (sshd's default GatewayPorts=no): the head's coordinator API
and its store (and torchft's Lighthouse, for engine torchft). The agent on that host is configured with `http://127.0.0.1:<api>` and
`127.0.0.1:<store>`, so the store is never opened to any network: only processes on the
controller and on the joined hosts' loopback reach it, as over any SSH session.

The process writes `<name>.json` next to its spec once both forwards are bound (the ports
the host gave, when it was asked for any), keeps the session alive, reconnects with backoff
when it drops (asking for the same ports again), and exits on SIGTERM or when its spec file
is removed. `ensure()` starts one or reuses a live one; `stop()` ends it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spotctl.errors import BootstrapError
from spotctl.remote.tunnel import pump

__all__ = ["TunnelPorts", "TunnelSpec", "ensure", "ensure_ports", "stop", "stop_all"]


@dataclass
class TunnelSpec:
    name: str  # node id
    address: str
    port: int
    user: str
    key_file: str
    known_hosts: str
    local_api: int  # the head's ports on the controller's 127.0.0.1
    local_store: int
    remote_api: int = 0  # 0: the host picks (then kept across reconnects)
    remote_store: int = 0
    local_lighthouse: int = 0  # the head's torchft Lighthouse (0: none, no forward)
    remote_lighthouse: int = 0


@dataclass(frozen=True)
class TunnelPorts:
    """The host-side ends of one host's forwards (lighthouse 0: not forwarded)."""

    api: int
    store: int
    lighthouse: int = 0


_REMOTE_KEYS = ("remote_api", "remote_store", "remote_lighthouse")


def _ports(st: dict[str, Any]) -> TunnelPorts:
    return TunnelPorts(int(st["api"]), int(st["store"]), int(st.get("lighthouse") or 0))


def _paths(base: Path, name: str) -> tuple[Path, Path, Path]:
    return base / f"{name}.spec.json", base / f"{name}.json", base / f"{name}.log"


def _alive(pid: int, spec_path: Path) -> bool:
    try:
        os.kill(pid, 0)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError):
        return False
    return str(spec_path).encode() in cmd


def ensure(base: Path, spec: TunnelSpec, timeout_s: float = 60.0) -> tuple[int, int]:
    """Start (or reuse) the tunnel for `spec.name`; returns the host-side (api, store) ports."""
    p = ensure_ports(base, spec, timeout_s)
    return p.api, p.store


def ensure_ports(base: Path, spec: TunnelSpec, timeout_s: float = 60.0) -> TunnelPorts:
    """Start (or reuse) the tunnel for `spec.name`; returns every host-side port."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    spec_path, state_path, log_path = _paths(base, spec.name)
    if state_path.exists():
        try:
            st = json.loads(state_path.read_text())
            old = json.loads(spec_path.read_text())
            same = all(old.get(k) == v for k, v in asdict(spec).items()
                       if k not in _REMOTE_KEYS)  # fmt: skip
            if same and _alive(int(st["pid"]), spec_path):
                return _ports(st)
        except (OSError, ValueError, KeyError):
            pass
        stop(base, spec.name)
    spec_path.write_text(json.dumps(asdict(spec)))
    os.chmod(spec_path, 0o600)
    state_path.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spotctl.remote.revtunnel", str(spec_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if state_path.exists():
            return _ports(json.loads(state_path.read_text()))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = (
        log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
    )
    if proc.poll() is None:
        proc.terminate()
    raise BootstrapError(
        f"{spec.name}: reverse tunnel to {spec.user}@{spec.address}:{spec.port} did not come up"
        + (f": {tail[0]}" if tail else "")
    )


def stop(base: Path, name: str) -> None:
    spec_path, state_path, _ = _paths(base, name)
    pid = 0
    try:
        pid = int(json.loads(state_path.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        pass
    alive = bool(pid) and _alive(pid, spec_path)
    spec_path.unlink(missing_ok=True)
    state_path.unlink(missing_ok=True)
    if alive:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def stop_all(base: Path) -> None:
    if base.is_dir():
        for p in base.glob("*.spec.json"):
            stop(base, p.name[: -len(".spec.json")])


# ---- the tunnel process ------------------------------------------------------------------


_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (/proc/net)


def _exposed(listing: str, ports: list[int]) -> list[str]:
    """From the host's /proc/net/tcp{,6}: the forwarded ports that listen on anything but
    loopback (sshd's GatewayPorts=yes binds remote forwards on every interface)."""
    bad = []
    for line in listing.splitlines()[:100_000]:
        f = line.split()
        if len(f) < 4 or f[3] != "0A" or ":" not in f[1]:
            continue  # a header, or not a listening socket
        addr, _, port_hex = f[1].partition(":")
        try:
            port = int(port_hex, 16)
        except ValueError:
            continue
        if port in ports and addr.upper() not in _LOOPBACK:
            bad.append(f"{port} on {'every interface' if set(addr) == {'0'} else addr}")
    return bad


def _check_loopback(transport: Any, ports: list[int]) -> None:
    """The forwards must be bound to the host's loopback only: the store and the Lighthouse
    have no authentication. Refuse (one line) when the host's sshd bound them elsewhere."""
    chan = transport.open_session(timeout=15)
    chan.settimeout(15)
    chan.exec_command("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    out = b""
    try:
        while len(out) < (8 << 20):
            chunk = chan.recv(65536)
            if not chunk:
                break
            out += chunk
    finally:
        chan.close()
    if not out:
        print("revtunnel: cannot read the host's listening sockets (/proc/net/tcp); the "
              "forwards' bind address is not verified", flush=True)
        return
    bad = _exposed(out.decode(errors="replace"), ports)
    if bad:
        raise BootstrapError(
            f"the host's sshd binds reverse forwards beyond loopback (port {', '.join(bad)}: "
            f"GatewayPorts yes), which would open the head's store and Lighthouse to its "
            f"network; set GatewayPorts no (or clientspecified) in its sshd_config")


def _serve(spec: TunnelSpec, spec_path: Path, state_path: Path) -> None:
    from spotctl.remote.ssh import HostTarget, connect

    target = HostTarget(spec.name, spec.address, spec.port, spec.user, spec.key_file, "")
    conn = connect(target, Path(spec.known_hosts), wait_s=30.0)
    transport = conn.client.get_transport()
    if transport is None:
        raise BootstrapError("ssh transport closed")
    transport.set_keepalive(15)
    to_local: dict[int, int] = {}

    def handler(chan: Any, origin: Any, server: tuple[str, int]) -> None:
        local = to_local.get(int(server[1]))
        try:
            if local is None:
                raise OSError(f"no forward for port {server[1]}")
            sock = socket.create_connection(("127.0.0.1", local), timeout=10)
            sock.settimeout(None)
        except OSError:
            chan.close()
            return
        threading.Thread(target=pump, args=(chan, sock), daemon=True).start()

    api = transport.request_port_forward("127.0.0.1", spec.remote_api, handler)
    to_local[int(api)] = spec.local_api
    store = transport.request_port_forward("127.0.0.1", spec.remote_store, handler)
    to_local[int(store)] = spec.local_store
    spec.remote_api, spec.remote_store = int(api), int(store)
    lighthouse = 0
    if spec.local_lighthouse:
        lighthouse = int(transport.request_port_forward("127.0.0.1", spec.remote_lighthouse,
                                                        handler))  # fmt: skip
        to_local[lighthouse] = spec.local_lighthouse
        spec.remote_lighthouse = lighthouse
    try:
        _check_loopback(transport, list(to_local))
    except Exception:
        conn.close()  # the forwards go with the session
        raise
    tmp = state_path.with_name(state_path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "api": api, "store": store,
                               "lighthouse": lighthouse}))  # fmt: skip
    os.replace(tmp, state_path)
    print(f"revtunnel {spec.name}: host 127.0.0.1:{api} -> head api, :{store} -> store"
          + (f", :{lighthouse} -> lighthouse" if lighthouse else ""), flush=True)
    while transport.is_active() and spec_path.exists():
        time.sleep(1.0)
    conn.close()


def main(argv: list[str]) -> int:
    spec_path = Path(argv[0])
    spec = TunnelSpec(**json.loads(spec_path.read_text()))
    state_path = _paths(spec_path.parent, spec.name)[1]
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    delay = 1.0
    while spec_path.exists():
        t0 = time.monotonic()
        try:
            _serve(spec, spec_path, state_path)
        except Exception as e:
            print(f"revtunnel {spec.name}: {type(e).__name__}: {e}", flush=True)
            if not state_path.exists():
                return 1  # never came up: ensure() reports this line
        if not spec_path.exists():
            break
        delay = 1.0 if time.monotonic() - t0 > 60 else min(delay * 2, 30.0)
        time.sleep(delay)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
