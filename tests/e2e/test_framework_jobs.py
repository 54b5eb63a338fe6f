"""Issue 57: a Hugging Face Trainer job and a Lightning job, each the repo's example as it
is (examples/hf-trainer, examples/lightning), on a real local cluster brought up with
`spotctl up` (1..2 nodes, gloo): through a notice, a join and a hard kill, to max_steps.

The agent plays itself here (tests/integrations play it by hand). Judged by each
framework's own records: the checkpoints it wrote (HF's checkpoint-N/trainer_state.json,
Lightning's .ckpt global_step), its log (HF's log records as the trainer emits them and its
final log_history; Lightning's CSVLogger metrics.csv, one per launch, flushed every step),
and an uninterrupted run of the same example under plain torchrun at world 1:

- notice and join: the checkpoint is of the last step trained, and the next launch resumes
  from it: 0 steps redone;
- kill: the next launch resumes from the newest whole checkpoint: at most the save
  interval redone;
- one step sequence 1..max_steps in the final checkpoint's log, every step's loss (the
  redone ones included) and the final weights equal to the uninterrupted run's within
  float32 summation order (the global batch is kept: the same samples make each step at
  world 1 and 2, summed in another order).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, LocalCluster, wait_until

# 43 s each at load 5 on the shared 2-core machine; the HF case took 560 s at load 30-50
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

JOBS = Path(__file__).with_name("jobs")
MAX_STEPS = 40
SAVE_EVERY = 8
# the jobs' steps wait on the pace file (tests/e2e/jobs): HOLD_S (a hold ends when a
# notice comes) unless the test lets a few steps run at PACE_S, so that a loaded machine's
# slow commands and rescales do not run the job to max_steps first; 0 for the last stretch
PACE_S, HOLD_S = 0.25, 60.0
# per-step loss and final weights against the uninterrupted run: float32 sums in another
# order (2 ranks x k micro-batches vs 1 x 2k); a global batch or data position that changed
# moves the loss by more than 1e-2
LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-3


def _records(log: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _steps_at(log: Path, pace: Path, world: int, by: int, timeout: float = 120) -> None:
    """Let the job train `by` more steps at `world`, then hold it again."""
    def n() -> int:
        return sum(1 for r in _records(log) if "step" in r and r["world"] == world)

    n0 = n()
    pace.write_text(str(PACE_S))
    try:
        wait_until(lambda: n() >= n0 + by, timeout, f"{by} steps at world {world}", 0.5,
                   lambda: str(_records(log)[-5:]))
    finally:
        pace.write_text(str(HOLD_S))


def _resume_after(log: Path, n0: int, world: int) -> tuple[int, int]:
    """The first launch at `world` past the first n0 records: (the last step any launch
    trained before it, the step it resumed from)."""
    def find() -> tuple[int, int] | None:
        recs = _records(log)
        for i in range(n0, len(recs)):
            if recs[i].get("resumed") is not None and recs[i]["world"] == world:
                return max(r["step"] for r in recs[:i] if "step" in r), recs[i]["resumed"]
        return None

    return wait_until(find, 120, f"a launch at world {world}", 0.5,
                      lambda: str(_records(log)[-8:]))


class Framework:
    """What differs between the two: the example, its arguments, where its checkpoints are."""

    name: str
    extra: str  # the `spotctl` extra that installs it
    modules: tuple[str, ...]

    def __init__(self, out: Path) -> None:
        self.out = out

    def args(self) -> list[str]:
        raise NotImplementedError

    def saved(self) -> dict[int, Path]:
        """step -> the framework's whole checkpoint of it."""
        raise NotImplementedError

    def checkpoint_step(self, p: Path) -> int:
        raise NotImplementedError

    def final_weights(self, out: Path) -> dict[str, Any]:
        raise NotImplementedError


