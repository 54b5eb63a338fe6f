"""A fresh VM's SSH host keys (spotctl.providers.hostkeys.pin_published): the cloud
publishes them late in the VM's boot, so they are waited for before the first connection
(before, they were read once, found missing, and the first connection trusted whatever
key it met); a VM that never publishes them does not inherit an older VM's pin of its
reused address (before, the stale pin failed every connection to the new VM for good)."""

from __future__ import annotations

import base64
from pathlib import Path

from spotctl.providers.hostkeys import pin_published, wait_settings

ED = base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + b"k" * 32).decode()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def test_keys_published_late_are_waited_for_and_pinned(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text("10.0.0.5 ssh-ed25519 OLD\nother ssh-ed25519 KEEP\n")
    reads = iter([[], [], [("ssh-ed25519", ED)]])
    clock = Clock()
    assert pin_published(kh, "10.0.0.5", lambda: next(reads), fresh=True, wait_s=60,
                         poll_s=5, sleep=clock.sleep, clock=clock)
    assert clock.sleeps == [5, 5]
    assert kh.read_text().splitlines() == ["other ssh-ed25519 KEEP", f"10.0.0.5 ssh-ed25519 {ED}"]


def test_a_fresh_vm_without_keys_drops_the_addresss_old_pin(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text("10.0.0.5 ssh-ed25519 OLD\nother ssh-ed25519 KEEP\n")
    clock = Clock()
    assert not pin_published(kh, "10.0.0.5", lambda: [], fresh=True, wait_s=30, poll_s=5,
                             sleep=clock.sleep, clock=clock)
    assert clock.t == 30  # waited the whole bound
    assert kh.read_text().splitlines() == ["other ssh-ed25519 KEEP"]
    assert (kh.stat().st_mode & 0o777) == 0o600


def test_a_vm_seen_before_is_read_once_and_keeps_its_pin(tmp_path: Path) -> None:
    """A head that is reused (not fresh): its console may have scrolled past the keys; the
    pin from its first boot stands, and nothing is waited for."""
    kh = tmp_path / "known_hosts"
    kh.write_text(f"10.0.0.9 ssh-ed25519 {ED}\n")
    clock = Clock()
    assert not pin_published(kh, "10.0.0.9", lambda: [], fresh=False, wait_s=30, poll_s=5,
                             sleep=clock.sleep, clock=clock)
    assert clock.sleeps == []
    assert kh.read_text() == f"10.0.0.9 ssh-ed25519 {ED}\n"


def test_wait_settings(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("SPOTCTL_HOST_KEY_WAIT_S", raising=False)
    assert wait_settings({}) == (150.0, 5.0)
    assert wait_settings({"host_key_wait_s": 20, "host_key_poll_s": 2}) == (20.0, 2.0)
    monkeypatch.setenv("SPOTCTL_HOST_KEY_WAIT_S", "0.3")
    assert wait_settings({}) == (0.3, 0.3)
