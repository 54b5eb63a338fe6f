"""Example elastic training script for spotctl (written by `spotctl init`).

A small MLP learns a fixed random linear map on synthetic data with DDP over gloo (CPU).
It survives preemptions: spotctl.elastic checkpoints, drains and resumes it at any world
size without losing a step. Run it through `spotctl up`, not directly.
"""

import os
import time

import torch
from torch import nn

from spotctl import elastic

DATASET_SIZE = int(os.environ.get("TRAIN_DATASET_SIZE", "8192"))
GLOBAL_BATCH = int(os.environ.get("TRAIN_GLOBAL_BATCH", "32"))
DIM = int(os.environ.get("TRAIN_DIM", "32"))
STEP_SLEEP_S = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0.05"))  # stands in for GPU work
SEED = 0


def make_data():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(DATASET_SIZE, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(DATASET_SIZE, 1, generator=g)
    return x, y


def main():
    torch.manual_seed(SEED)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = elastic.Run(model, opt, dataset_size=DATASET_SIZE, global_batch=GLOBAL_BATCH, seed=SEED)
    trace_dir = os.environ.get("SPOTCTL_TRACE_SAMPLES")
    trace = open(os.path.join(trace_dir, f"{run.incarnation}-r{run.rank}.txt"), "a") if trace_dir else None
    while run.next_step():
        idx = run.batch_indices()
        loss_sum = nn.functional.mse_loss(run.model(x[idx]), y[idx], reduction="sum")
        opt.zero_grad()
        (loss_sum * run.loss_scale).backward()
        opt.step()
        if STEP_SLEEP_S:
            time.sleep(STEP_SLEEP_S)
        if trace:
            trace.write(f"{run.step + 1} {run.epoch} {' '.join(map(str, idx.tolist()))}\n")
            trace.flush()
        run.end_step(loss=loss_sum.item() / max(1, len(idx)))
        if run.rank == 0 and run.step % 50 == 0:
            print(f"step {run.step} loss {run.loss:.5f} world {run.world}", flush=True)
    run.finish()


if __name__ == "__main__":
    main()
