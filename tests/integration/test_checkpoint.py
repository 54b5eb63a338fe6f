"""spotctl.elastic checkpoints with real gloo process groups (torch.multiprocessing):
async and sync saves commit atomically, an uncommitted directory is never loaded,
keep-last-K prunes, a 2-rank checkpoint loads at world size 1 (resharding), and a
corrupted newest checkpoint falls back to the previous committed one."""

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
from spotctl.elastic.checkpoint import COMMIT, Checkpointer, committed_steps, step_dir  # noqa: E402

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
    ck = Checkpointer(Path(root), keep_last=2, rank=rank, pg=pg)
    if mode == "save":
        for step in (10, 20):
            ck.save_async(step, _state(step), {"epoch": 0, "offset": step * 4})
            ck.wait_pending()
        assert ck.save_sync(30, _state(30.0), {"epoch": 1, "offset": 0})
        # a save that dies before its commit: data on disk, no COMMIT
        if rank == 0:
            d = step_dir(Path(root), 40)
            d.mkdir()
            (d / "__0_0.distcp").write_bytes(b"partial")
    else:
        st = _state(0.0)
        meta = ck.load_latest(st)
        if rank == 0:
            Path(out).write_text(f"{meta['step'] if meta else None} {float(st['model']['w'][0, 0])}")
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, root: Path, mode: str, out: Path) -> None:
    mp.start_processes(_worker, args=(world, _free_port(), str(root), mode, str(out)),
                       nprocs=world, join=True, start_method="spawn")


@pytest.mark.slow  # several gloo process groups
def test_commit_prune_reshard_and_fallback(tmp_path):
    root = tmp_path / "ck"
    _run(2, root, "save", tmp_path / "o")
    assert committed_steps(root) == [30, 20]  # keep_last=2 pruned step 10
    assert not (step_dir(root, 10)).exists()
    assert not (step_dir(root, 40) / COMMIT).exists()
    # 2 ranks saved, 1 rank loads: newest committed step, never the uncommitted 40
    _run(1, root, "load", tmp_path / "o1")
    assert (tmp_path / "o1").read_text() == "30 30.0"
    # corrupt the newest: every data file of step 30 truncated
    for f in step_dir(root, 30).glob("*.distcp"):
        f.write_bytes(b"\0" * 10)
    _run(1, root, "load", tmp_path / "o2")
    assert (tmp_path / "o2").read_text() == "20 20.0"


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
