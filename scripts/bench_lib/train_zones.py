"""The zones benchmark's training (scripts/bench zones): one rank per replica group, each
in its own network namespace, torch DDP over gloo. Every setting trains the same model
on the same synthetic regression task for the same number of samples (ZB_SAMPLES): the
global batch is ZB_BATCH per rank, so fewer ranks take more steps. Rank 0 writes (JSON,
to ZB_OUT) each step's time, the samples/s and the held-out loss after those samples.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (rank 0's namespace address),
ZB_HIDDEN (model width), ZB_BATCH, ZB_SAMPLES, ZB_OUT."""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

DIM, DATA, HELD_OUT = 32, 8192, 1024
LR = 3e-3  # AdamW's, per group's batch of ZB_BATCH (train_zones_diloco.py's inner optimizer too)


def task() -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic regression task: DATA training samples, then HELD_OUT held out."""
    g = torch.Generator().manual_seed(61)
    x = torch.randn(DATA + HELD_OUT, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(DATA + HELD_OUT, 1, generator=g)
    return x, y


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)  # one initial model on every rank (DDP broadcasts rank 0's anyway)
    return nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, 1))


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hidden = int(os.environ.get("ZB_HIDDEN", "256"))
    batch = int(os.environ.get("ZB_BATCH", "32"))
    samples = int(os.environ.get("ZB_SAMPLES", "4096"))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank, world_size=world, timeout=timedelta(seconds=120))
    x, y = task()
    model = make_model(hidden)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    glob = batch * world
    steps = max(1, samples // glob)
    times = []
    dist.barrier()
    t_start = time.perf_counter()
    for s in range(steps):
        t0 = time.perf_counter()
        lo = (s * glob + rank * batch) % DATA
        idx = torch.arange(lo, lo + batch) % DATA
        loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()  # DDP's all-reduce of the gradients over every group
        opt.step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    wall = time.perf_counter() - t_start
    with torch.no_grad():
        held = nn.functional.mse_loss(model(x[DATA:]), y[DATA:]).item()
    if rank == 0:
        warm = times[2:] if len(times) > 4 else times
        step = statistics.median(warm)
        res = {"world": world, "steps": steps, "samples": steps * glob, "global_batch": glob,
               "params": sum(p.numel() for p in model.parameters()),
               "step_s": step, "samples_per_s": glob / step, "wall_s": wall,
               "loss": held}
        write_result(os.environ["ZB_OUT"], res)
    dist.destroy_process_group()


def write_result(out: str, res: dict) -> None:
    """The run's result as JSON at `out`, whole or not at all (the bench reads it)."""
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
