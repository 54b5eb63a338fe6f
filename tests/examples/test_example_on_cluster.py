"""Examples on a real local cluster, as a user runs them: `spotctl up` with the example as
`[train] script` (the spec's default engine) and a preemption notice mid-run.

- dataloader-files: the example's own per-epoch count across that rescale: every sample of
  every epoch trained exactly once, including the epoch the notice cut in two.
- fsdp2-transformer: two nodes of two ranks each (FSDP2 inside a node, the engine across
  nodes); after one node's notice the other goes on at half the world size, no step lost
  or run twice."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil

import pytest

from tests.conftest import REPO, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

STEP_RE = re.compile(r"step (\d+) loss (\S+) world (\d+)")
EPOCH_RE = re.compile(r"epoch (\d+): (\d+) of (\d+) samples trained once \(min (\d+), max (\d+)\)")


def test_dataloader_files_example_through_a_notice(local_cluster):
    c = local_cluster("exdl")
    for f in ("train.py", "prepare.py"):
        shutil.copy(REPO / "examples" / "dataloader-files" / f, c.project / f)
    c.write_spec("2", engine="", train_env={
        "STEPS": "100000", "DATA_DIR": str(c.tmp / "data"), "LOADER_WORKERS": "1"})
    c.cli("up", "--wait", "120")

    def logs() -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(c.cluster_dir.glob("nodes/*/torchrun.log")))

    def last_step(world: int) -> int:
        return max((int(s) for s, _, w in STEP_RE.findall(logs()) if int(w) == world),
                   default=0)

    # the notice goes early in an epoch (8 steps), so the leave cuts that epoch in two
    wait_until(lambda: last_step(2) >= 12 and last_step(2) % 8 in (1, 2), 240,
               "12 steps at world 2, early in an epoch", 0.2, c.debug)
    c.cli("preempt", "n1", "--name", "exdl", "--style", "aws")
    wait_until(lambda: last_step(1) >= last_step(2) + 24, 240,
               "24 steps at world 1 after the notice", 0.5, c.debug)
    c.cli("down", "--name", "exdl", "--yes")

    out = logs()
    steps = {(int(s), int(w)) for s, _, w in STEP_RE.findall(out)}
    worlds_of = {e: {w for s, w in steps if (s - 1) // 8 == e} for e in range(200)}
    cut = [e for e, ws in worlds_of.items() if ws == {1, 2}]
    assert cut, f"no epoch ran at both world sizes: {sorted(steps)[:80]}"
    epochs = {int(e): (int(once), int(n), int(lo), int(hi))
              for e, once, n, lo, hi in EPOCH_RE.findall(out)}
    assert cut[0] in epochs and len(epochs) >= 3, (cut, epochs)
    assert set(epochs.values()) == {(256, 256, 1, 1)}, epochs


FSDP_STEP_RE = re.compile(r"step (\d+) loss (\S+) grad_norm (\S+) world (\d+)")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (the 'examples' extra)")
def test_fsdp2_transformer_example_through_a_notice(local_cluster):
    c = local_cluster("exfs")
    shutil.copy(REPO / "examples" / "fsdp2-transformer" / "train.py", c.project / "train.py")
    c.write_spec("2..4", engine="", train_env={"STEPS": "100000", "HF_HUB_OFFLINE": "1"},
                 extra="[local]\ngpus_per_node = 2\n")
    c.cli("up", "--wait", "180")

    def rows() -> list[tuple[int, float, int]]:
        text = "\n".join(p.read_text(errors="replace")
                         for p in sorted(c.cluster_dir.glob("nodes/*/torchrun.log")))
        return [(int(s), float(loss), int(w)) for s, loss, _, w in FSDP_STEP_RE.findall(text)]

    def last(world: int) -> int:
        return max((s for s, _, w in rows() if w == world), default=0)

    wait_until(lambda: last(4) >= 5, 300, "5 steps at world 4", 0.5, c.debug)
    c.cli("preempt", "n1", "--name", "exfs", "--style", "aws")
    wait_until(lambda: last(2) >= last(4) + 5, 300, "5 steps at world 2", 0.5, c.debug)
    rescale = [e for e in c.events("rescale") if e.get("reason") == "notice"]
    c.cli("down", "--name", "exfs", "--yes")

    got = rows()
    assert rescale and rescale[-1]["lost_steps"] == 0, rescale
    assert (rescale[-1]["from_world_size"], rescale[-1]["to_world_size"]) == (4, 2), rescale
    # one line per step from the main process: none missing, none run twice
    assert [s for s, _, _ in got] == list(range(1, len(got) + 1)), got
    worlds = [w for _, _, w in got]
    k = worlds.index(2)
    assert set(worlds[:k]) == {4} and set(worlds[k:]) == {2}, got
    losses = [loss for _, loss, _ in got]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
