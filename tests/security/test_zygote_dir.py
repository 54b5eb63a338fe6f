"""Issue 60, finding 3: the zygote's directory. It was `$TMPDIR/spotctl-<uid>`, a fixed
name in a shared temp dir: another local user who made it first kept it (the root agent
chmodded it, but it stayed theirs) and answered in the zygote's place, receiving every
launcher's argv, environment and stdio. Now it is `run-<uid>` in the node's work dir, or
a fresh mkdtemp directory where that path is too long for a unix socket, and a directory
in its place that its owner did not make is refused, never used.

The neighbour is `daemon` and the training user `nobody` (both on every Debian/Ubuntu
image), as root agents run them on a node (tests/security/test_worker_isolation.py)."""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from spotctl.agent import runas
from spotctl.agent.supervisor import SUN_PATH_MAX, _zygote_path, remove_zygote_dirs
from tests.security.conftest import as_user

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="a neighbour and a training user need a root test (as on a VM)")

NEIGHBOUR = "daemon"
CONNECT = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
           "    s.connect(sys.argv[1]); print('CONNECTED')\n"
           "except OSError as e:\n    print('REFUSED', e.errno)\n")


def _worker() -> runas.WorkerUser:
    w = runas.resolve("nobody")
    assert w is not None
    return w


def test_a_squatted_temp_dir_is_not_used_and_a_neighbour_cannot_reach_the_zygote(
        base: Path, interpreter_reachable: None) -> None:
    w = _worker()
    work = base / "n1"
    work.mkdir(mode=0o711)
    # the neighbour makes the old directory first, open to all, with a socket name ready
    old = Path(tempfile.gettempdir()) / f"spotctl-{w.uid}"
    created_old = not old.exists()
    if created_old:
        r = as_user(NEIGHBOUR, sys.executable, "-c",
                    f"import os; os.mkdir({str(old)!r}); os.chmod({str(old)!r}, 0o777)")
        assert r.returncode == 0, r.stderr
    zyg: subprocess.Popen[bytes] | None = None
    try:
        path = _zygote_path(work, w)
        assert path is not None
        assert old not in path.parents, f"the zygote's socket {path} is in the squatted {old}"
        st = os.lstat(path.parent)
        assert (st.st_uid, stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode)) == \
            (w.uid, 0o700, True)
        if created_old:  # the neighbour's directory stays the neighbour's, untouched
            assert os.lstat(old).st_uid == pwd.getpwnam(NEIGHBOUR).pw_uid
            assert stat.S_IMODE(os.lstat(old).st_mode) == 0o777
        # the real zygote, as the training user, on that path
        zyg = subprocess.Popen(
            [sys.executable, "-m", "spotctl.agent.zygote", str(path)],
            env=w.env(dict(os.environ)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=str(work), **w.popen_kwargs())
        deadline = time.monotonic() + 60
        while not path.exists() and zyg.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), "the zygote did not bind its socket"
        # its own user reaches it; the neighbour does not
        assert as_user("nobody", sys.executable, "-c", CONNECT, str(path)).stdout.strip() \
            == "CONNECTED"
        out = as_user(NEIGHBOUR, sys.executable, "-c", CONNECT, str(path)).stdout.strip()
        assert out == "REFUSED 13", out  # EACCES: the 0700 directory
    finally:
        if zyg is not None:
            zyg.kill()
            zyg.wait()
        if created_old:
            os.rmdir(old)
        remove_zygote_dirs(work)


def test_a_directory_its_owner_did_not_make_is_refused(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = _worker()
    neighbour = pwd.getpwnam(NEIGHBOUR)
    for what in ("another user's", "open to all", "a link"):
        work = base / what.replace(" ", "-").replace("'", "")
        work.mkdir()
        run = work / f"run-{w.uid}"
        if what == "a link":
            (work / "elsewhere").mkdir(mode=0o700)
            os.chown(work / "elsewhere", w.uid, w.gid)
            run.symlink_to(work / "elsewhere")
        else:
            run.mkdir()
            if what == "another user's":
                os.chown(run, neighbour.pw_uid, neighbour.pw_gid)
                os.chmod(run, 0o700)
            else:
                os.chown(run, w.uid, w.gid)
                os.chmod(run, 0o777)
        with caplog.at_level(logging.ERROR, logger="spotctl.agent"):
            caplog.clear()
            assert _zygote_path(work, w) is None, what
        assert [r.message for r in caplog.records if "no warm zygote" in r.message], what
        assert os.lstat(run).st_uid in (neighbour.pw_uid, 0, w.uid)
        if what == "another user's":
            assert os.lstat(run).st_uid == neighbour.pw_uid  # not taken over


def test_a_long_work_dir_gets_a_fresh_directory(base: Path) -> None:
    w = _worker()
    work = base / ("w" * 100)
    work.mkdir()
    path = _zygote_path(work, w)
    assert path is not None and len(os.fsencode(str(path))) <= SUN_PATH_MAX
    try:
        st = os.lstat(path.parent)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (w.uid, 0o700)
        assert path.parent.parent == Path(tempfile.gettempdir())
        again = _zygote_path(work, w)
        assert again is not None and again.parent != path.parent  # never a name reused
    finally:
        remove_zygote_dirs(work)
    assert not path.parent.exists()


def test_own_dir_refuses_a_link(base: Path) -> None:
    w = _worker()
    target = base / "target"
    target.mkdir(mode=0o755)
    (base / "link").symlink_to(target)
    with pytest.raises(ValueError):
        runas.own_dir(base / "link", w)
    st = os.stat(target)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)  # neither chowned nor chmodded
