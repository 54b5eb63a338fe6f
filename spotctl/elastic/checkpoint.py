"""Checkpoints with torch.distributed.checkpoint: async periodic saves, sync drain saves,
atomic commit, keep-last-K, resume at any world size.

Layout under the checkpoint dir:
    step-00000120/            DCP files (one per rank) + .metadata
    step-00000120/COMMIT      written by rank 0 after every rank's data is on disk
A directory without COMMIT is never loaded. Rank 0 writes COMMIT atomically (tmp+rename,
fsync) only after DCP's finish step has gathered all ranks' write results.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger("spotctl.elastic")
COMMIT = "COMMIT"
# DCP raises CheckpointException, a BaseException subclass: catch it, not interrupts
_CKPT_ERRORS: tuple[type[BaseException], ...] = (Exception, dcp.api.CheckpointException)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed_steps(root: Path) -> list[int]:
    """Committed checkpoint steps, newest first."""
    out = []
    if not root.exists():
        return out
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / COMMIT).exists():
            try:
                out.append(int(p.name[5:]))
            except ValueError:
                continue
    return sorted(out, reverse=True)


def read_commit(root: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(root, step) / COMMIT).read_text())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_commit(root: Path, step: int, meta: dict[str, Any]) -> None:
    d = step_dir(root, step)
    tmp = d / (COMMIT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / COMMIT)
    _fsync_dir(d)


class Checkpointer:
    def __init__(self, root: Path, keep_last: int, rank: int, pg: Any):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.pg = pg  # a separate gloo group: async saves run collectives off the main thread
        self.pending: tuple[int, Future[Any], dict[str, Any], float] | None = None
        self.last_committed = max(committed_steps(self.root), default=0) if rank == 0 else 0
        self.save_failures = 0
        self.last_block_s = 0.0
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # -- saving
    def save_async(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        self.wait_pending()
        t0 = time.perf_counter()
        try:
            fut = dcp.async_save(state, checkpoint_id=str(step_dir(self.root, step)),
                                 process_group=self.pg)
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            return
        self.last_block_s = time.perf_counter() - t0
        self.pending = (step, fut, meta, t0)

    def poll(self) -> None:
        """Commit a finished async save (rank 0). Cheap: called every step."""
        if self.pending is not None and self.pending[1].done():
            self.wait_pending()

    def wait_pending(self) -> None:
        """Wait for the in-flight async save, then commit it (or record its failure)."""
        if self.pending is None:
            return
        step, fut, meta, _ = self.pending
        self.pending = None
        try:
            fut.result()
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            return
        self._commit(step, meta)

    def save_sync(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Collective save + commit; returns True when step is committed on disk."""
        self.wait_pending()
        ok = 1
        try:
            dcp.save(state, checkpoint_id=str(step_dir(self.root, step)), process_group=self.pg)
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            ok = 0
        import torch

        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        if int(flag.item()) != 1:
            return False
        self._commit(step, meta)
        dist.barrier(group=self.pg)
        return True

    def _commit(self, step: int, meta: dict[str, Any]) -> None:
        if self.rank != 0:
            self.last_committed = max(self.last_committed, step)
            return
        d = step_dir(self.root, step)
        if not (d / ".metadata").exists():
            self._failed(step, RuntimeError("DCP metadata missing"))
            return
        try:
            write_commit(self.root, step, {**meta, "step": step, "committed_at": time.time()})
        except OSError as e:
            self._failed(step, e)
            return
        self.last_committed = max(self.last_committed, step)
        self._prune()

    def _failed(self, step: int, err: BaseException) -> None:
        # A failed save (disk full, I/O error) must not stop training nor leave a partial
        # directory that looks good: it has no COMMIT, and rank 0 removes it.
        self.save_failures += 1
        log.warning("checkpoint at step %d failed: %s", step, err)
        if self.rank == 0:
            shutil.rmtree(step_dir(self.root, step), ignore_errors=True)

    def _prune(self) -> None:
        keep = committed_steps(self.root)[: self.keep_last]
        newest = keep[0] if keep else 0
        for p in self.root.iterdir():
            if not p.name.startswith("step-"):
                continue
            try:
                s = int(p.name[5:])
            except ValueError:
                continue
            committed = (p / COMMIT).exists()
            if (committed and s not in keep) or (not committed and s < newest):
                shutil.rmtree(p, ignore_errors=True)

    # -- loading
    def load_latest(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Load the newest committed checkpoint every rank can read; fall back to older
        ones when one is corrupt. Returns its COMMIT meta, or None for a fresh start."""
        import torch

        steps = committed_steps(self.root)
        # all ranks must try the same list: rank 0's view decides
        obj = [steps]
        dist.broadcast_object_list(obj, src=0, group=self.pg)
        steps = obj[0]
        for s in steps:
            ok = 1
            try:
                dcp.load(state, checkpoint_id=str(step_dir(self.root, s)), process_group=self.pg)
                meta = read_commit(self.root, s)
            except _CKPT_ERRORS as e:
                log.warning("checkpoint at step %d unreadable, trying an older one: %s", s, e)
                ok = 0
                meta = {}
            flag = torch.tensor([ok])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
            if int(flag.item()) == 1:
                self.last_committed = s
                return meta
        return None
