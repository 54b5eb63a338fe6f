"""examples/lightning/train.py (copied beside this file as example.py) as a cluster job.

The example's own build() and fit() as the example runs them, plus one test-only callback:
each optimizer step is held as long as the number in the PACE_FILE file says (so the test
can act mid-run, and let the job finish fast after), and rank 0 appends to STEP_LOG the
optimizer steps done (trainer.global_step after each) and the step each launch resumed
from. The losses are judged from Lightning's own CSVLogger files.

scripts/bench frameworks runs it too: with a file at NO_CALLBACK_FILE when a launch starts,
that launch trains without spotctl's callback (the framework as it is: a notice reaches it
as SIGTERM at the end of the grace).
"""

import json
import os
import sys
import time

import example
import lightning.pytorch as L

from spotctl.elastic import notice
from spotctl.integrations.lightning import SpotctlCallback


def pace() -> float:
    try:
        with open(os.environ["PACE_FILE"]) as f:
            return float(f.read().strip() or 0)
    except (KeyError, OSError, ValueError):
        return 0.0


def hold() -> None:
    """Hold the step as many seconds as PACE_FILE says (read again as it waits: a hold
    shortens when the file does), or until a notice comes (the callback then saves at
    the next step boundary, as soon as it would without the hold)."""
    t0 = time.monotonic()
    while notice() is None and time.monotonic() - t0 < pace():
        time.sleep(0.05)


class Trace(L.Callback):
    def __init__(self):
        self.last = -1

    def _put(self, trainer, rec):
        if trainer.is_global_zero:
            rec.update(world=trainer.world_size, pid=os.getpid(), t=time.time())
            with open(os.environ["STEP_LOG"], "a") as f:
                f.write(json.dumps(rec) + "\n")

    def on_train_start(self, trainer, pl_module):
        self.last = trainer.global_step
        self._put(trainer, {"resumed": trainer.global_step})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        hold()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            self._put(trainer, {"step": trainer.global_step})


trainer, model, loader, ckpt = example.build(sys.argv[1:])
trainer.callbacks.insert(0, Trace())
if os.path.exists(os.environ.get("NO_CALLBACK_FILE") or "/nonexistent"):
    trainer.callbacks[:] = [cb for cb in trainer.callbacks
                            if not isinstance(cb, SpotctlCallback)]
trainer.fit(model, loader, ckpt_path=example.latest_checkpoint(ckpt), weights_only=True)
