"""Shared by the security tests: a HeadServer served in this process (the head API's
tests), and the fixtures of the tests that run a root agent whose workers run as another
user (test_worker_isolation.py, test_store_pickle.py)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spotctl.head.server import HeadServer


@contextmanager
def serve_head(d: Path, secret: str, **kw: Any) -> Iterator[HeadServer]:
    """A real HeadServer (no store) on a loopback port, served by a thread until the end."""
    srv = HeadServer(d, secret, with_store=False, **kw)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stop()
        t.join(5)


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
