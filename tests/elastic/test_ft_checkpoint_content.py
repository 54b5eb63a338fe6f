"""What a torchft replica's periodic checkpoint holds is the state at its step: the save
copies parameters and optimizer state while the next steps' forward and backward run, and
each optimizer step waits for that copy. Judged against the run's own step log: the model
loaded from each committed checkpoint gives the full-data loss the replica logged right
after that step."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.elastic.ft_harness import FtReplicas

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

pytestmark = pytest.mark.slow
M = 40


def _data() -> tuple[torch.Tensor, torch.Tensor]:  # tests/elastic/ft_train.py's
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    return x, y


def test_each_checkpoint_is_the_state_at_its_step(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.setenv("SPOTCTL_KEEP_LAST", "1000")
    # a save every 3 steps and no pause between steps: the copy overlaps the next step
    c = FtReplicas(tmp_path, M, every=3, delay=0.0)
    try:
        c.start("r0")
        assert c.finish(["r0"]) == {"r0": 0}, c.output("r0")
        logged = {s["step"]: s["full_loss"] for s in c.steps("r0")}
    finally:
        c.stop()
    x, y = _data()
    committed = sorted(p.parent for p in (tmp_path / "ckpt").glob("step-*/COMMIT"))
    # up to 13 saves (and the final one); fewer under load, where a save that falls due
    # while the one before it still writes is put off to the step after that write (CI
    # once had 4: steps 3, ..., 35 and the final 40): at least two made while training
    # went on, whose copies overlapped later steps, besides the final one
    periodic = [d for d in committed if int(d.name.removeprefix("step-")) < M]
    assert len(periodic) >= 2 and len(committed) >= 3, committed
    for d in committed:
        step = int(d.name.removeprefix("step-"))
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=str(d))
        model.load_state_dict(sd["model"])
        with torch.no_grad():
            full = float(((model(x) - y) ** 2).mean())
        assert math.isclose(full, logged[step], rel_tol=1e-6, abs_tol=1e-9), (step, full,
                                                                            logged[step])
