"""spotctl.elastic checkpoints with real gloo process groups (torch.multiprocessing), on a
local directory, on S3 (moto server through s3fs) and on GCS (the fake GCP server's
storage JSON API through gcsfs): async and sync saves commit
atomically, a committed step is never written again, an uncommitted directory is never
loaded, keep-last-K prunes, a 2-rank checkpoint loads at world size 1 (resharding), a
corrupted newest checkpoint falls back to the previous committed one, and when no
committed checkpoint loads the run refuses to start over."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from spotctl.elastic import epoch_permutation, split_batch  # noqa: E402
from spotctl.elastic.checkpoint import (  # noqa: E402
    Checkpointer,
    committed_steps,
    open_store,
    read_commit,
    step_dir,
)
from tests.elastic.s3 import moto_s3  # noqa: E402
from tests.gcp.fake_storage import fake_gcs  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _state(scale: float) -> dict:
    return {"model": {"w": torch.full((256, 256), scale), "b": torch.arange(8.0) * scale}}


def _worker(rank: int, world: int, port: int, root: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    pg = dist.new_group(backend="gloo")
    ck = Checkpointer(root, keep_last=2, rank=rank, pg=pg)
    if mode == "save":
        for step in (10, 20):
            ck.save_async(step, _state(step), {"epoch": 0, "offset": step * 4})
            ck.wait_pending()
        assert ck.save_sync(30, _state(30.0), {"epoch": 1, "offset": 0})
        stamp = read_commit(root, 30)["committed_at"]
        # a drain at the committed step: not written again (nor deleted on a failure)
        assert ck.save_sync(30, _state(99.0), {"epoch": 1, "offset": 0})
        assert read_commit(root, 30)["committed_at"] == stamp
        # a save that dies before its commit: data stored, no COMMIT
        if rank == 0:
            store = open_store(root)
            if hasattr(store, "fs"):
                store.fs.pipe_file(f"{store.path}/step-00000040/__0_0.distcp", b"partial")
            else:
                d = step_dir(Path(root), 40)
                d.mkdir()
                (d / "__0_0.distcp").write_bytes(b"partial")
        ck.close()
    else:
        st = _state(0.0)
        try:
            meta = ck.load_latest(st)
            res = f"{meta['step'] if meta else None} {float(st['model']['w'][0, 0])}"
        except RuntimeError as e:
            res = f"raised: {e}"
        if rank == 0:
            Path(out).write_text(res)
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, root: Path | str, mode: str, out: Path) -> None:
    mp.start_processes(_worker, args=(world, _free_port(), str(root), mode, str(out)),
                       nprocs=world, join=True, start_method="spawn")


def _corrupt(root: str, step: int) -> None:
    store = open_store(root)
    if hasattr(store, "fs"):
        for f in store.fs.glob(f"{store.path}/step-{step:08d}/*.distcp"):
            store.fs.pipe_file(f, b"\0" * 10)
    else:
        for f in step_dir(Path(root), step).glob("*.distcp"):
            f.write_bytes(b"\0" * 10)


@pytest.mark.slow  # several gloo process groups
@pytest.mark.parametrize("where", ["local", "s3", "gs"])
def test_commit_prune_reshard_and_fallback(tmp_path, where):
    if where == "s3":
        pytest.importorskip("s3fs")
        with moto_s3("ckpts"):
            _commit_prune_reshard_and_fallback(tmp_path, "s3://ckpts/run-1")
    elif where == "gs":
        pytest.importorskip("gcsfs")
        with fake_gcs("ckpts"):
            _commit_prune_reshard_and_fallback(tmp_path, "gs://ckpts/run-1")
    else:
        _commit_prune_reshard_and_fallback(tmp_path, str(tmp_path / "ck"))


def _commit_prune_reshard_and_fallback(tmp_path: Path, root: str) -> None:
    _run(2, root, "save", tmp_path / "o")
    assert committed_steps(root) == [30, 20]  # keep_last=2 pruned step 10
    steps = open_store(root).steps()
    assert 10 not in steps and steps[40] is False  # 40: data without COMMIT
    # 2 ranks saved, 1 rank loads: newest committed step, never the uncommitted 40
    _run(1, root, "load", tmp_path / "o1")
    assert (tmp_path / "o1").read_text() == "30 30.0"
    # corrupt the newest: every data file of step 30 truncated
    _corrupt(root, 30)
    _run(1, root, "load", tmp_path / "o2")
    assert (tmp_path / "o2").read_text() == "20 20.0"
    # nothing loads: a loud error, never a silent restart from step 0
    _corrupt(root, 20)
    _run(1, root, "load", tmp_path / "o3")
    assert (tmp_path / "o3").read_text().startswith("raised: committed checkpoints [30, 20]")


def test_split_batch_covers_every_sample_once():
    for count in (1, 7, 32, 33):
        for world in (1, 2, 3, 5):
            parts = [split_batch(count, world, r) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(parts[:-1], parts[1:], strict=True))
            sizes = [b - a for a, b in parts]
            assert max(sizes) - min(sizes) <= 1


def test_epoch_permutation_is_deterministic_and_varies_by_epoch():
    a = epoch_permutation(100, 0, 0)
    assert torch.equal(a, epoch_permutation(100, 0, 0))
    assert sorted(a.tolist()) == list(range(100))
    assert not torch.equal(a, epoch_permutation(100, 0, 1))
