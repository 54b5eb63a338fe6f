"""Issue 60, finding 4: checkpoints are data. Any worker can write every node's checkpoint
prefix, and DCP loads its `.metadata` with pickle and every non-tensor value with
`torch.load(weights_only=False)`; spotctl loaded its `extra` the same way. A planted file
ran its payload in every worker that restored from it (spotctl.elastic.ckptsafe).

The payload here creates a marker file when unpickled (posix.system). The attacker is a
member: it rewrites COMMIT with the planted file's true size and digest, so what refuses
it is the loader, not the digest; a planted file without a matching COMMIT is refused by
the digest check."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spotctl.elastic.checkpoint import Checkpointer, committed_steps, step_dir
from spotctl.elastic.ckptsafe import UnsafeCheckpoint, load_extra, load_metadata
from tests.elastic.harness import launch, single_rank_group


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant_metadata(d: Path, marker: Path, fix_commit: bool) -> None:
    """Replace `.metadata` with DCP's own metadata plus a payload beside it."""
    with open(d / ".metadata", "rb") as f:
        real = load_metadata(f)
    real.storage_meta = (real.storage_meta, Payload(marker))  # type: ignore[assignment]
    blob = pickle.dumps(real)
    (d / ".metadata").write_bytes(blob)
    if fix_commit:
        commit = json.loads((d / "COMMIT").read_text())
        commit["files"][".metadata"] = [len(blob), hashlib.sha256(blob).hexdigest()]
        (d / "COMMIT").write_text(json.dumps(commit))


def _state(scale: float, extra: Any = b"") -> dict[str, Any]:
    return {"model": {"w": torch.full((64, 64), scale)}, "extra": extra}


def test_planted_metadata_and_values_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    root = tmp_path / "ck"
    with single_rank_group() as pg:
        ck = Checkpointer(root, keep_last=5, rank=0, pg=pg, mode="thread")
        assert ck.save_sync(1, _state(1.0), {"epoch": 0, "offset": 0})
        # a member writes a value that runs code when DCP loads it (a valid COMMIT)
        assert ck.save_sync(2, _state(2.0, Payload(marker)), {"epoch": 0, "offset": 0})
        assert ck.save_sync(3, _state(3.0), {"epoch": 0, "offset": 0})
        assert ck.save_sync(4, _state(4.0), {"epoch": 0, "offset": 0})
        _plant_metadata(step_dir(root, 4), marker, fix_commit=True)
        ck.close()

        def load(step: int) -> Any:
            st = _state(0.0)
            Checkpointer(root, keep_last=5, rank=0, pg=pg).load([step], st)
            return st

        for step, why in ((4, "names posix.system"), (2, "weights-only")):
            with pytest.raises(RuntimeError, match=why):
                load(step)
            assert not marker.exists(), f"step {step}'s payload ran"
        # planted without a matching COMMIT: the digest refuses it first
        _plant_metadata(step_dir(root, 3), marker, fix_commit=False)
        with pytest.raises(RuntimeError, match=r"\.metadata is \d+ bytes, its COMMIT recorded"):
            load(3)
        # the newest that loads is step 1, loudly
        st = _state(0.0)
        meta = Checkpointer(root, keep_last=5, rank=0, pg=pg).load([4, 3, 2, 1], st)
        assert meta["step"] == 1 and float(st["model"]["w"][0, 0]) == 1.0
    assert not marker.exists()
    # DCP's own loaders would have run it (the probe works)
    with pytest.raises(Exception):  # noqa: B017 - whatever DCP makes of the payload's result
        dcp.FileSystemReader(str(step_dir(root, 4))).read_metadata()
    assert marker.exists()


def test_spotctls_extra_state_loads_data_only(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    buf = io.BytesIO()
    torch.save({"schedulers": [], "user": {}, "rng": [], "x": Payload(marker)}, buf)
    with pytest.raises(UnsafeCheckpoint, match="extra state is not plain data"):
        load_extra(buf.getvalue())
    assert not marker.exists()
    # what spotctl itself saves there loads (RNG states, numpy's included)
    import random

    import numpy as np

    ok = io.BytesIO()
    torch.save({"rng": [{"python": random.getstate(), "torch": torch.get_rng_state(),
                         "numpy": np.random.get_state()}], "schedulers": [{"lr": 0.1}]}, ok)
    assert load_extra(ok.getvalue())["schedulers"] == [{"lr": 0.1}]


@pytest.mark.slow
def test_workers_restoring_from_a_planted_checkpoint_refuse_it(tmp_path: Path) -> None:
    """Real spotctl.elastic.Run workers (2, gloo): the newest committed step's metadata is
    planted (with a matching COMMIT); the next incarnation refuses it, resumes from the
    one before, and the payload never runs."""
    marker = tmp_path / "payload-ran"
    cfg = {"n": 40, "batch": 8, "seed": 5, "steps": 10, "every": 3,
           "root": str(tmp_path / "ck")}
    # two incarnations, each ending in a drain: a drain's save always commits, while a
    # periodic async save may be left behind by the drain under load (seen: only step 8
    # committed), so the first drain makes sure there is a committed step before the last
    a0 = launch(2, {**cfg, "out": str(tmp_path / "a0"), "drain_at": 4})
    assert a0[0]["end"] in ("drained@4", "drained@5") and a0[1]["end"] == a0[0]["end"], a0
    a = launch(2, {**cfg, "out": str(tmp_path / "a"), "drain_at": 7})
    drained = int(a[0]["end"].split("@")[1])  # the drain is agreed at step 7 or 8
    assert [r["end"] for r in a] == [f"drained@{drained}"] * 2 and drained > 6
    committed = sorted(committed_steps(cfg["root"]))
    assert committed[-1] == drained and len(committed) >= 2, committed
    _plant_metadata(step_dir(Path(cfg["root"]), drained), marker, fix_commit=True)
    b = launch(2, {**cfg, "out": str(tmp_path / "b")})
    assert not marker.exists(), "the planted metadata ran in a worker"
    # the planted step refused, the committed one before it loaded (step 6, or 4 where the
    # drain left step 6's upload behind)
    assert [r["resume"] for r in b] == [committed[-2]] * 2 and b[0]["end"] == "finished"
