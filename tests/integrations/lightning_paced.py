"""examples/lightning/train.py as it is, plus a test-only callback: rank 0 prints the step
each launch resumed from, and with HOLD_AT=N every rank holds after optimizer step N (at
the next batch's start, before spotctl's callback looks for a notice) until a notice
comes, so the test can post one there or kill the job there."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L

from spotctl.elastic import notice

spec = importlib.util.spec_from_file_location(
    "lightning_example", Path(__file__).resolve().parents[2] / "examples/lightning/train.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class Hold(L.Callback):
    def __init__(self):
        self.at = int(os.environ.get("HOLD_AT", "-1"))

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            print(f"RESUMED {trainer.global_step}", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.at = -1  # once: the step's other micro-batches run on
            if trainer.is_global_zero:
                print(f"HOLD step {trainer.global_step}", flush=True)
            t0 = time.monotonic()
            while notice() is None and time.monotonic() - t0 < 600:
                time.sleep(0.05)


trainer, model, loader, ckpt = example.build(sys.argv[1:])
trainer.callbacks.insert(0, Hold())
trainer.fit(model, loader, ckpt_path=example.latest_checkpoint(ckpt), weights_only=True)
