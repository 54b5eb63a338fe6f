"""The controller's way to the head's coordinator API on a cloud: an SSH local port
forward to the head VM (host keys pinned per cluster), since the API port is open only
inside the cluster's security group / firewall. One forward per process, reused."""

from __future__ import annotations

import select
import socket
import threading
from pathlib import Path
from typing import Any

from spotctl.errors import BootstrapError

_tunnels: dict[tuple[str, int, int, str], tuple[Any, int]] = {}
_lock = threading.Lock()


def pump(chan: Any, sock: socket.socket) -> None:
    """Copy bytes both ways between an SSH channel and a socket until either closes
    (the controller's forward here, the ssh provider's reverse forward in revtunnel)."""
    try:
        while True:
            r, _, _ = select.select([sock, chan], [], [], 30)
            if not r:
                continue
            if sock in r:
                data = sock.recv(65536)
                if not data:
                    break
                chan.sendall(data)
            if chan in r:
                data = chan.recv(65536)
                if not data:
                    break
                sock.sendall(data)
    except OSError:
        pass
    finally:
        chan.close()
        sock.close()


def local_url(tunnel: dict[str, Any], known_hosts: Path) -> str:
    """Open (or reuse) a forward 127.0.0.1:<local> -> head <remote_host>:<remote_port> over
    SSH and return the local URL. `tunnel` holds address, port, user, key_file, remote_port
    and remote_host (the address the head listens on, its VM's private one; 127.0.0.1 for
    records written before it was kept)."""
    from spotctl.remote.ssh import HostTarget, connect

    key = (str(tunnel["address"]), int(tunnel.get("port", 22)), int(tunnel["remote_port"]),
           str(tunnel.get("remote_host") or "127.0.0.1"))
    with _lock:
        if key in _tunnels:
            return f"http://127.0.0.1:{_tunnels[key][1]}"
        target = HostTarget("head", key[0], key[1], str(tunnel.get("user", "")),
                            str(tunnel.get("key_file", "")), "")
        conn = connect(target, known_hosts, wait_s=float(tunnel.get("wait_s", 10)))
        transport = conn.client.get_transport()
        if transport is None:
            raise BootstrapError(f"head {key[0]}: ssh transport closed")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]

        def serve() -> None:
            while True:
                try:
                    sock, peer = listener.accept()
                except OSError:
                    return
                try:
                    chan = transport.open_channel("direct-tcpip", (key[3], key[2]), peer)
                except Exception:
                    sock.close()
                    continue
                threading.Thread(target=pump, args=(chan, sock), daemon=True).start()

        threading.Thread(target=serve, daemon=True, name="head-tunnel").start()
        _tunnels[key] = (conn, port)
        return f"http://127.0.0.1:{port}"
