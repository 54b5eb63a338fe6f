"""The shared test rig (tests/conftest.py) does what it promises."""

from __future__ import annotations

import socket

import pytest

from tests import conftest


def test_network_guard_refuses_beyond_loopback_and_fails_the_test() -> None:
    with socket.socket() as s, pytest.raises(conftest.NetworkGuardError, match="192.0.2.1"):
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed
    with pytest.raises(conftest.NetworkGuardError, match="example.invalid"):
        socket.getaddrinfo("example.invalid", 80)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, pytest.raises(OSError):
        u.sendto(b"x", ("198.51.100.1", 53))
    # recorded even when the code under test swallows the error: the autouse fixture
    # fails the test at teardown (cleared here, since this test provokes them on purpose)
    assert len(conftest._violations) == 3, conftest._violations
    conftest._violations.clear()


def test_network_guard_lets_loopback_and_namespaces_through() -> None:
    port = conftest.free_port()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", port))
        srv.listen()
        with socket.create_connection(("localhost", port), timeout=5):
            pass
    for host in ("127.0.0.1", "127.3.4.5", "::1", "10.213.7.2", "localhost", None):
        assert conftest._allowed_host(host), host
    for host in ("10.0.0.1", "8.8.8.8", "2001:db8::1", "metadata.google.internal"):
        assert not conftest._allowed_host(host), host
    assert conftest._violations == []


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    seen = iter([0, 0, 7])
    assert conftest.wait_until(lambda: next(seen), 5, "seven", 0.01) == 7
    with pytest.raises(AssertionError, match="waiting for never; last: False"):
        conftest.wait_until(lambda: False, 0.05, "never", 0.01)


@pytest.mark.ssh
def test_sshd_factory_takes_another_port_when_its_pick_was_taken(
        sshd_factory: conftest.SshdFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    if conftest.sshd_missing():
        pytest.skip(conftest.sshd_missing() or "")
    # someone else's sshd grabs the port this factory picks first (seen in CI with
    # pytest-xdist: 'Bind to port ... failed: Address already in use')
    other = sshd_factory.start()
    picks = iter([other.port, conftest.free_port()])
    monkeypatch.setattr(conftest, "free_port", lambda: next(picks))
    mine = sshd_factory.start()
    assert mine.port != other.port and mine.proc.poll() is None
    with pytest.raises(conftest.PortTaken):  # a port asked for is not replaced
        sshd_factory.start(port=other.port)
