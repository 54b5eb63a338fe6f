"""The Trainer helpers on their own (fast): the checkpoint to resume from and the
arguments that keep the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from spotctl.integrations.hf import (  # noqa: E402
    GlobalBatchError,
    keep_global_batch,
    latest_checkpoint,
)


def _ckpt(root: Path, step: int, state: str | None) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if state is not None:
        (d / "trainer_state.json").write_text(state)


def test_latest_checkpoint_passes_over_an_unfinished_one(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    assert latest_checkpoint(tmp_path) is None
    _ckpt(tmp_path, 4, json.dumps({"global_step": 4}))
    _ckpt(tmp_path, 12, json.dumps({"global_step": 12}))
    _ckpt(tmp_path, 16, None)                              # killed before trainer_state.json
    _ckpt(tmp_path, 20, '{"global_step": 2')               # killed while writing it
    _ckpt(tmp_path, 24, json.dumps({"global_step": 8}))    # not this step's state
    (tmp_path / "checkpoint-99").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-12")


@pytest.mark.slow  # TrainingArguments imports torch and accelerate: ~6 s
def test_keep_global_batch_sets_accumulation_for_the_world(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             report_to="none", use_cpu=True)
    assert keep_global_batch(args, 64, world=2).gradient_accumulation_steps == 8
    assert keep_global_batch(args, 64, world=16).gradient_accumulation_steps == 1
    with pytest.raises(GlobalBatchError, match="not a multiple of per-device batch 4"):
        keep_global_batch(args, 64, world=3)
