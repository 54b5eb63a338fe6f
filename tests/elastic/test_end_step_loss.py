"""`run.end_step(loss)` with the loss tensor itself, as a script passes it (issue 58's
held-out steady-state script): the status file shows its value. The tensor went into the
report as it was, and json.dumps of a Tensor raised TypeError at the first step's report
(the worker died); a float was the only form that worked. The tensor is read at the report
(every REPORT_EVERY_S), not at every step: no device synchronisation per step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from spotctl import elastic  # noqa: E402
from spotctl.elastic import loss_value  # noqa: E402
from tests.elastic import harness  # noqa: E402


def test_loss_value_for_the_status_file() -> None:
    assert loss_value(None) is None
    assert loss_value(1.5) == 1.5
    assert loss_value(torch.tensor(2.25)) == 2.25
    assert loss_value(torch.tensor([0.5])) == 0.5
    for bad in (float("nan"), math.inf, torch.tensor(float("nan")), torch.ones(3), "x"):
        assert loss_value(bad) is None, bad  # not JSON, or not one number


@pytest.mark.slow  # forms a gloo group (about 1 s on an idle machine)
def test_end_step_takes_the_loss_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCTL_STATUS_DIR", str(tmp_path))
    with harness.single_rank_group():
        model = harness.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = elastic.Run(model, opt, dataset_size=8, global_batch=4, max_steps=1,
                          checkpoint_every=1000, checkpoint_dir=str(tmp_path / "ck"))
        x, y = harness.data(8)
        assert run.next_step()
        idx = run.batch_indices()
        loss = nn.functional.mse_loss(run.model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.end_step(loss)  # the first step's report is written at once
        rep = json.loads((tmp_path / "worker-0.json").read_text())
        assert rep["step"] == 1 and rep["loss"] == pytest.approx(loss.item())
        run.ckpt.close()