class HF(Framework):
    name, extra, modules = "hf", "hf", ("transformers", "accelerate")
    example = REPO / "examples" / "hf-trainer" / "train.py"
    job = JOBS / "hf_job.py"

    def args(self) -> list[str]:
        # global batch 8 = 2 per device x world 2 x 2 micro-batches = 2 x 1 x 4
        return ["--out", str(self.out), "--max-steps", str(MAX_STEPS), "--global-batch", "8",
                "--per-device-batch", "2", "--save-steps", str(SAVE_EVERY)]

    def saved(self) -> dict[int, Path]:
        found = {}
        for p in self.out.glob("checkpoint-*"):
            try:
                step = self.checkpoint_step(p)
            except (OSError, ValueError, KeyError):
                continue  # not whole yet: rank 0 writes trainer_state.json last
            if p.name == f"checkpoint-{step}":
                found[step] = p
        return found

    def checkpoint_step(self, p: Path) -> int:
        return int(json.loads((p / "trainer_state.json").read_text())["global_step"])

    def final_weights(self, out: Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(out / f"checkpoint-{MAX_STEPS}" / "model.safetensors"))

    def log(self, out: Path) -> dict[int, list[float]]:
        """step -> its losses in the trainer's final log_history (one each, in order)."""
        state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
        steps = [h["step"] for h in state["log_history"] if "loss" in h]
        assert steps == list(range(1, MAX_STEPS + 1)), steps
        return {h["step"]: [h["loss"]] for h in state["log_history"] if "loss" in h}

    def emitted(self, log: Path) -> dict[int, list[float]]:
        """step -> every loss the trainer logged for it, across launches (a redone step
        twice)."""
        out: dict[int, list[float]] = {}
        for r in _records(log):
            if "step" in r:
                out.setdefault(r["step"], []).append(r["loss"])
        return out


class Lightning(Framework):
    name, extra, modules = "lightning", "lightning", ("lightning",)
    example = REPO / "examples" / "lightning" / "train.py"
    job = JOBS / "lightning_job.py"

    def args(self) -> list[str]:
        # global batch 32 = 8 per device x world 2 x 2 micro-batches = 8 x 1 x 4
        return ["--out", str(self.out), "--max-steps", str(MAX_STEPS), "--global-batch", "32",
                "--per-device-batch", "8", "--save-steps", str(SAVE_EVERY)]

    def saved(self) -> dict[int, Path]:
        import zipfile

        found = {}
        for p in (self.out / "checkpoints").glob("*.ckpt"):
            if zipfile.is_zipfile(p):
                try:
                    found[self.checkpoint_step(p)] = p
                except Exception:  # noqa: BLE001 - a file still being written
                    pass
        return found

    def checkpoint_step(self, p: Path) -> int:
        import torch

        return int(torch.load(p, map_location="cpu", weights_only=True)["global_step"])

    def final_weights(self, out: Path) -> dict[str, Any]:
        import torch

        (p,) = (out / "checkpoints").glob(f"epoch=*-step={MAX_STEPS}.ckpt")
        return dict(torch.load(p, map_location="cpu", weights_only=True)["state_dict"])

    def log(self, out: Path) -> dict[int, list[float]]:
        """step -> every loss the CSVLogger wrote for it across launches, in launch order
        (Lightning numbers the optimizer steps from 0: row s is the (s+1)-th step)."""
        rows: dict[int, list[float]] = {}
        files = sorted((out / "logs").glob("version_*/metrics.csv"),
                       key=lambda f: int(f.parent.name.split("_")[1]))
        for f in files:
            for r in csv.DictReader(f.open()):
                if r.get("step_loss"):
                    rows.setdefault(int(r["step"]) + 1, []).append(float(r["step_loss"]))
        return rows

    def emitted(self, log: Path) -> dict[int, list[float]]:
        return self.log(self.out)  # CSVLogger's own rows, every launch's


def _judge_notice(fw: Framework, last: int, resumed: int, what: str) -> None:
    """0 steps redone: the framework's checkpoint of the last step trained is there and the
    next launch started from it."""
    assert resumed == last, f"{what}: trained to {last}, resumed at {resumed}"
    saved = fw.saved()
    assert last in saved, (what, last, sorted(saved))


