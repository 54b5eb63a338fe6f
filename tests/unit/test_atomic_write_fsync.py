"""Atomic writes are durable by behaviour, not by the words in their source: every
os.fsync and os.replace the writers make is recorded as it happens (with the real call
still made), and the order must be: data written, the temp file fsynced, renamed over the
target, then the directory fsynced. Removing any of those fsyncs fails these tests."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from spotctl.state import write_json_atomic, write_private


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    rec: list[tuple[Any, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            rec.append(("fsync-dir", target))
        else:
            # what the file holds when it is synced: the data must be written by then
            rec.append(("fsync-file", target, Path(target).read_bytes()))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        rec.append(("rename", str(src), str(dst)))
        real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return rec


def _check_order(rec: list[tuple[Any, ...]], path: Path, content: bytes) -> None:
    kinds = [c[0] for c in rec]
    assert kinds == ["fsync-file", "rename", "fsync-dir"], rec
    _, synced, data = rec[0]
    _, src, dst = rec[1]
    assert synced == src and src != str(path), rec  # the temp file, before the rename
    assert data == content  # its data was complete when it was synced
    assert dst == str(path)
    assert rec[2][1] == str(path.parent)  # the directory holding the new entry
    assert path.read_bytes() == content
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]


def test_write_json_atomic_syncs_data_renames_then_syncs_dir(
    tmp_path: Path, calls: list[tuple[Any, ...]]
) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"old": 1}')
    write_json_atomic(path, {"new": [1, 2, 3]})
    _check_order(calls, path, json.dumps({"new": [1, 2, 3]}).encode())


def test_write_private_syncs_data_renames_then_syncs_dir(
    tmp_path: Path, calls: list[tuple[Any, ...]]
) -> None:
    path = tmp_path / "d" / "token"
    write_private(path, "s3cret\n")
    _check_order(calls, path, b"s3cret\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_heads_step_bounds_file_is_replaced_atomically(
    tmp_path: Path, calls: list[tuple[Any, ...]]
) -> None:
    """kills: the head's step-bounds file written in place (no fsync, no rename): a head
    that crashed mid-write would find it torn, take it for no history, and then believe
    any step a node's credential reports. A restarted head reads back what was kept."""
    from spotctl.head.server import BOUNDS_FILE, StepBounds

    path = tmp_path / BOUNDS_FILE
    path.write_text('{"step": 3, "at": 1.0}')
    b = StepBounds(path, clock=lambda: 100.0)
    w = {"step": 40, "resume_step": 30, "last_ckpt": 30, "drain_step": None}
    b.check("n1", {"workers": [w]})
    b.save()
    _check_order(calls, path, json.dumps({"step": 40, "at": 100.0}).encode())
    again = StepBounds(path, clock=lambda: 200.0)
    assert again.cluster == (40, 100.0)
