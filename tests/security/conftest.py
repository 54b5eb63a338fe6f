"""Fixtures of the security tests that run a root agent whose workers run as another
user (tests/security/test_worker_isolation.py, test_store_pickle.py)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def base() -> Iterator[Path]:
    # Outside pytest's 0700 tmp tree: only the files' own modes may protect them here.
    d = Path(tempfile.mkdtemp(prefix="spotctl-runas-"))
    os.chmod(d, 0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def interpreter_reachable() -> Iterator[None]:
    """The worker user must be able to run the agent's interpreter. On a node the bootstrap
    installs it where that user can; here it may live under a 0700 home (pyenv in /root),
    so each directory above it gets search permission (o+x, no listing) for the test and
    its exact mode back afterwards."""
    import spotctl

    changed: dict[Path, int] = {}
    for target in (Path(os.path.realpath(sys.executable)), Path(sys.prefix),
                   Path(spotctl.__file__).parent):
        for d in list(target.parents)[::-1]:
            mode = d.stat().st_mode
            if d not in changed and not mode & stat.S_IXOTH:
                changed[d] = stat.S_IMODE(mode)
                os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        for d, mode in changed.items():
            os.chmod(d, mode)
