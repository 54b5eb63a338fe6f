"""The worker side of the notice contract, read directly from its file.

Mirrors ``spotctl.elastic.notice`` / ``spotctl.elastic.notice_saved`` (the plain-torchrun
route): the agent writes JSON ``{"reason", "deadline", "id"}`` to the path in
``SPOTCTL_NOTICE_FILE`` when this worker must stop for a rescale, and SIGTERM follows once
the workers say they saved or the deadline passes. Under spotctl's agent (its status dir
set) both calls are spotctl.elastic's own (spotctl.elastic.plain: a notice file from a past
round is ignored, and a save is told to the agent in the worker's status, which releases
the group before the grace ends); elsewhere (a test playing the agent) they read the file
and mark the save beside it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

ENV = "SPOTCTL_NOTICE_FILE"
# how long a worker that said it saved waits past the notice's deadline for the SIGTERM
# that should have come by then; then it exits non-zero by itself (never 0 mid-job)
LATE_S = 60.0


def _agent() -> bool:
    return bool(os.environ.get("SPOTCTL_STATUS_DIR"))


def notice() -> dict[str, Any] | None:
    """The pending notice for this worker, or None. One stat and a small read."""
    if _agent():
        from spotctl.elastic import plain

        return plain.notice()
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if len(raw) > 4096:
        return None
    try:
        v = json.loads(raw)
    except ValueError:
        # a half-written file reads as no notice yet; the next step reads it again
        return None
    if not isinstance(v, dict) or v.get("reason") not in ("notice", "rescale"):
        return None
    d = v.get("deadline")
    if isinstance(d, bool) or not isinstance(d, (int, float)):
        return None
    deadline = float(d)
    return {"reason": v["reason"], "deadline": deadline, "id": str(v.get("id", ""))}


def saved_path(rank: int) -> Path | None:
    path = os.environ.get(ENV)
    return Path(f"{path}.saved.{rank}") if path else None


def mark_saved(step: int | None, rank: int | None = None) -> None:
    """Tell the agent this worker has saved (a file beside the notice file, per rank)."""
    r = int(os.environ.get("RANK", "0")) if rank is None else rank
    p = saved_path(r)
    if p is None:
        return
    n = notice()
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"rank": r, "step": step, "id": n["id"] if n else None,
                               "pid": os.getpid(), "time": time.time()}))
    os.replace(tmp, p)


def notice_saved(step: int | None = None) -> NoReturn:
    """Say the save is done, then wait for the SIGTERM that ends this worker.

    The worker dies by SIGTERM (torchrun sees a failure and the group restarts at the new
    size); it never returns, so a training script cannot go on to exit 0 mid-job.
    """
    mark_saved(step)
    if _agent():
        from spotctl.elastic import plain

        plain.notice_saved(step)  # never returns: dies of the agent's SIGTERM
    n = notice()
    # the default action: a handler a framework installed (Lightning's, for one) would
    # only set a flag while this worker sleeps here
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    until = (n["deadline"] if n else time.time()) + LATE_S
    while time.time() < until:
        time.sleep(0.2)
    raise SystemExit(f"spotctl: no SIGTERM by {LATE_S:.0f} s after the notice's deadline; "
                     "exiting so the group restarts")


def report(step: int) -> None:
    """The step this worker finished, for `spotctl status` (a no-op outside a cluster)."""
    if _agent():
        from spotctl.elastic import plain

        plain.report(step=step)
