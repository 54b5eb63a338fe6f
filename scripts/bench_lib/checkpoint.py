"""Checkpoint: how long a save blocks training, async vs sync, and save/load throughput
against the disk's own sequential write speed, all measured in the same run.

First rows, the figure that matters: a real training loop (spotctl.elastic.Run, DDP over
2 gloo ranks, an MLP with Adam whose parameters + Adam state are about `size_mb` MB) with
a periodic async save every EVERY steps, in thread and in process mode. The save step's
end_step() returns once the buffers and small values are copied; the parameters and Adam
state are copied in a background thread while the next step's forward/backward runs, and
that step's optimizer.step() waits for the copy. Blocking per save = the save step's
end_step() (state dict, RNG gather, save_async) + that wait; baseline = the drain path's
synchronous save of the same state (Run._state() + save_sync) in the same loop. The note
also gives what the background copy and write cost the loop in all: how much longer the
EVERY steps starting at a save run than EVERY steps without a save (CPU contention on a
small machine included).

Then, without a training loop: two processes save a replicated DDP-like state of
`size_mb` MB through Checkpointer (unguarded: the whole state is copied before
save_async returns, as for the torchft engine) in both modes vs save_sync (DCP save +
COMMIT). Load is Checkpointer.load_latest. The disk figure is a
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


WIDTH = 1024
EVERY = 4


def _loop_worker(
    rank: int, world: int, port: int, root: str, size_mb: int, repeat: int, out: str,
    mode: str,
) -> None:
    """A real training loop through spotctl.elastic.Run (DDP over gloo, Adam): an MLP whose
    parameters + Adam state are about size_mb, a periodic async save every EVERY steps.
    Blocking per save = the time end_step() takes on a save step (state dict + RNG gather
    + save_async) + the time the next optimizer.step() waits for the background copy.
    Baseline: the drain path's synchronous save of the same state (Run._state() +
    Checkpointer.save_sync) in the same loop. Both are timed from a barrier after step().
    Overhead per save = how much longer the EVERY steps from a save step on take than
    EVERY median steps without saves (what the background copy and write cost the loop,
    contention included)."""
    import statistics

    import torch
    import torch.distributed as dist

    from spotctl import elastic

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), SPOTCTL_ASYNC_SAVE=mode)
    os.environ.pop("SPOTCTL_STATUS_DIR", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layers = max(1, round(size_mb * (1 << 20) / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    every = EVERY
    # steps 1..warm: two saves to warm up (stager buffers, checkpoint process, page
    # cache); then `repeat` periodic saves, each followed by its interval of every-1
    # steps; then `plain` steps without a save; then `repeat` synchronous saves
    warm = 2 * every
    last_save = warm + every * repeat
    plain0 = last_save + every
    plain = max(2 * every, 6)
    sync0 = plain0 + plain
    run = elastic.Run(model, opt, dataset_size=1 << 20, global_batch=16 * world,
                      checkpoint_every=every, checkpoint_dir=root, keep_last=1,
                      max_steps=sync0 + repeat - 1)
    x = torch.randn(16, WIDTH)
    state_fn = run._state
    state_s: list[float] = []

    def timed_state(with_extra: bool = True) -> dict[str, Any]:  # where end_step's time goes
        t = time.perf_counter()
        st = state_fn(with_extra)
        state_s.append(time.perf_counter() - t)
        return st

    run._state = timed_state  # type: ignore[method-assign]
    save_s: dict[int, float] = {}
    step_s: dict[int, float] = {}
    end_s: dict[int, float] = {}
    wait_s: dict[int, float] = {}
    sync_s: list[float] = []
    while run.next_step():
        t0 = time.perf_counter()
        opt.zero_grad()
        for _ in run.micro_batches():
            (run.model(x).square().sum() * run.loss_scale).backward()
        run.ckpt.last_wait_s = 0.0
        opt.step()
        wait_s[run.step + 1] = run.ckpt.last_wait_s  # this step() waited for a copy
        if (run.step + 1) % run.every == 0:
            # ranks level before a save, as before the sync baseline: the RNG gather in
            # the state dict would otherwise time the other rank's lag, not the save
            dist.barrier()
        t1 = time.perf_counter()
        run.end_step()
        t2 = time.perf_counter()
        step_s[run.step] = t2 - t0
        end_s[run.step] = t2 - t1
        save_s[run.step] = run.ckpt.last_block_s
        if run.step == last_save:
            run.every = 1 << 30  # no periodic save from here on
        elif run.step == plain0 - 1:
            run.ckpt.wait_pending()  # the last save's write is done before the plain steps
        elif run.step >= sync0:  # the baseline: the drain path's sync save, same state
            dist.barrier()
            t = time.perf_counter()
            assert run.ckpt.save_sync(run.step, run._state(), run._meta())
            sync_s.append(time.perf_counter() - t)
    base = statistics.median(step_s[s] for s in range(plain0, sync0))
    saves = list(range(warm + every, last_save + 1, every))
    res = {
        "block_s": [end_s[s] + wait_s[s + 1] for s in saves],
        "wait_s": [wait_s[s + 1] for s in saves],
        "state_s": state_s[2:2 + repeat],  # Run._state() of the timed periodic saves
        "save_async_s": [save_s[s] for s in saves],
        "overhead_s": [sum(step_s[s + i] for i in range(every)) - every * base for s in saves],
        "step_s": [base],
        "sync_s": sync_s,
        "state_mb": [sum(p.numel() for p in model.parameters()) * 12 / (1 << 20)],
    }
    run.finish()
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def bench(ctx: Context, size_mb: int = 128, repeat: int | None = None) -> list[Row]:
    import torch.multiprocessing as mp

    n = ctx.reps(3) if repeat is None else repeat
    work = ctx.subdir("checkpoint")
    out = work / "result.json"
    ctx.log(f"checkpoint: {size_mb} MB state, 2 gloo ranks, {n} round(s), thread and process")
    def run(worker: Any, tag: str) -> dict[str, Any]:
        by_mode = {}
        for mode in ("thread", "process"):
            mp.start_processes(
                worker,
                args=(2, _free_port(), str(work / f"{tag}-{mode}"), size_mb, n, str(out), mode),
                nprocs=2,
                join=True,
                start_method="spawn",
            )
            by_mode[mode] = json.loads(out.read_text())
        return by_mode

    results = run(_worker, "ckpt")  # bare saves
    loops = run(_loop_worker, "loop")  # periodic saves inside an elastic.Run loop
    res, proc = results["thread"], results["process"]
    nbytes = size_mb << 20
    wr, rd = [], []
    for i in range(n):
        f = work / f"dd-{i}.bin"
        wr.append(size_mb / disk_write(f, nbytes))
        rd.append(size_mb / disk_read(f))
        f.unlink()
    mb = float(size_mb)
    # what a periodic save costs the loop (Run's default mode on CPU): its blocking, or
    # the whole interval's slowdown where the background copy and write cost more
    lt = loops["thread"]
    ctx.sim["checkpoint_cost_s"] = round(max(_med(lt["block_s"]), _med(lt["overhead_s"])), 3)
    loop_rows = [
        row(
            "checkpoint",
            f"training loop: blocking per periodic save, {mode} mode "
            f"({lp['state_mb'][0]:.0f} MB)",
            lp["block_s"],
            lp["sync_s"],
            "s",
            f"elastic.Run, DDP+Adam, 2 gloo ranks: end_step() with the save (state dict "
            f"{_med(lp['state_s']):.3f} s, save_async {_med(lp['save_async_s']):.3f} s) + "
            f"the next step()'s wait for the background copy ({_med(lp['wait_s']):.3f} s) "
            f"vs the drain's sync save; ratio {_med(lp['block_s']) / _med(lp['sync_s']):.1%}"
            f"; the {EVERY}-step interval with a save runs {_med(lp['overhead_s']):+.3f} s "
            f"longer than {EVERY} steps without (a step: {lp['step_s'][0]:.3f} s)",
        )
        for mode, lp in loops.items()
    ]
    return loop_rows + [
        row(
            "checkpoint",
            f"blocking time per save ({size_mb} MB)",
            res["async_block_s"],
            res["sync_s"],
            "s",
            "unguarded async save (DCP thread mode, whole state copied in the call) vs sync "
            "save; "
            f"async completes in background in {_med(res['async_total_s']):.2f} s",
        ),
        row(
            "checkpoint",
            f"blocking time per save, process mode ({size_mb} MB)",
            proc["async_block_s"],
            proc["sync_s"],
            "s",
            "unguarded async save through a checkpoint process + persistent stager (pinned "
            f"memory only with CUDA) vs sync save; completes in {_med(proc['async_total_s']):.2f} s",
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
