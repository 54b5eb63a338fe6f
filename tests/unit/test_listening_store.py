"""spotctl.sockets.listening_store: a master TCPStore on a socket bound to one address,
on every torch a node may bring. torch 2.7's libuv backend refuses a listening socket
(NotImplementedError, before it takes it); 2.9 and newer take it. The refusal is
reproduced here as torch 2.7 raises it; `scripts/test-node-torch 2.7.1` runs the real one."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spotctl import sockets


def _client_reads(port: int) -> bytes:
    c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                      use_libuv=True)
    return bytes(c.get("k"))


def _refused_elsewhere(port: int) -> None:
    """Nothing listens on another local address (the store took the socket bound to
    127.0.0.1, not every interface)."""
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.2", port)) != 0


def test_the_store_listens_on_its_address_only() -> None:
    store = sockets.listening_store("127.0.0.1", 0, world_size=None, wait_for_workers=False,
                                    multi_tenant=True)
    store.set("k", "v")
    assert _client_reads(store.port) == b"v"
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9):
        assert store.libuvBackend  # the classic backend only where libuv refuses
    _refused_elsewhere(store.port)


def test_a_libuv_backend_that_refuses_the_socket_gets_the_classic_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = dist.TCPStore
    refused = []

    def torch27(*a: Any, **kw: Any) -> Any:
        if kw.get("use_libuv") and kw.get("master_listen_fd") is not None:
            refused.append(kw["master_listen_fd"])
            raise NotImplementedError("The libuv TCPStore backend does not support "
                                      "initialization with an listen fd.")
        return real(*a, **kw)

    monkeypatch.setattr(dist, "TCPStore", torch27)
    store = sockets.listening_store("127.0.0.1", 0, world_size=1,
                                    timeout=timedelta(seconds=10))
    monkeypatch.undo()
    assert len(refused) == 1 and not store.libuvBackend
    store.set("k", "v")
    assert _client_reads(store.port) == b"v"
    _refused_elsewhere(store.port)
