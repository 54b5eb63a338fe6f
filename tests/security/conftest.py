"""Shared by the security tests: a HeadServer served in this process (the head API's
tests), and the fixtures of the tests that run a root agent whose workers run as another
user (test_worker_isolation.py, test_store_pickle.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spotctl.agent.config import AgentConfig
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
def interpreter_modes() -> Iterator[None]:
    """Held by every test that changes, or depends on, the modes of the directories above
    this interpreter (interpreter_reachable, and the tests that need it unreachable): one
    at a time across the parallel workers, or one's restored modes break another's run."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "spotctl-test-interpreter-modes.lock"),
              "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def interpreter_reachable(interpreter_modes: None) -> Iterator[None]:
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


def render_node(base: Path, run_as: str, python: str = sys.executable) -> Path:
    """The bootstrap's files for one node (no package: `python` must have spotctl and
    torch), written where the controller's SFTP would put them (umask 077 directories,
    each file with its rendered mode)."""
    from spotctl.remote.bootstrap import render_bootstrap
    from spotctl.remote.ssh import HostTarget

    node = base / "root" / "c1" / "n1"
    node.mkdir(parents=True, mode=0o700)
    for d in (base / "root", base / "root" / "c1", node):
        os.chmod(d, 0o700)
    (base / "root").parent.chmod(0o700)
    script = base / "train.py"
    cfg = AgentConfig(cluster="c1", node_id="n1", head_url="http://127.0.0.1:1",
                      store_host="127.0.0.1", store_port=1, token_file="", workdir="work",
                      script=str(script), run_as=run_as)
    files = render_bootstrap(HostTarget("n1", "127.0.0.1", remote_dir=str(node)), cfg,
                             "node:n1:" + "ab" * 32, python=python)
    for f in files.files:
        dst = node / f.name
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        dst.write_bytes(f.content)
        os.chmod(dst, f.mode)
    return node


def bootstrap_worker(node: Path) -> tuple[str, str]:
    """`bootstrap.sh worker` on the node: (the user workers run as or "none", its output)."""
    r = subprocess.run(["sh", str(node / "bootstrap.sh"), "worker"], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    result = [ln for ln in r.stdout.splitlines() if ln.startswith("spotctl-result ")]
    assert result, r.stdout
    return result[-1].split("worker=", 1)[1], r.stdout


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True,
                          timeout=60, cwd="/")
