"""Baseline training script: plain DDP under plain torchrun, no spotctl.

The same model, data and step time as templates/train.py, with what a careful user would
write without spotctl: rank 0 saves a checkpoint every BENCH_CKPT_EVERY steps (torch.save
to a temporary file, then rename) and every worker resumes from it after a restart.
Rank 0 appends "unix_time step world group" per completed step to BENCH_STEP_LOG,
which is how the benchmark times recoveries and counts lost steps.
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

DATASET_SIZE = int(os.environ.get("TRAIN_DATASET_SIZE", "8192"))
GLOBAL_BATCH = int(os.environ.get("TRAIN_GLOBAL_BATCH", "32"))
DIM = int(os.environ.get("TRAIN_DIM", "32"))
STEP_SLEEP_S = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0.05"))
CKPT = os.environ["BENCH_CKPT"]
EVERY = int(os.environ.get("BENCH_CKPT_EVERY", "20"))
if os.environ.get("BENCH_CKPT_EVERY_FILE") and os.path.exists(os.environ["BENCH_CKPT_EVERY_FILE"]):
    # read at every worker start: the lost-steps benchmark varies it between restarts
    EVERY = int(open(os.environ["BENCH_CKPT_EVERY_FILE"]).read().strip())
LOG = os.environ["BENCH_STEP_LOG"]


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET_SIZE, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(DATASET_SIZE, 1, generator=g)
    model = DDP(nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if os.path.exists(CKPT):
        state = torch.load(CKPT, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
    tag = f"pid{os.getpid()}"  # rank 0 is a new process in every worker group
    per_rank = max(1, GLOBAL_BATCH // world)
    log = open(LOG, "a") if rank == 0 else None
    if log:
        log.write(f"{time.time():.4f} resume {step} {world} {tag}\n")
        log.flush()
    while True:
        off = (step * GLOBAL_BATCH + rank * per_rank) % (DATASET_SIZE - per_rank)
        xb, yb = x[off : off + per_rank], y[off : off + per_rank]
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if STEP_SLEEP_S:
            time.sleep(STEP_SLEEP_S)
        step += 1
        if log:
            log.write(f"{time.time():.4f} step {step} {world} {tag}\n")
            log.flush()
            if step % EVERY == 0:
                tmp = CKPT + ".tmp"
                torch.save(
                    {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step},
                    tmp,
                )
                os.replace(tmp, CKPT)


if __name__ == "__main__":
    main()
