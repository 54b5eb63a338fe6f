"""examples/dataloader-files on a real local cluster, as a user runs it: `spotctl up` with the
example as `[train] script` (the spec's default engine), a preemption notice mid-run, and
the example's own per-epoch count across that rescale: every sample of every epoch trained
exactly once, including the epoch the notice cut in two."""

from __future__ import annotations

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
