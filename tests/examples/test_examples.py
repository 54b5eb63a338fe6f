"""The examples under examples/ run as a user runs them: plain torchrun with two CPU ranks
(gloo), then again at another world size from the checkpoint the first run committed. Each
run's own output is the evidence: the step count, the losses, the world size it printed.
The ddp-port README shows the diff between the two scripts; a fast test keeps it exact."""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STEP_RE = re.compile(r"^step (\d+) loss (\S+)(?: grad_norm (\S+))? world (\d+)$", re.M)


TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(script: Path, cwd: Path, nproc: int = 2, baseline: bool = False,
             **env: str) -> str:
    """Run `torchrun --standalone --nproc-per-node N script` in `cwd`; its output.

    `baseline`: the script is the user's plain one (no spotctl), whose output is only what
    the port is compared with. torch's gloo rarely aborts a rank as the process group is
    torn down after the last step (TEARDOWN_ABORT, exit -6: 0 of 20 runs here once the
    script had a barrier before it, then once in a CI run): that run is made once more.
    spotctl's own scripts get no second chance."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "SPOTCTL_CHECKPOINT_DIR": str(cwd / "checkpoints"), **env}
    full.pop("SPOTCTL_ENGINE", None)
    for attempt in (1, 2):
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", str(script)],
            cwd=cwd, env=full, capture_output=True, text=True, timeout=240)
        out = p.stdout + p.stderr
        if p.returncode == 0 or not (baseline and attempt == 1 and TEARDOWN_ABORT in out):
            break
    assert p.returncode == 0, f"{script.name} exited {p.returncode}:\n{out[-4000:]}"
    return p.stdout


def steps(out: str) -> list[tuple[int, float, int]]:
    """(step, loss, world) of every step line the main process printed."""
    rows = [(int(s), float(loss), int(w)) for s, loss, _, w in STEP_RE.findall(out)]
    assert rows, f"no step lines in:\n{out[-2000:]}"
    assert all(math.isfinite(loss) for _, loss, _ in rows), rows
    return rows


def grad_norms(out: str) -> list[float]:
    return [float(g) for _, _, g, _ in STEP_RE.findall(out)]


def committed(cwd: Path) -> list[int]:
    ck = cwd / "checkpoints"
    return sorted(int(d.name.split("-")[1]) for d in ck.glob("step-*") if (d / "COMMIT").exists())


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# --- ddp-port ---------------------------------------------------------------------------------


def readme_diff(readme: str) -> str:
    m = re.search(r"```diff\n(.*?)```", readme, re.S)
    assert m, "the ddp-port README has no ```diff block"
    return m.group(1)


def port_diff() -> str:
    d = EXAMPLES / "ddp-port"
    return "".join(difflib.unified_diff(
        (d / "original.py").read_text().splitlines(keepends=True),
        (d / "train.py").read_text().splitlines(keepends=True),
        fromfile="original.py", tofile="train.py"))


def test_the_ddp_port_readme_shows_the_diff_of_the_two_scripts() -> None:
    shown = readme_diff((EXAMPLES / "ddp-port" / "README.md").read_text())
    assert "+from spotctl import elastic" in shown
    assert shown == port_diff(), ("examples/ddp-port/README.md: the diff is stale; paste "
                                  "`diff -u original.py train.py` again (without the dates)")


def test_the_readme_diff_check_sees_a_changed_line() -> None:
    shown = readme_diff((EXAMPLES / "ddp-port" / "README.md").read_text())
    assert shown.replace("run.finish()", "run.close()") != port_diff()


@pytest.mark.slow
def test_ddp_port_trains_like_the_original(tmp_path: Path) -> None:
    """The port computes the same steps as the DDP script: with seed 0 the elastic order and
    DistributedSampler's draw the same permutation per epoch, so each step trains the same
    32 samples, and the logged losses and gradient norms agree (float summation order
    aside)."""
    d = EXAMPLES / "ddp-port"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    orig_out = torchrun(d / "original.py", tmp_path / "a", baseline=True, STEPS="20")
    port_out = torchrun(d / "train.py", tmp_path / "b", STEPS="20")
    orig, port = steps(orig_out), steps(port_out)
    assert [s for s, _, _ in port] == list(range(1, 21))
    assert [s for s, _, _ in orig] == list(range(1, 21))
    assert {w for _, _, w in port} == {2}
    for (s, a, _), (_, b, _) in zip(orig, port, strict=True):
        assert b == pytest.approx(a, rel=1e-3, abs=1e-4), (s, a, b)
    # the gradient clipping sees is the same: the mean over the same 32 samples
    assert grad_norms(port_out) == pytest.approx(grad_norms(orig_out), rel=1e-3, abs=1e-4)
    losses = [loss for _, loss, _ in port]
    assert mean(losses[-5:]) < 0.5 * mean(losses[:5]), losses
    assert committed(tmp_path / "b")[-1] == 20


# --- fsdp2-transformer ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (the 'examples' extra)")
def test_fsdp2_transformer_trains_and_resumes_on_one_rank(tmp_path: Path) -> None:
    script = EXAMPLES / "fsdp2-transformer" / "train.py"
    first = steps(torchrun(script, tmp_path, STEPS="12"))
    assert [s for s, _, _ in first] == list(range(1, 13))
    assert {w for _, _, w in first} == {2}
    losses = [loss for _, loss, _ in first]
    assert mean(losses[-3:]) < mean(losses[:3]) - 0.2, losses  # it learns
    assert committed(tmp_path)[-1] == 12
    # the sharded model and AdamW state load at another world size and training goes on
    second = steps(torchrun(script, tmp_path, nproc=1, STEPS="15"))
    assert [(s, w) for s, _, w in second] == [(13, 1), (14, 1), (15, 1)]
    assert max(loss for _, loss, _ in second) < losses[0]
    assert committed(tmp_path)[-1] == 15


# --- dataloader-files -------------------------------------------------------------------------

EPOCH_RE = re.compile(r"^epoch (\d+): (\d+) of (\d+) samples trained once "
                      r"\(min (\d+), max (\d+)\)$", re.M)


@pytest.mark.slow
def test_dataloader_files_trains_every_sample_once_across_a_rescale(tmp_path: Path) -> None:
    """2 ranks for 5 steps, then 1 rank from that checkpoint through the end of epoch 1
    (8 steps of 32 of 256 samples an epoch): every sample of epoch 0 was trained exactly
    once although the world size changed mid-epoch."""
    script = EXAMPLES / "dataloader-files" / "train.py"
    env = {"DATA_DIR": str(tmp_path / "data"), "LOADER_WORKERS": "1"}
    first = torchrun(script, tmp_path, STEPS="5", **env)
    assert [(s, w) for s, _, w in steps(first)] == [(s, 2) for s in range(1, 6)]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "index.json", *(f"shard-{i:05d}.pt" for i in range(4))]
    second = torchrun(script, tmp_path, nproc=1, STEPS="16", **env)
    rows = steps(second)
    assert [(s, w) for s, _, w in rows] == [(s, 1) for s in range(6, 17)]
    epochs = [tuple(map(int, m)) for m in EPOCH_RE.findall(second)]
    assert epochs == [(0, 256, 256, 1, 1), (1, 256, 256, 1, 1)], second
    assert rows[-1][1] < steps(first)[0][1]
