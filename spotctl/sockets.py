"""Listening sockets for spotctl's TCPStores, and what counts as a loopback address, in a
module that imports no torch (the head and its supervisor import it; `spotctl.elastic`
costs seconds of CPU to import)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(address: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1, `[::1]`) or `localhost`: reachable from this
    machine only. Any other host name is not."""
    a = address.strip("[]").lower()
    if a in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(a).is_loopback
    except ValueError:
        return False


def listening_socket(addr: str, port: int) -> socket.socket:
    """A TCP listener bound to `addr` only, for a TCPStore (`master_listen_fd`): its own
    listener takes every interface whatever host it is given, and the store has no
    authentication."""
    fam, _, _, _, sa = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sa)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock
