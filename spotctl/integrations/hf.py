"""Hugging Face ``Trainer`` (and Accelerate) under spotctl.

Three pieces, each the framework's own mechanism::

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, ...)
    keep_global_batch(args, global_batch=64)          # gradient accumulation for this world
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SpotctlCallback()])   # save at the step boundary on a notice
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

On a notice the callback sets ``control.should_save`` and ``control.should_training_stop``
at the end of the step; once the trainer has written that checkpoint it tells the agent and
waits for the SIGTERM that ends the worker. torchrun restarts the group at the new size and
``latest_checkpoint`` hands the trainer the step it stopped at. With Accelerate alone, use
``accumulation_steps`` for ``Accelerator(gradient_accumulation_steps=...)`` and poll
``spotctl.elastic.notice()`` in the loop.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainingArguments

from spotctl.integrations import _notice
from spotctl.integrations._checkpoints import latest_hf_checkpoint as latest_checkpoint
from spotctl.integrations._common import (
    Agreement,
    GlobalBatchError,
    accumulation_steps,
    world_size,
)

__all__ = ["GlobalBatchError", "SpotctlCallback", "accumulation_steps", "keep_global_batch",
           "latest_checkpoint"]

class SpotctlCallback(TrainerCallback):
    """Save at the step boundary on a spotctl notice, then stop for the rescale.

    Every step the ranks agree (one tiny gloo all-reduce) whether any of them has a notice,
    so all save the same step. The worker never returns from ``trainer.train()`` after a
    notice: it waits for SIGTERM, so the script cannot exit 0 mid-job.
    """

    def __init__(self) -> None:
        self._agree = Agreement()
        self._stopping = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._agree.setup()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        _notice.report(int(state.global_step))
        if self._agree.any(_notice.notice() is not None):
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._stopping:
            return
        # rank 0 writes the weights and trainer_state.json, every rank its RNG state: the
        # checkpoint is whole only once all of them are past the save
        self._agree.barrier()
        _notice.notice_saved(int(state.global_step))


def keep_global_batch(args: TrainingArguments, global_batch: int,
                      world: int | None = None) -> TrainingArguments:
    """Set ``args.gradient_accumulation_steps`` so the global batch is ``global_batch``.

    Call before building the Trainer (it reads the value once). The world is torchrun's
    WORLD_SIZE unless given. Raises GlobalBatchError when the global batch is not a
    multiple of ``per_device_train_batch_size`` x world.
    """
    args.gradient_accumulation_steps = accumulation_steps(
        global_batch, int(args.per_device_train_batch_size),
        world_size() if world is None else world)
    return args
