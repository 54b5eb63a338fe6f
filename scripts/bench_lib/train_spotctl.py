"""Benchmark training script for spotctl: templates/train.py plus a step log.

Same model, data and step time as the baseline (train_plain.py). Rank 0 appends
"unix_time step world incarnation" per completed step to $BENCH_STEP_LOG, so the
benchmark can time training pauses; $BENCH_CKPT_EVERY_FILE, when present, sets the
checkpoint interval of each new worker group (the lost-steps benchmark varies it
between rescales without restarting the cluster).
"""

import os
import time

import torch
from torch import nn

from spotctl import elastic

DATASET_SIZE = int(os.environ.get("TRAIN_DATASET_SIZE", "8192"))
GLOBAL_BATCH = int(os.environ.get("TRAIN_GLOBAL_BATCH", "32"))
DIM = int(os.environ.get("TRAIN_DIM", "32"))
STEP_SLEEP_S = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0.05"))
SEED = 0


def checkpoint_every():
    path = os.environ.get("BENCH_CKPT_EVERY_FILE")
    try:
        return int(open(path).read().strip()) if path else None
    except (OSError, ValueError):
        return None


def main():
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(DATASET_SIZE, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(DATASET_SIZE, 1, generator=g)
    model = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = elastic.Run(
        model,
        opt,
        dataset_size=DATASET_SIZE,
        global_batch=GLOBAL_BATCH,
        seed=SEED,
        checkpoint_every=checkpoint_every(),
    )
    log = open(os.environ["BENCH_STEP_LOG"], "a") if run.rank == 0 else None
    if log:
        log.write(f"{time.time():.4f} resume {run.step} {run.world} {run.incarnation}\n")
        log.flush()
    while run.next_step():
        idx = run.batch_indices()
        loss_sum = nn.functional.mse_loss(run.model(x[idx]), y[idx], reduction="sum")
        opt.zero_grad()
        (loss_sum * run.loss_scale).backward()
        opt.step()
        if STEP_SLEEP_S:
            time.sleep(STEP_SLEEP_S)
        run.end_step(loss=loss_sum.item() / max(1, len(idx)))
        if log:
            log.write(f"{time.time():.4f} step {run.step} {run.world} {run.incarnation}\n")
            log.flush()
    run.finish()


if __name__ == "__main__":
    main()
