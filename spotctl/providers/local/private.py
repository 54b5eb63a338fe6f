"""A local cluster on a network of its own (`[local] private_network = true`).

Every listener of a local cluster (the head's API and rendezvous store, the torchft
Lighthouse, each node's metadata endpoint, worker stores, gloo) binds loopback, and on a
shared machine every other user can reach loopback. With a private network the whole
cluster lives in a network namespace of its own, with a loopback of its own that nothing
outside it can reach:

- `spotctl up` starts a holder process (`python -m spotctl.providers.local.private hold`)
  that makes the namespace and brings its loopback up, then waits. Without root it makes
  a user namespace too, in which only its own user id is mapped (what lets an ordinary
  user own a network namespace); as root a network namespace alone.
- Each `spotctl` command on that cluster joins the namespace before it does anything
  else, and every process it starts (the head, each node and its workers) is born in it.
  Another user cannot join it: joining needs privileges over the holder's namespaces,
  which only its owner (and root) has.
- `down` stops the holder with the rest; the namespace goes with it.

Linux only, and it needs user namespaces enabled for ordinary users (most distributions
do; some turn them off with a sysctl).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from spotctl.errors import SpotctlError

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
HOLDER_FILE = "private-net.json"
# Joining moves the whole process into the cluster's namespaces: only spotctl's own
# commands do it (spotctl.cli.app.main run as a program sets this), never a process that
# merely calls spotctl's functions (which then reach no private cluster's listeners)
JOIN = False
JOIN_ENV = "SPOTCTL_PRIVATE_JOIN"  # set only across one restart of a command (enter)
START_TIMEOUT_S = 10.0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _loopback_up() -> None:
    """ioctl(SIOCSIFFLAGS) on `lo`: a new network namespace's loopback starts down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def setting(spec: Any) -> str:
    """What a cluster's spec asks: "on" ([local] private_network = true), "auto" (unset:
    where this machine allows it) or "off" (false; netns nodes, on a bridge of their own;
    any provider but local, e.g. an ssh cluster's head, which its hosts reach through this
    machine's loopback)."""
    want = spec.local.private_network
    if spec.provider != "local" or spec.local.netns or want is False:
        return "off"
    return "on" if want else "auto"


def _ns_id(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _make() -> None:
    """Move this process into a new network namespace (and, without root, a new user
    namespace owning it) with its loopback up."""
    uid, gid = os.getuid(), os.getgid()
    libc = _libc()
    if os.geteuid() == 0:
        _check(libc.unshare(CLONE_NEWNET), "unshare(network namespace)")
    else:
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET),
               "unshare(user and network namespaces)")
        # only this user's own ids exist in it (all an ordinary user may map)
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1\n")
        Path("/proc/self/setgroups").write_text("deny\n")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1\n")
    _loopback_up()


def hold(path: Path) -> None:
    """The holder: a network namespace (and, without root, a user namespace owning it)
    with loopback up; writes `path` (its pid and namespace), then waits for SIGTERM."""
    _make()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "net": _ns_id("self", "net"),
                               "user": _ns_id("self", "user"),
                               "started": _start_time(os.getpid())}))
    os.replace(tmp, path)
    while True:
        signal.pause()


def _start_time(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat): a pid reused by another
    process is not taken for the holder."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[19]


