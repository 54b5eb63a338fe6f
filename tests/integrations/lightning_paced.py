"""examples/lightning/train.py as it is, each optimizer step held PACE_S seconds and
announced on stdout (a test-only callback) so the test can post a notice mid-run."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L

spec = importlib.util.spec_from_file_location(
    "lightning_example", Path(__file__).resolve().parents[2] / "examples/lightning/train.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class Pace(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        time.sleep(float(os.environ.get("PACE_S", "0")))
        if trainer.is_global_zero:
            print(f"PACE step {trainer.global_step}", flush=True)


trainer, model, loader, ckpt = example.build(sys.argv[1:])
trainer.callbacks.append(Pace())
trainer.fit(model, loader, ckpt_path=example.latest_checkpoint(ckpt), weights_only=True)
