"""Fixtures for the `ssh` marker: real OpenSSH sshd processes on loopback.

They live in tests/conftest.py (`Sshd`, `SshdFactory`, `client_key`, `sshd_factory`, `sshd`,
`Head`, `head`); the names stay importable from here. Tests skip only when sshd is not
installed; scripts/test installs it (scripts/install-sshd) before pytest starts, never a
test mid-session."""

import fcntl
from collections.abc import Iterator

import pytest

from tests.conftest import (  # noqa: F401
    REPO,
    SSHD,
    Head,
    Sshd,
    SshdFactory,
    client_key,
    free_port,
    head,
    keygen,
    sshd,
    sshd_factory,
)


@pytest.fixture
def cleanroom_account() -> Iterator[None]:
    """The clean-room tests share one throwaway host account (its home, its processes):
    they take turns, also when two xdist workers run their files at once."""
    with open("/tmp/spotctl-cleanroom-account.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
