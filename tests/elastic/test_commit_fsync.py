"""A checkpoint's COMMIT marker is durable by behaviour: after a real DCP save into a step
directory, write_commit must fsync the marker's data before renaming it into place and
fsync the step directory after, and every data file DCP wrote must already be synced by
then. Every os.fsync and os.replace is recorded as it happens (the real call still made);
removing either fsync of write_commit fails this test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spotctl.elastic.checkpoint import COMMIT, Store
from tests.unit.test_atomic_write_fsync import calls  # noqa: F401 (the recording fixture)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_commit_marker_is_synced_renamed_then_its_directory_synced(
    tmp_path: Path, calls: list[tuple[Any, ...]]  # noqa: F811
) -> None:
    store = Store(tmp_path / "ckpt")
    store.prepare()
    step_dir = Path(store.step_id(120))
    dcp.save({"w": torch.arange(8.0)}, storage_writer=store.writer(120))
    assert store.has_metadata(120) and not store.committed(120)
    data_synced = {c[1] for c in calls if c[0] == "fsync-file"}
    assert any(Path(p).parent == step_dir for p in data_synced), calls  # DCP synced its files
    del calls[:]

    meta = {"step": 120, "world_size": 2}
    store.write_commit(120, meta)

    kinds = [c[0] for c in calls]
    assert kinds == ["fsync-file", "rename", "fsync-dir"], calls
    _, synced, data = calls[0]
    _, src, dst = calls[1]
    assert synced == src and Path(dst) == step_dir / COMMIT and src != dst, calls
    assert json.loads(data) == meta  # complete when synced, before it had its name
    assert Path(calls[2][1]) == step_dir  # the directory that now holds COMMIT
    assert store.committed(120) and store.read_commit(120) == meta
    assert sorted(p.name for p in step_dir.iterdir() if "tmp" in p.name) == []