@pytest.mark.parametrize("fw_cls", [HF, Lightning], ids=["hf-trainer", "lightning"])
def test_framework_job_notice_join_kill(local_cluster, fw_cls: type[Framework]) -> None:
    if any(importlib.util.find_spec(m) is None for m in fw_cls.modules):
        pytest.skip(f"the '{fw_cls.extra}' extra is not installed")
    from tests.integrations.harness import Job

    c: LocalCluster = local_cluster(fw_cls.name)
    fw = fw_cls(c.tmp / "out")
    shutil.copy(fw.example, c.project / "example.py")
    shutil.copy(fw.job, c.project / "train.py")
    log, pace = c.tmp / "steps.jsonl", c.tmp / "pace"
    pace.write_text(str(HOLD_S))
    # the uninterrupted run, meanwhile: the same job under plain torchrun at world 1
    ref_out, ref_log = c.tmp / "ref", c.tmp / "ref-steps.jsonl"
    ref = Job(c.tmp, "ref", c.project / "train.py", 1,
              [*fw_cls(ref_out).args()], env={"STEP_LOG": str(ref_log)})
    args = json.dumps(fw.args())
    c.write_spec("1..2", engine="torchrun", extra=f"args = {args}", train_env={
        "STEP_LOG": str(log), "PACE_FILE": str(pace), "HF_HUB_OFFLINE": "1",
        "SPOTCTL_NOTICE_GRACE_S": "30"})
    try:
        c.cli("up", "--wait", "120")
        _steps_at(log, pace, 2, 3)
        st = c.wait_for("world 2", lambda s: s["world_size"] == 2)
        assert st["route"] == "plain", st  # recognised at its init_process_group

        # 1. a notice on n1: the callback saves at the step boundary, nothing redone
        n0 = len(_records(log))
        r = c.rescale_from(lambda: c.cli("preempt", "n1", "--name", fw.name, "--style", "aws"),
                           "notice")
        assert (r["from_world_size"], r["to_world_size"]) == (2, 1), r
        at_notice = _resume_after(log, n0, 1)
        _judge_notice(fw, *at_notice, "notice")
        _steps_at(log, pace, 1, 3)

        # 2. a join (`up` replaces n1): saved at the step boundary, resumed at world 2
        n0 = len(_records(log))
        r = c.rescale_from(lambda: c.cli("up", "--wait", "120"), "join")
        assert (r["from_world_size"], r["to_world_size"]) == (1, 2), r
        at_join = _resume_after(log, n0, 2)
        _judge_notice(fw, *at_join, "join")
        _steps_at(log, pace, 2, 3)

        # 3. a hard kill of n3: resumed from the newest whole checkpoint, at most the save
        # interval redone
        n0 = len(_records(log))
        r = c.rescale_from(lambda: c.cli("kill", "n3", "--name", fw.name), "failure")
        assert (r["from_world_size"], r["to_world_size"]) == (2, 1), r
        last, resumed = _resume_after(log, n0, 1)
        assert resumed == max(s for s in fw.saved() if s <= last), (last, resumed)
        assert 0 <= last - resumed <= SAVE_EVERY, (last, resumed)
        kill_redone = set(range(resumed + 1, last + 1))

        # 4. to the end, unpaced
        pace.write_text("0")
        wait_until(lambda: MAX_STEPS in fw.saved(), 240, f"the checkpoint of step {MAX_STEPS}",
                   1.0, lambda: str(_records(log)[-5:]) + c.debug())
        assert ref.finish() == 0, ref.output()[-4000:]
    finally:
        ref.kill()

    # one step sequence: every step trained, only the kill's steps twice (the framework's
    # own log across launches), the final checkpoint's log 1..max_steps once
    emitted = fw.emitted(log)
    assert sorted(emitted) == list(range(1, MAX_STEPS + 1)), sorted(emitted)
    twice = {s for s, v in emitted.items() if len(v) > 1}
    assert twice <= kill_redone and all(len(v) <= 2 for v in emitted.values()), (
        twice, kill_redone)
    final = fw.log(fw.out)
    want = {s: v[-1] for s, v in fw.log(ref_out).items()}
    assert sorted(want) == list(range(1, MAX_STEPS + 1))
    diff = max(abs(x - want[s]) for s, v in emitted.items() for x in v)
    diff = max([diff] + [abs(v[-1] - want[s]) for s, v in final.items()])
    got_w, want_w = fw.final_weights(fw.out), fw.final_weights(ref_out)
    assert sorted(got_w) == sorted(want_w)
    wdiff = max(float((got_w[k].float() - want_w[k].float()).abs().max()) for k in want_w)
    # where the events fell varies with the machine's load: a join after a step that
    # ModelCheckpoint saves is the case issue 57 was about (a mid-step save, resumed from)
    print(f"{fw.name}: notice after step {at_notice[1]}, join after {at_join[1]}, kill after "
          f"{last}, resumed at {resumed}: kill redid {len(kill_redone)} steps; "
          f"max |loss - uninterrupted| "
          f"{diff:.2e}, max |weight - uninterrupted| {wdiff:.2e}")
    assert diff <= LOSS_TOL, diff
    assert wdiff <= WEIGHT_TOL, wdiff
