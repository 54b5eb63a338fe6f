"""Training workers as an unprivileged user: when the agent runs as root (a cloud VM's
systemd unit), torchrun, the warm zygote and every worker run as `AgentConfig.run_as`,
who cannot read the node token (0600, the agent's) or anything else private to the agent.

The drop happens in the child between fork and exec (subprocess's user/group/extra_groups:
setgroups(initgroups list), setregid, setreuid), so nothing of the child runs privileged
code of its own. The agent keeps root to signal its workers, and reads what workers write
(status files, the rendezvous gate) without following links or blocking on FIFOs.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("spotctl.agent")
MAX_STATUS_BYTES = 1 << 20


@dataclass(frozen=True)
class WorkerUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def popen_kwargs(self) -> dict[str, Any]:
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self, env: dict[str, str]) -> dict[str, str]:
        env.update(HOME=self.home, USER=self.name, LOGNAME=self.name)
        return env

    def owns(self, pid: int) -> bool:
        """Whether `pid` runs as this user (the agent signals nothing else)."""
        try:
            return os.stat(f"/proc/{pid}").st_uid == self.uid
        except OSError:
            return False


def resolve(run_as: str) -> WorkerUser | None:
    """The user workers run as, or None when they run as the agent's own user (no run_as,
    or the agent is not root and so cannot switch)."""
    if not run_as:
        return None
    if os.geteuid() != 0:
        log.warning("run_as=%s ignored: the agent is not root, so training workers run as "
                    "its own user and can read its node token", run_as)
        return None
    try:
        pw = pwd.getpwnam(run_as)
    except KeyError:
        raise ValueError(f"run_as: there is no user {run_as!r} on this node") from None
    if pw.pw_uid == 0:
        raise ValueError(f"run_as: {run_as!r} is root; name an unprivileged user")
    groups = tuple(g for g in os.getgrouplist(pw.pw_name, pw.pw_gid) if g != 0)
    return WorkerUser(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)


def own_dir(path: Path, user: WorkerUser, mode: int = 0o700) -> None:
    """Make `path` a directory of `user` (created if missing). Refuses a link or a
    non-directory in its place rather than chown something it points at; the chown and
    chmod go through a descriptor opened without following links, so a link swapped in
    after the check is refused too (where fs.protected_symlinks is 0)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise ValueError(f"{path} is not a directory (or is a link)") from None
    try:
        os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


class UnsafeDir(ValueError):
    """A directory in the place of one only its owner may have made."""


