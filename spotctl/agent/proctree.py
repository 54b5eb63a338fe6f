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


def _ppid(pid: int) -> int | None:
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
        pp = _ppid(pid)
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


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tag(tag: str, root: int | None = None, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of a node (tagged, plus root's descendants); wait until gone.

    Returns the pids still alive after the timeout (empty when clean).
    """
    pids = set(tagged(tag))
    if root is not None and alive(root):
        pids.add(root)
        pids.update(descendants(root))
    # never ourselves: a caller inside the tree (the local VM reclaiming its node) would
    # die at its own pid before signalling the rest; it ends itself afterwards
    pids.discard(os.getpid())
    signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in pids if alive(p)]
        more = [p for p in tagged(tag) if p not in pids]
        if more:
            pids.update(more)
            signal_all(more, signal.SIGKILL)
            left += more
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
