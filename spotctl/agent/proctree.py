"""Find and kill whole process trees, including processes that started new sessions
(torchrun starts each worker in its own session, so a process-group kill misses them).

Every process of a local node carries SPOTCTL_NODE_TAG in its environment; scanning
/proc for the tag finds them even after their parent died and they were re-parented.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

TAG_VAR = "SPOTCTL_NODE_TAG"


def ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parens: split after the last ')'
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[1])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        pp = ppid(pid)
        if pp is not None:
            children.setdefault(pp, []).append(pid)
    out: list[int] = []
    stack = [root]
    while stack:
        p = stack.pop()
        for c in children.get(p, []):
            out.append(c)
            stack.append(c)
    return out


def _has_tag(pid: int, tag: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{TAG_VAR}={tag}".encode() in env.split(b"\0")


def tagged(tag: str) -> list[int]:
    """Pids whose environment holds SPOTCTL_NODE_TAG=tag (exact match)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(pid)
    return found


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, its identity."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_same(pid: int, started: int | None, sig: int) -> None:
    """Signal `pid` only if it is still the process that started at `started`: a pidfd
    pins the process, then its start time is checked, so a pid the kernel reused for an
    unrelated process is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError, AttributeError):
        return
    try:
        if started is not None and _start_time(pid) == started:
            signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    finally:
        os.close(fd)


def _alive_same(pid: int, started: int | None) -> bool:
    return alive(pid) and _start_time(pid) == started


def kill_tag(tag: str, root: int | None = None, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of a node (tagged, plus root's descendants); wait until gone.

    Each pid is identified by its start time when found and signalled through a pidfd
    after re-checking it, so a reused pid is never killed. Returns the pids still alive
    after the timeout (empty when clean).
    """
    pids = set(tagged(tag))
    if root is not None and alive(root):
        pids.add(root)
        pids.update(descendants(root))
    # never ourselves: a caller inside the tree (the local VM reclaiming its node) would
    # die at its own pid before signalling the rest; it ends itself afterwards
    pids.discard(os.getpid())
    started = {p: _start_time(p) for p in pids}
    # Identity: each pid is re-checked *after* its start time was read (still tagged, or
    # still a child inside the tree), so the start time belongs to the process we found.
    tree = set(pids) | ({root} if root is not None else set())
    for p in list(pids):
        if p != root and not _has_tag(p, tag) and ppid(p) not in tree:
            started.pop(p)
            pids.discard(p)
    for p in pids:
        _signal_same(p, started[p], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive_same(p, started[p])]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in pids if _alive_same(p, started[p])]
        more = [p for p in tagged(tag) if p not in pids]
        for p in more:
            pids.add(p)
            started[p] = _start_time(p)
            _signal_same(p, started[p], signal.SIGKILL)
        left += [p for p in more if _alive_same(p, started[p])]
    return left


def tagged_prefix(prefix: str) -> list[int]:
    """Pids whose SPOTCTL_NODE_TAG starts with `prefix` (every process of a cluster)."""
    needle = f"{TAG_VAR}={prefix}".encode()
    found = []
    for pid in _pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(v.startswith(needle) for v in env.split(b"\0")) and alive(pid):
            found.append(pid)
    return found
