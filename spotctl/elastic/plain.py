"""Plain torchrun scripts (the torch elastic contract): what spotctl does for a script
that forms its process group itself, and the optional calls such a script may make.

The worker launch path (spotctl.agent.launch, the zygote's child) calls `install()`
before the user's script runs: it wraps `torch.distributed.init_process_group`. When the
group is formed by code that is not spotctl.elastic, the worker writes its status file
with route "plain" (the agent reports it to the head):

- on the torchrun engine the script goes on, as under torchrun alone;
- on the torchft engine (one torchrun per node) it would train as one independent copy
  per node: it reports and waits instead, never training, until the head has switched the
  cluster to the restart cycle and the agent restarts it as one torchrun job.

A script may also (all optional, all cheap):

    from spotctl.elastic import notice, notice_saved, report
    report(step=step, samples=global_batch, loss=loss)   # `status` shows step, samples/s
    if notice() is not None:                              # a stat: call it every step
        save(...); notice_saved(step)                     # never returns

The agent writes `SPOTCTL_NOTICE_FILE` (JSON: reason "notice" | "rescale", deadline in
unix seconds, id) when this worker must stop for a rescale, then SIGTERMs it at the end
of the grace (sooner once every worker called notice_saved). Importing this module does
no process group work.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

NOTICE_ENV = "SPOTCTL_NOTICE_FILE"
REPORT_EVERY_S = 0.2
INCARNATION_KEY = "spotctl/plain-incarnation"

_lock = threading.Lock()
# set while spotctl.elastic forms its own group (it is the route "elastic", not "plain")
_elastic_init = threading.local()
# this worker's report once it formed a group as a plain script (None: not one)
_rep: dict[str, Any] | None = None
_formed_at = 0.0  # when this process' group formed: a notice file older is a past round's
_last_write = 0.0
_rate = [0.0, 0]  # window start, samples in it
_notice_seen: tuple[float, int, dict[str, Any] | None] | None = None


def own_init() -> Any:
    """Context for spotctl.elastic's own init_process_group (not a plain script's)."""
    import contextlib

    @contextlib.contextmanager
    def ctx() -> Any:
        _elastic_init.on = True
        try:
            yield
        finally:
            _elastic_init.on = False

    return ctx()


def install() -> None:
    """Wrap init_process_group in this worker process (before the user's script runs).
    Only for a torchrun worker that spotctl's agent started (its status dir is set)."""
    env = os.environ
    if not env.get("SPOTCTL_STATUS_DIR") or "LOCAL_RANK" not in env:
        return
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return
    real = c10d.init_process_group
    if getattr(real, "_spotctl_wrapped", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if not getattr(_elastic_init, "on", False):
            _formed()
        return out

    init_process_group._spotctl_wrapped = True  # type: ignore[attr-defined]
    init_process_group.__doc__ = real.__doc__
    init_process_group.__wrapped__ = real  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _incarnation(rank: int) -> str:
    """One id per group formation, the same on every rank: rank 0 puts it in the group's
    own store (new every rendezvous round); no collective on the user's group."""
    try:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
        if rank == 0:
            inc = uuid.uuid4().hex[:12]
            store.set(INCARNATION_KEY, inc)
            return inc
        return bytes(store.get(INCARNATION_KEY)).decode()[:64]
    except Exception:  # noqa: BLE001 - a store without it: the round's address names it
        env = os.environ
        return f"p-{env.get('MASTER_ADDR', '')}-{env.get('MASTER_PORT', '')}"[:64]


def _formed() -> None:
    global _rep, _formed_at
    import torch.distributed as dist

    env = os.environ
    rank, world = dist.get_rank(), dist.get_world_size()
    now = time.time()
    rep = {
        "rank": rank, "local_rank": int(env.get("LOCAL_RANK", "0")), "world_size": world,
        "step": 0, "phase": "train", "incarnation": _incarnation(rank), "resume_step": 0,
        "first_step_at": now, "last_ckpt": 0, "loss": None, "throughput": None,
        "drain_step": None, "pid": os.getpid(), "route": "plain",
    }
    ft = env.get("SPOTCTL_ENGINE") == "torchft"
    if ft:
        # one torchrun per node would make this one independent copy of the job: report,
        # and train nothing; the agent restarts it as one job across the nodes
        rep.update(phase="init", first_step_at=None)
    with _lock:
        _formed_at = now
        _rep = rep
        _write(force=True)
    if ft:
        print("spotctl: a plain torchrun script on the torchft engine: not training one copy "
              "per node; the cluster restarts it as one torchrun job across the nodes",
              file=sys.stderr, flush=True)
        _wait_for_sigterm()


def _write(force: bool = False) -> None:
    global _last_write
    rep, d = _rep, os.environ.get("SPOTCTL_STATUS_DIR")
    if rep is None or not d:
        return
    now = time.time()
    if not force and now - _last_write < REPORT_EVERY_S:
        return
    _last_write = now
    write_status(Path(d), int(rep["local_rank"]), rep)


def write_status(status_dir: Path, local_rank: int, rep: dict[str, Any]) -> None:
    """A worker's status file for its agent (worker-<local rank>.json), replaced whole; a
    write that fails is skipped (the next report writes it again). Run, FtRun and a plain
    script's report all write through here."""
    path = status_dir / f"worker-{local_rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(rep))
        os.replace(tmp, path)
    except OSError:
        pass


def _wait_for_sigterm() -> None:
    """Never return: die of the SIGTERM to come (a worker never exits 0 mid-job)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        signal.pause()


def report(step: int, samples: int | None = None, loss: float | None = None) -> None:
    """Optional: this worker finished `step` (`samples`: how many the whole job trained in
    it); `status` shows the step and samples/s. A no-op outside a spotctl cluster."""
    rep = _rep
    if rep is None:
        return
    with _lock:
        now = time.time()
        rep["step"] = max(0, int(step))
        if loss is not None:
            rep["loss"] = float(loss)
        if samples is not None:
            if not _rate[0]:
                _rate[0] = now
            else:
                _rate[1] += int(samples)
                if now - _rate[0] >= 1.0:
                    rep["throughput"] = _rate[1] / (now - _rate[0])
                    _rate[0], _rate[1] = now, 0
        _write()


def notice() -> dict[str, Any] | None:
    """The notice for this worker's group, or None: {"reason": "notice" | "rescale",
    "deadline": unix seconds when SIGTERM comes at the latest, "id": str}. One stat when
    nothing changed; a file from before this process formed its group is a past round's."""
    global _notice_seen
    path = os.environ.get(NOTICE_ENV)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_mtime, st.st_ino)
    seen = _notice_seen
    if seen is not None and (seen[0], seen[1]) == key:
        return seen[2]
    since = _formed_at or _process_start()
    n: dict[str, Any] | None = None
    if st.st_mtime >= since - 0.001:
        try:
            v = json.loads(Path(path).read_text())
            n = v if isinstance(v, dict) and "deadline" in v else None
        except (OSError, ValueError):
            n = None
    _notice_seen = (key[0], key[1], n)
    return n


def notice_saved(step: int | None = None) -> None:
    """The script saved at the step boundary after a notice: tells the agent (so the group
    is released before the grace ends), then waits for SIGTERM and dies of it. Never
    returns."""
    with _lock:
        if _rep is not None:
            _rep["phase"] = "drained"
            _rep["drain_step"] = _rep["step"] if step is None else max(0, int(step))
            if step is not None:
                _rep["step"] = max(_rep["step"], int(step))
            _write(force=True)
    if not os.environ.get("SPOTCTL_STATUS_DIR"):
        raise SystemExit(1)  # no agent to stop it: exit non-zero now
    _wait_for_sigterm()


def _process_start() -> float:
    """Unix time this process started (spotctl.elastic's reading of /proc)."""
    from spotctl.elastic import _process_start_time

    return _process_start_time()
