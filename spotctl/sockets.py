"""Listening sockets for spotctl's TCPStores (and the stores on them, torch imported only
when one is made), and what counts as a loopback address, in a
module that imports no torch (the head and its supervisor import it; `spotctl.elastic`
costs seconds of CPU to import)."""

from __future__ import annotations

import ipaddress
import random
import socket
from typing import Any


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


def listening_store(addr: str, port: int, **kw: Any) -> Any:
    """A master TCPStore (torch.distributed) that listens on `addr` only, on a socket of
    `listening_socket`'s, which the store owns (and closes) from here on. `kw`: TCPStore's
    own (world_size, timeout, wait_for_workers, multi_tenant). libuv's backend where it
    takes a listening socket (torch 2.9 and newer do); torch 2.7's refuses one
    (NotImplementedError) and gets the classic backend instead, on the same socket,
    rather than a listener on every interface."""
    from torch.distributed import TCPStore

    sock = listening_socket(addr, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return TCPStore(addr, bound, is_master=True, master_listen_fd=fd, use_libuv=True, **kw)
    except NotImplementedError:  # refused before it took the socket: still open here
        return TCPStore(addr, bound, is_master=True, master_listen_fd=fd, use_libuv=False, **kw)


SPARE_LOW = 15000  # the lowest port spare_port picks


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def spare_port(host: str = "127.0.0.1", tries: int = 64, avoid: tuple[int, ...] = ()) -> int:
    """A port that is free on `host` now, for a listener that binds it later (a head's
    ports, kept across its restarts): below the kernel's ephemeral range, from which every
    outgoing connection takes its own port, so that none can take it in between (a port
    the kernel handed out for a bind to port 0 is in that range: on a busy machine an
    outgoing connection took one before the head bound it, and the head could not start).
    Random in [SPARE_LOW, ephemeral start), none of `avoid` (ports picked but not bound
    yet); the kernel's pick when that range is empty or nothing in it was free."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    hi = _ephemeral_low() - 1
    for _ in range(tries if hi > SPARE_LOW else 0):
        port = random.randint(SPARE_LOW, hi)
        if port in avoid:
            continue
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT is not free
            except OSError:
                continue
            return port
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
