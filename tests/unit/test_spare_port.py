"""spotctl.sockets.spare_port: a port for a listener bound later (the local head's ports,
a node's torchft store), free when picked and outside the range outgoing connections take
their ports from."""

from __future__ import annotations

import socket

import pytest

from spotctl import sockets


def test_a_spare_port_is_below_the_ephemeral_range_and_free() -> None:
    low = sockets._ephemeral_low()
    for _ in range(20):
        port = sockets.spare_port()
        assert sockets.SPARE_LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a listener can take it


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        picks = iter([taken, taken, free])
        monkeypatch.setattr(sockets, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(sockets.random, "randint", lambda a, b: next(picks))
        assert sockets.spare_port() == free


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sockets, "_ephemeral_low", lambda: sockets.SPARE_LOW)
    port = sockets.spare_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ports_to_avoid_are_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    first = sockets.spare_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
    picks = iter([first, first, other])
    monkeypatch.setattr(sockets, "_ephemeral_low", lambda: 65535)
    monkeypatch.setattr(sockets.random, "randint", lambda a, b: next(picks))
    assert sockets.spare_port(avoid=(first,)) == other
