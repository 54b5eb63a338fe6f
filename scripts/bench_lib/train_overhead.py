"""Steady-state training script of the overhead benchmark, in two forms of one loop.

OVERHEAD_MODE=plain: what a user writes for plain DDP under torchrun (gloo or NCCL),
no spotctl. OVERHEAD_MODE=spotctl: the same loop through spotctl.elastic (either engine).
Both train the same compute-bound MLP (OVERHEAD_LAYERS layers of width OVERHEAD_WIDTH,
AdamW, gradient clipping, the global loss reduced across ranks for logging) on the same
global batch, for OVERHEAD_STEPS steps, nothing failing. The first rank appends
"unix_time step world samples" after every step to BENCH_STEP_LOG; the benchmark takes the gaps.
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

MODE = os.environ.get("OVERHEAD_MODE", "spotctl")
WIDTH = int(os.environ.get("OVERHEAD_WIDTH", "2048"))
LAYERS = int(os.environ.get("OVERHEAD_LAYERS", "6"))
GLOBAL_BATCH = int(os.environ.get("OVERHEAD_GLOBAL_BATCH", "256"))
STEPS = int(os.environ.get("OVERHEAD_STEPS", "50"))
DATASET_SIZE = 4 * GLOBAL_BATCH
LOG = os.environ["BENCH_STEP_LOG"]
SEED = 0


def build():
    torch.manual_seed(SEED)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(DATASET_SIZE, WIDTH, generator=g)
    y = torch.randn(DATASET_SIZE, 1, generator=g)
    return model, opt, x, y


def threads(ranks_here):
    n = int(os.environ.get("OVERHEAD_THREADS", "0")) or max(1, (os.cpu_count() or 1) // ranks_here)
    torch.set_num_threads(n)


def plain():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" \
        else torch.device("cpu")
    model, opt, x, y = build()
    model = nn.parallel.DistributedDataParallel(model.to(device))
    per = GLOBAL_BATCH // world
    log = open(LOG, "a") if rank == 0 else None
    for step in range(STEPS):
        off = (step * GLOBAL_BATCH + rank * per) % (DATASET_SIZE - per)
        xb, yb = x[off:off + per].to(device), y[off:off + per].to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        total.item()
        if log:
            log.write(f"{time.time():.4f} {step + 1} {world} {per * world}\n")
            log.flush()
    dist.barrier()  # gloo aborts a rank torn down while the other is in its last all_reduce
    dist.destroy_process_group()


def elastic_run():
    from spotctl import elastic

    device = elastic.init()
    threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    model, opt, x, y = build()
    run = elastic.Run(model, opt, dataset_size=DATASET_SIZE, global_batch=GLOBAL_BATCH,
                      seed=SEED, max_steps=STEPS)
    log = None
    while run.next_step():
        idx = run.batch_indices()
        opt.zero_grad()
        loss_sum = nn.functional.mse_loss(run.model(x[idx].to(device)), y[idx].to(device),
                                          reduction="sum")
        (loss_sum * run.loss_scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.all_reduce(loss_sum.detach(), "sum").item()
        run.end_step()
        if log is None and run.is_main:  # (on torchft known once the first quorum is)
            log = open(LOG, "a")
        if log:
            log.write(f"{time.time():.4f} {run.step} {run.dp_world} {run.step_samples}\n")
            log.flush()
    run.finish()


if __name__ == "__main__":
    plain() if MODE == "plain" else elastic_run()