def _recorded(cluster_dir: Path) -> tuple[dict[str, object], bool] | None:
    """The holder file (pid, namespaces, start time) and whether that holder still runs,
    or None without a readable one."""
    try:
        h = json.loads((cluster_dir / HOLDER_FILE).read_text())
        pid = int(h["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        return h, _start_time(pid) == h.get("started") and _ns_id(pid, "net") == h.get("net")
    except (OSError, IndexError):
        return h, False


def holder(cluster_dir: Path) -> dict[str, object] | None:
    """The cluster's live holder (pid, namespaces), or None. Should the holder itself have
    died, the namespace lives on in the cluster's processes: then one of those stands in
    for it (joined the same way), so that the cluster can still be reached and taken down."""
    rec = _recorded(cluster_dir)
    if rec is None:
        return None
    h, alive = rec
    if alive:
        return h
    from spotctl.agent import proctree

    for other in proctree.tagged_prefix(f"{cluster_dir}/"):
        try:
            if _ns_id(other, "net") == h.get("net") and _ns_id(other, "user") == h.get("user"):
                return {**h, "pid": other}
        except OSError:
            continue
    return None


def start(cluster_dir: Path, tag_env: dict[str, str]) -> dict[str, object]:
    """The cluster's holder, started if it is not running."""
    if not JOIN:
        raise SpotctlError("[local] private_network: the cluster is started by the spotctl "
                           "command, not from within another Python program")
    h = holder(cluster_dir)
    if h is not None:
        return h
    path = cluster_dir / HOLDER_FILE
    path.unlink(missing_ok=True)
    log = open(cluster_dir / "private-net.log", "ab")
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "spotctl.providers.local.private", "hold", str(path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **tag_env}, start_new_session=True, close_fds=True)
    finally:
        log.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        h = holder(cluster_dir)
        if h is not None:
            return h
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.kill()
    why = (cluster_dir / "private-net.log").read_text(errors="replace").strip().splitlines()
    raise SpotctlError(
        "[local] private_network: could not make the cluster's network namespace ("
        + (why[-1] if why else "no answer") + "); this needs Linux with user namespaces "
        "open to ordinary users, or set private_network = false on a machine you do not "
        "share")


def enter(h: dict[str, object]) -> None:
    """Join the holder's namespaces (nothing to do when this process is in them already).
    Joining a user namespace needs a process with one thread: spotctl's CLI joins before
    it starts any."""
    pid = int(str(h["pid"]))
    if _ns_id("self", "net") == h["net"] or not JOIN:
        return
    if threading.active_count() > 1:
        # a user namespace takes only a process of one thread, and a network namespace
        # would take only this thread: the command starts again as a fresh process that
        # joins first thing (JOIN_ENV, read by join_from_env), whatever it had begun
        _restart_joined(h)
    libc = _libc()
    try:
        if _ns_id("self", "user") != h["user"]:
            _join(libc, f"/proc/{pid}/ns/user", CLONE_NEWUSER, "user namespace")
        _join(libc, f"/proc/{pid}/ns/net", CLONE_NEWNET, "network namespace")
    except OSError as e:
        raise SpotctlError(f"[local] private_network: cannot join the cluster's network "
                           f"({e.strerror or errno.errorcode.get(e.errno or 0, e.errno)})"
                           ) from None


def _restart_joined(h: dict[str, object]) -> NoReturn:
    if os.environ.get(JOIN_ENV):
        raise SpotctlError("[local] private_network: this command started again to join the "
                           "cluster's network and still could not")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, JOIN_ENV: json.dumps(h)}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def join_from_env() -> None:
    """First thing in a spotctl command (one thread): join the namespaces that the same
    command, started before, found it had to join too late (JOIN_ENV)."""
    raw = os.environ.pop(JOIN_ENV, "")
    if raw:
        try:
            h = json.loads(raw)
        except ValueError:
            return
        os.environ[JOIN_ENV] = raw  # kept until joined: a second restart would loop
        try:
            enter(h)
        finally:
            os.environ.pop(JOIN_ENV, None)


def _join(libc: ctypes.CDLL, path: str, kind: int, what: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(libc.setns(fd, kind), f"setns({what})")
    finally:
        os.close(fd)


def missing_note(cluster_dir: Path, mode: str) -> str:
    """`up`'s line for a local cluster left on this machine's loopback although its spec
    did not ask for that (`setting` "auto"): why, and what it means. "" otherwise."""
    if mode != "auto" or not JOIN or holder(cluster_dir) is not None:
        return ""
    try:
        why = (cluster_dir / "private-net.log").read_text(errors="replace").strip()
        why = why.splitlines()[-1].removeprefix("spotctl private network: ")
    except (OSError, IndexError):
        why = "it was started on this machine's loopback; `down` and `up` make it private"
    return (f"note: every user of this machine can reach this cluster's listeners ({why}); "
            "[local] private_network = false says that is meant")


def join(cluster_dir: Path) -> None:
    """Join the cluster's private network, if it has one (and this process may)."""
    if JOIN:
        h = holder(cluster_dir)
        if h is not None:
            enter(h)


def stop(cluster_dir: Path) -> None:
    """Stop the holder (never a process standing in for it), forget it."""
    rec = _recorded(cluster_dir)
    if rec is not None and rec[1]:
        try:
            os.kill(int(str(rec[0]["pid"])), signal.SIGTERM)
        except ProcessLookupError:
            pass
    (cluster_dir / HOLDER_FILE).unlink(missing_ok=True)


if __name__ == "__main__":
    try:
        if len(sys.argv) == 3 and sys.argv[1] == "hold":
            hold(Path(sys.argv[2]))
    except OSError as e:
        print(f"spotctl private network: {e}", flush=True)
        sys.exit(1)
    sys.exit(2)
