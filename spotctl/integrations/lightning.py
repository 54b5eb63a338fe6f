"""PyTorch Lightning under spotctl.

::

    sampler = ElasticSampler(dataset, seed=0)        # the data position survives a rescale
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    trainer = L.Trainer(
        **torchrun_layout(),
        accumulate_grad_batches=accumulation_steps(global_batch=64, per_device=4),
        **torchrun_layout(),                         # devices, num_nodes: this world
        use_distributed_sampler=False,               # ElasticSampler splits the data itself
        callbacks=[SpotctlCallback("ckpt")])         # save at the step boundary on a notice
    trainer.fit(model, loader, ckpt_path=latest_checkpoint("ckpt"), weights_only=True)

Lightning's own TorchElasticEnvironment reads torchrun's environment. On a notice the
callback saves through ``trainer.save_checkpoint`` after the optimizer step, tells the agent
and waits for the SIGTERM that ends the worker; torchrun restarts the group at the new size
and ``latest_checkpoint`` hands ``fit`` that checkpoint. Lightning counts its place in an
epoch in batches per rank, and restarts a plain loader at the epoch's first batch; the
callback converts the count to the new world and ElasticSampler starts where the global
batch stopped, so each step trains the same samples at any world size.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from spotctl.integrations import _notice
from spotctl.integrations._checkpoints import latest_zip_checkpoint as latest_checkpoint
from spotctl.integrations._common import (
    Agreement,
    GlobalBatchError,
    accumulation_steps,
    world_size,
)
from spotctl.integrations._sampler import ElasticSampler

__all__ = ["ElasticSampler", "GlobalBatchError", "SpotctlCallback", "accumulation_steps",
           "latest_checkpoint", "torchrun_layout"]

def torchrun_layout() -> dict[str, int]:
    """``devices`` and ``num_nodes`` for ``L.Trainer`` from the world torchrun started.

    Lightning's TorchElasticEnvironment refuses a Trainer whose devices x num_nodes is not
    the world size, and the world changes with every rescale.
    """
    world = world_size()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    return {"devices": local, "num_nodes": max(1, world // local)}


def _samplers(trainer: pl.Trainer) -> list[ElasticSampler]:
    found = []
    loaders = trainer.train_dataloader
    for dl in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        for s in (getattr(dl, "sampler", None),
                  getattr(getattr(dl, "batch_sampler", None), "sampler", None)):
            if isinstance(s, ElasticSampler) and s not in found:
                found.append(s)
    return found


def _batch_size(trainer: pl.Trainer) -> int | None:
    b = getattr(trainer.train_dataloader, "batch_size", None)
    return b if isinstance(b, int) else None


def _resumed_at(trainer: pl.Trainer) -> None:
    """Tell each ModelCheckpoint that the step this launch resumed from is saved.

    ModelCheckpoint keeps the last step it saved in memory only (0 in a new process), and
    its ``every_n_train_steps`` check runs at every micro-batch's end. A launch resumed at
    a multiple of N with gradient accumulation therefore saved "step N" again after its
    first micro-batch: a checkpoint in the middle of an accumulation window, without the
    gradient accumulated so far, and the newest file of that step, so a hard kill after it
    resumed from there and trained the step on part of its global batch. The step resumed
    from is already on disk (the checkpoint this launch loaded).
    """
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        if hasattr(cb, "_last_global_step_saved"):
            cb._last_global_step_saved = trainer.global_step
        else:  # a Lightning other than the one tested (2.6.6)
            warnings.warn("spotctl: this Lightning's ModelCheckpoint has no "
                          "_last_global_step_saved; with gradient accumulation it may save "
                          f"step {trainer.global_step} again in the middle of a step",
                          stacklevel=2)


class SpotctlCallback(pl.Callback):
    """Save at the optimizer-step boundary on a spotctl notice, then stop for the rescale.

    The check runs once per optimizer step, before the next batch starts: a notice during
    the last step of ``max_steps`` finds the job done.

    ``dirpath``: where the notice checkpoint goes (``notice-step=N.ckpt``, written under a
    temporary name and renamed once whole); pass the same directory to
    ``latest_checkpoint``.
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self._agree = Agreement()
        self._last_step = -1
        self._resume: dict[str, int] | None = None

    # -- the notice -------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agree.setup()
        self._last_step = trainer.global_step
        if trainer.global_step > 0:
            _resumed_at(trainer)
        if self._resume is not None:
            for s in _samplers(trainer):
                s.resume_at(self._resume["epoch"], self._resume["epoch_samples"])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        # called per micro-batch: the boundary is the first batch after an optimizer step
        # (every rank sees the same ones, so the all-reduce below pairs up). Not at the
        # previous batch's end: Lightning hands that step's logs to the loggers after
        # on_train_batch_end, and they would die with the worker.
        if trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        _notice.report(trainer.global_step)
        if not self._agree.any(_notice.notice() is not None):
            return
        self.dirpath.mkdir(parents=True, exist_ok=True)
        final = self.dirpath / f"notice-step={trainer.global_step}.ckpt"
        tmp = final.with_name(final.name + ".tmp")
        trainer.save_checkpoint(tmp)  # collective: rank 0 writes, then a barrier
        if trainer.is_global_zero:
            os.replace(tmp, final)
        # the loggers buffer (CSVLogger writes every 100 steps): what they hold up to the
        # saved step is written now, before the SIGTERM ends the process
        for lg in trainer.loggers:
            lg.save()
        self._agree.barrier()
        _notice.notice_saved(trainer.global_step)

    # -- the position in the epoch, carried across a change of world size ------------

    def state_dict(self) -> dict[str, Any]:
        # called for every checkpoint, the user's own included: never raises. Without one
        # DataLoader with a batch_size the position is not kept (Lightning's own resume)
        trainer = getattr(self, "_trainer", None)
        b = _batch_size(trainer) if trainer is not None else None
        if trainer is None or b is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return {"world": world_size(), "accumulate": int(trainer.accumulate_grad_batches),
                "epoch": int(trainer.current_epoch),
                "epoch_samples": int(progress.processed) * b * world_size()}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if not saved:
            return
        self._resume = {"epoch": int(saved["epoch"]),
                        "epoch_samples": int(saved["epoch_samples"])}
        old, new = int(saved["accumulate"]), int(trainer.accumulate_grad_batches)
        if old == new:
            return
        # Lightning counts batches per rank: the same samples are old/new times as many
        # batches now (the global batch is kept, so accumulation scales with 1/world)
        bp = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for part in ("total", "current"):
            counts = bp[part]
            base = counts["processed"]
            scaled = base * new // old if (base * new) % old == 0 else math.ceil(base * new / old)
            for k in ("ready", "started", "processed", "completed"):
                counts[k] = counts[k] - base + scaled
