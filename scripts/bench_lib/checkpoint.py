"""Checkpoint: how long a save blocks training, async vs sync, and save/load throughput
against the disk's own sequential write speed, all measured in the same run.

Two processes (torch.multiprocessing) form a gloo group and save a replicated DDP-like
state of `size_mb` MB through spotctl.elastic.checkpoint.Checkpointer: save_async in
both modes (thread: DCP async_save in a thread; process: a persistent checkpoint process
per rank fed by a persistent stager, pinned host memory and a background copy where CUDA
is available; the call blocks for the staging copy) and save_sync (DCP save + COMMIT,
the drain path). Load is Checkpointer.load_latest. The disk figure is a
dd-like write of the same number of bytes in 8 MB blocks plus fsync, in the same
directory, then a sequential read of that file. Reads right after the writes come mostly
from the page cache, for DCP and for the disk figure alike.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .core import Context, Row, row

BLOCK = 8 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def disk_write(path: Path, nbytes: int) -> float:
    """Seconds to write nbytes sequentially and fsync them (like dd conv=fsync)."""
    buf = os.urandom(min(BLOCK, nbytes))
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = f.write(buf[: min(len(buf), left)])
            left -= n
        os.fsync(f.fileno())
    return time.perf_counter() - t


def disk_read(path: Path) -> float:
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    return time.perf_counter() - t


def _worker(
    rank: int, world: int, port: int, root: str, size_mb: int, repeat: int, out: str,
    mode: str = "thread",
) -> None:
    import torch
    import torch.distributed as dist

    from spotctl.elastic.checkpoint import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg = dist.new_group(backend="gloo")
    n = size_mb * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "model": {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(8)}
    }
    ck = Checkpointer(root, keep_last=1, rank=rank, pg=pg, mode=mode)
    step = 0
    if mode == "process":  # start the checkpoint process and the stager's buffers
        step += 1
        ck.save_async(step, state, {"epoch": 0, "offset": 0})
        ck.wait_pending()
    res: dict[str, list[float]] = {
        "sync_s": [],
        "async_block_s": [],
        "async_total_s": [],
        "load_s": [],
    }
    for _ in range(repeat):
        step += 1
        dist.barrier()
        t = time.perf_counter()
        ok = ck.save_sync(step, state, {"epoch": 0, "offset": 0})
        res["sync_s"].append(time.perf_counter() - t)
        assert ok, "sync save failed"
        step += 1
        dist.barrier()
        t = time.perf_counter()
        ck.save_async(step, state, {"epoch": 0, "offset": 0})
        res["async_block_s"].append(time.perf_counter() - t)
        ck.wait_pending()
        dist.barrier(group=pg)
        res["async_total_s"].append(time.perf_counter() - t)
        dist.barrier()
        fresh = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        t = time.perf_counter()
        meta = ck.load_latest(fresh)
        res["load_s"].append(time.perf_counter() - t)
        assert meta is not None and torch.equal(
            fresh["model"]["layer0.weight"], state["model"]["layer0.weight"]
        )
    ck.close()
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def bench(ctx: Context, size_mb: int = 128, repeat: int | None = None) -> list[Row]:
    import torch.multiprocessing as mp

    n = ctx.reps(3) if repeat is None else repeat
    work = ctx.subdir("checkpoint")
    out = work / "result.json"
    ctx.log(f"checkpoint: {size_mb} MB state, 2 gloo ranks, {n} round(s), thread and process")
    results = {}
    for mode in ("thread", "process"):
        mp.start_processes(
            _worker,
            args=(2, _free_port(), str(work / f"ckpt-{mode}"), size_mb, n, str(out), mode),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        results[mode] = json.loads(out.read_text())
    res, proc = results["thread"], results["process"]
    nbytes = size_mb << 20
    wr, rd = [], []
    for i in range(n):
        f = work / f"dd-{i}.bin"
        wr.append(size_mb / disk_write(f, nbytes))
        rd.append(size_mb / disk_read(f))
        f.unlink()
    mb = float(size_mb)
    ctx.sim["checkpoint_cost_s"] = round(_med(res["async_block_s"]), 3)
    return [
        row(
            "checkpoint",
            f"blocking time per save ({size_mb} MB)",
            res["async_block_s"],
            res["sync_s"],
            "s",
            "spotctl periodic async save (DCP thread mode) vs sync save; "
            f"async completes in background in {_med(res['async_total_s']):.2f} s",
        ),
        row(
            "checkpoint",
            f"blocking time per save, process mode ({size_mb} MB)",
            proc["async_block_s"],
            proc["sync_s"],
            "s",
            "async save through a checkpoint process + persistent stager (pinned memory "
            f"only with CUDA) vs sync save; completes in {_med(proc['async_total_s']):.2f} s",
        ),
        row(
            "checkpoint",
            "save throughput",
            [mb / s for s in res["sync_s"]],
            wr,
            "MB/s",
            "DCP save+fsync+COMMIT (2 ranks) vs dd-like write+fsync of the same size",
        ),
        row(
            "checkpoint",
            "load throughput",
            [mb / s for s in res["load_s"]],
            rd,
            "MB/s",
            "load_latest (2 ranks) vs sequential read of the dd file (page cache warm)",
        ),
    ]


def _med(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")
