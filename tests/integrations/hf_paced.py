"""examples/hf-trainer/train.py as it is, each step held PACE_S seconds (a test-only
callback) so the test can post a notice mid-run."""

import importlib.util
import os
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

spec = importlib.util.spec_from_file_location(
    "hf_example", Path(__file__).resolve().parents[2] / "examples/hf-trainer/train.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class Pace(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("PACE_S", "0")))


trainer = example.build_trainer(sys.argv[1:])
trainer.add_callback(Pace())
trainer.train(resume_from_checkpoint=example.latest_checkpoint(trainer.args.output_dir))
