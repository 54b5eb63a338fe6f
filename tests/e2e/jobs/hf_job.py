"""examples/hf-trainer/train.py (copied beside this file as example.py) as a cluster job.

The example's own build_trainer, main() as the example runs it, plus one test-only callback:
each optimizer step is held as long as the number in the PACE_FILE file says (so the test
can act mid-run, and let the job finish fast after), and rank 0 appends to STEP_LOG, as the
trainer emits them, its own log records (on_log: the dict that goes into log_history, with
its step) and the step each launch resumed from (on_train_begin). A SIGKILL loses none of
them, where trainer_state.json keeps only what a checkpoint saved.

scripts/bench frameworks runs it too: with a file at NO_CALLBACK_FILE when a launch starts,
that launch trains without spotctl's callback (the framework as it is: a notice reaches it
as SIGTERM at the end of the grace).
"""

import json
import os
import sys
import time

import example
from transformers import TrainerCallback

from spotctl.elastic import notice
from spotctl.integrations.hf import SpotctlCallback


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


class Trace(TrainerCallback):
    def _put(self, state, rec):
        if state.is_world_process_zero:
            rec.update(world=int(os.environ.get("WORLD_SIZE", "1")), pid=os.getpid(),
                       t=time.time())
            with open(os.environ["STEP_LOG"], "a") as f:
                f.write(json.dumps(rec) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._put(state, {"resumed": state.global_step})

    def on_step_end(self, args, state, control, **kwargs):
        hold()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._put(state, {"step": state.global_step, "loss": logs["loss"]})


trainer = example.build_trainer(sys.argv[1:])
trainer.add_callback(Trace())
if os.path.exists(os.environ.get("NO_CALLBACK_FILE") or "/nonexistent"):
    trainer.remove_callback(SpotctlCallback)
trainer.train(resume_from_checkpoint=example.latest_checkpoint(trainer.args.output_dir))
trainer.save_model()