def private_dir(path: Path, uid: int, gid: int, made: bool = False) -> Path:
    """`path` as a directory only `uid` can use: created here (mkdir, mode 0700; made over
    to `uid` through a descriptor that follows no link), or an existing one that is no
    link, is owned by `uid` and lets nobody else in. Anything else in its place raises
    UnsafeDir naming what is wrong: another user's directory is never taken over. `made`:
    this process has just created `path` itself (mkdtemp)."""
    created = True
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        created = made
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise UnsafeDir(f"{path} is not a directory this process made (a link or a file "
                        f"is in its place: {e.strerror})") from None
    try:
        st = os.fstat(fd)
        if created and (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        if st.st_uid != uid:
            raise UnsafeDir(f"{path} belongs to uid {st.st_uid}, not {uid}: another user "
                            f"made it; refusing to use it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafeDir(f"{path} has mode {stat.S_IMODE(st.st_mode):o}; it must let "
                            f"only its owner in (0700)")
    finally:
        os.close(fd)
    return path


def allow_search(path: Path) -> None:
    """Let other users traverse `path` (o+x), not list or write it."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
        os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


_CHECK = """
import importlib.util, os, sys
bad = [p for p, m in zip(sys.argv[1::2], sys.argv[2::2]) if not os.access(p, int(m))]
for mod in ("spotctl", "torch"):
    try:
        if importlib.util.find_spec(mod) is None:
            bad.append("python module " + mod)
    except Exception:
        bad.append("python module " + mod)
print("\\n".join(bad))
"""


def _run_as(user: WorkerUser, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd="/", env={
                              "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                              "HOME": user.home}, **user.popen_kwargs())


def unusable(user: WorkerUser, python: str, want: dict[str, int]) -> list[str]:
    """What `user` cannot use of what workers need: `python` (run it and find spotctl and
    torch with it) and the paths of `want` ({path: os.access mode}). Checked by running
    that interpreter as that user, the way torchrun will be started."""
    args = [x for p, m in want.items() for x in (p, str(m))]
    try:
        r = _run_as(user, [python, "-c", _CHECK, *args], 120)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"{python} ({e})"]
    if r.returncode != 0:
        return [f"{python} (exit {r.returncode}: {r.stderr.strip()[-200:]})"]
    return [ln for ln in r.stdout.splitlines() if ln]


# Prints the first path the running user could write (or replace, through a writable
# directory above it) among what this interpreter loads: its executable, prefix and
# pyvenv.cfg, libpython, and everything under each sys.path entry; nothing when none.
# Run with -I -S, so that nothing from the site directories has run yet: site's setup is
# then done here with each .pth file, its directory and the paths it names checked before
# the file is processed (its import lines run code, and a .pth the user planted could
# otherwise print that all is well). The bootstrap runs it (as the workers' user) before
# it starts the agent as root; the root agent runs it again at start (writable_by).
WRITABLE_CHECK = r'''import glob, os, shutil, stat, subprocess, sys
me = os.getuid()
def chain(p):  # p, or a directory above it where p (or what leads to it) can be replaced
    p = os.path.abspath(p)
    if os.path.lexists(p) and os.access(p, os.W_OK):
        return p
    child, d = p, os.path.dirname(p)
    while child != d:
        if os.access(d, os.W_OK):
            owner = os.lstat(child).st_uid if os.path.lexists(child) else me
            if not (os.stat(d).st_mode & stat.S_ISVTX and owner != me):
                return d
        child, d = d, os.path.dirname(d)
    return None
walked = []
def under(top):  # anything writable below a directory (each tree walked once)
    top = os.path.realpath(top)
    if not os.path.isdir(top) or any(top == w or top.startswith(w + os.sep) for w in walked):
        return None
    walked.append(top)
    if shutil.which("find"):
        r = subprocess.run(["find", top, "-writable", "-print", "-quit"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return r.stdout.strip() or None
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            if os.access(os.path.join(root, n), os.W_OK):
                return os.path.join(root, n)
    return None
def check(*paths, walk=True):  # reports the first writable one and stops before anything else runs
    for p in paths:
        bad = chain(p) or chain(os.path.realpath(p)) or (walk and under(p))
        if bad:
            print(bad, flush=True)
            os._exit(0)
def check_all():  # the prefixes themselves, not all below them: only sys.path is loaded
    cfgs = [os.path.join(d, "pyvenv.cfg") for d in
            (sys.prefix, os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))))]
    check(sys.executable, sys.prefix, *cfgs,
          *glob.glob(os.path.join(sys.base_prefix, "lib", "libpython*")), walk=False)
    check(*[e for e in sys.path if os.path.isabs(e)])
check_all()
import site
def wrap(run, pth=False):
    def checked(*a):
        if pth:
            sitedir, name = a[0], a[1]
            f = os.path.join(sitedir, name)
            check(f, sitedir)
            try:
                with open(f, "rb") as fh:
                    lines = fh.read().decode("utf-8", "replace").splitlines()
            except OSError:
                lines = []
            check(*[os.path.join(sitedir, ln.strip()) for ln in lines if ln.strip()
                    and not ln.startswith(("#", "import ", "import\t"))])
        check_all()
        return run(*a)
    return checked
site.addpackage = wrap(site.addpackage, pth=True)
site.execsitecustomize = wrap(site.execsitecustomize)
site.execusercustomize = wrap(site.execusercustomize)
site.main()
check_all()
import importlib.util
spec = importlib.util.find_spec("spotctl")
check(*((spec and spec.submodule_search_locations) or []))'''


def writable_by(user: WorkerUser, python: str) -> str:
    """The first path `user` could write among what `python` loads ("" when none): what
    would let a training script run code as root through this interpreter."""
    try:
        r = _run_as(user, [python, "-I", "-S", "-c", WRITABLE_CHECK], 300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"(the check could not run {python}: {e})"
    if r.returncode != 0:
        return f"(the check failed: exit {r.returncode}: {r.stderr.strip()[-200:]})"
    return r.stdout.strip()


def read_status(path: Path, limit: int = MAX_STATUS_BYTES) -> bytes | None:
    """A file a worker wrote (its status, its NCCL debug log): no link is followed, a FIFO
    never blocks, a file is read up to `limit` (1 MiB). None when it is not a plain
    readable file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def touch(path: Path) -> None:
    """Create `path` (the rendezvous gate, the leaving flag, the next round's size) in the
    training user's directory without following a link put in its place, without
    truncating what is there, and without blocking on a FIFO put there (a write-only open
    of a FIFO waits for a reader: the root agent hung; non-blocking, it fails ENXIO)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644))
