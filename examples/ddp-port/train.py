"""The same training script, ported to spotctl.elastic.

    torchrun --nproc-per-node 2 train.py       # or: spotctl up, with train.script = this file

A small MLP learns a noisy function of its inputs. spotctl.elastic forms the group,
wraps the model in DDP, splits a fixed global batch over the ranks in an exact per-epoch
order, checkpoints everything (model, AdamW, LR schedule, RNG, data position) and resumes
at any world size. AdamW, the schedule, clipping and the logged loss are unchanged.
"""

import math
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from spotctl import elastic

# STEPS, else `spotctl up --max-steps N` ([train] max_steps), else 40
STEPS = int(os.environ.get("STEPS") or os.environ.get("SPOTCTL_MAX_STEPS") or 0) or 40
GLOBAL_BATCH = 32  # per step, whatever the world size
LR = 1e-2
WARMUP = 5
SEED = 0


def make_dataset():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(2048, 16, generator=g)
    w = torch.randn(16, 1, generator=g) / 4
    y = torch.tanh(x @ w) + 0.05 * torch.randn(2048, 1, generator=g)
    return TensorDataset(x, y)


def build():
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def lr_at(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / STEPS)))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def main():
    device = elastic.init()  # this rank's GPU, or the CPU
    model, opt, sched = build()
    ds = make_dataset()
    run = elastic.Run(model, opt, dataset_size=len(ds), global_batch=GLOBAL_BATCH, seed=SEED,
                      max_steps=STEPS, schedulers=[sched])
    loader = iter(run.dataloader(ds))
    while run.next_step():
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for x, y in run.micro_batches(loader):
            x, y = x.to(device), y.to(device)
            loss_sum = F.mse_loss(run.model(x), y, reduction="sum")
            (loss_sum * run.loss_scale).backward()
            total += loss_sum.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = run.all_reduce(total, "sum").item() / run.step_samples
        run.end_step(loss=loss)
        if run.is_main:
            print(f"step {run.step} loss {loss:.5f} grad_norm {grad_norm:.4f} "
                  f"world {run.dp_world}", flush=True)
    run.finish()


if __name__ == "__main__":
    main()
