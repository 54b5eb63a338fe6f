"""The resume helpers on their own (fast, no framework imported): which checkpoint each
framework resumes from, and the arguments that keep the Trainer's global batch."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from spotctl.integrations._checkpoints import latest_hf_checkpoint, latest_zip_checkpoint


def _ckpt(root: Path, step: int, state: str | None) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if state is not None:
        (d / "trainer_state.json").write_text(state)


def test_hf_latest_checkpoint_passes_over_an_unfinished_one(tmp_path: Path) -> None:
    assert latest_hf_checkpoint(tmp_path / "none") is None
    assert latest_hf_checkpoint(tmp_path) is None
    _ckpt(tmp_path, 4, json.dumps({"global_step": 4}))
    _ckpt(tmp_path, 12, json.dumps({"global_step": 12}))
    _ckpt(tmp_path, 16, None)                              # killed before trainer_state.json
    _ckpt(tmp_path, 20, '{"global_step": 2')               # killed while writing it
    _ckpt(tmp_path, 24, json.dumps({"global_step": 8}))    # not this step's state
    (tmp_path / "checkpoint-99").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_hf_checkpoint(tmp_path) == str(tmp_path / "checkpoint-12")


def test_lightning_latest_checkpoint_takes_the_newest_whole_file(tmp_path: Path) -> None:
    assert latest_zip_checkpoint(tmp_path / "none") is None

    def whole(name: str) -> Path:
        with zipfile.ZipFile(tmp_path / name, "w") as z:  # torch.save's format is a zip
            z.writestr("archive/data.pkl", b"x")
        return tmp_path / name

    whole("epoch=0-step=8.ckpt")                             # ModelCheckpoint's default name
    want = whole("notice-step=11.ckpt")
    cut = whole("notice-step=30.ckpt").read_bytes()
    (tmp_path / "notice-step=30.ckpt").write_bytes(cut[: len(cut) // 2])  # killed mid-write
    whole("notice-step=40.ckpt.tmp")                         # not renamed into place yet
    whole("last.ckpt")                                       # no step in the name
    assert latest_zip_checkpoint(tmp_path) == str(want)


@pytest.mark.slow  # TrainingArguments imports torch and accelerate: ~6 s
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (the 'hf' extra)")
def test_keep_global_batch_sets_accumulation_for_the_world(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from spotctl.integrations.hf import GlobalBatchError, keep_global_batch

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             report_to="none", use_cpu=True)
    assert keep_global_batch(args, 64, world=2).gradient_accumulation_steps == 8
    assert keep_global_batch(args, 64, world=16).gradient_accumulation_steps == 1
    with pytest.raises(GlobalBatchError, match="not a multiple of per-device batch 4"):
        keep_global_batch(args, 64, world=3)
