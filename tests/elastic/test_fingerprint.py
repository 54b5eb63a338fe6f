"""A checkpoint written for another model is refused at resume in one line (issue 62),
before DCP's load fails on one tensor: the parameters' names and shapes are recorded in
every checkpoint's metadata (Run._meta) and compared (Run._check_meta). The rest of the
check (global batch, dataset size, seed) on real torchrun: tests/elastic/test_rescale_state.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from spotctl import elastic
from spotctl.elastic import ResumeMismatch, Run, params_fingerprint


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 1))


def test_the_fingerprint_names_the_parameters_and_their_shapes() -> None:
    a = params_fingerprint(mlp(64))
    assert a == params_fingerprint(mlp(64)) and a.startswith("4:")
    assert params_fingerprint(mlp(32)) != a  # a shape
    assert params_fingerprint(nn.Sequential(nn.GELU(), *mlp(64))) != a  # a name


def test_ddp_prefix_is_not_part_of_it() -> None:
    m = mlp(8)
    fake_ddp = SimpleNamespace(named_parameters=lambda: [
        ("module." + k, v) for k, v in m.named_parameters()])
    assert params_fingerprint(fake_ddp) == params_fingerprint(m)  # type: ignore[arg-type]


@pytest.mark.parametrize("under_spotctl,fresh", [
    (True, "`spotctl down --purge`, or another cluster name"), (False, "a new checkpoint_dir")])
def test_another_models_checkpoint_is_one_line(monkeypatch, under_spotctl, fresh) -> None:
    if under_spotctl:
        monkeypatch.setenv("SPOTCTL_NODE_ID", "n1")
    else:
        monkeypatch.delenv("SPOTCTL_NODE_ID", raising=False)
    mine = params_fingerprint(mlp(64))
    theirs = params_fingerprint(mlp(32))
    run = SimpleNamespace(params_fp=mine, global_batch=32, dataset_size=2048, seed=0,
                          ckpt=SimpleNamespace(root="/c"))
    meta = {"params": theirs, "global_batch": 32, "dataset_size": 2048, "seed": 0}
    with pytest.raises(ResumeMismatch) as e:
        Run._check_meta(run, meta, 40)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"spotctl.elastic: checkpoint step 40 under /c was written for another model "
        f"(parameters {theirs}, this one's {mine}); start fresh: {fresh}")
    Run._check_meta(run, {**meta, "params": mine}, 40)  # type: ignore[arg-type]
    Run._check_meta(run, {k: v for k, v in meta.items() if k != "params"}, 40)  # older ones
    assert elastic.ResumeMismatch is ResumeMismatch
