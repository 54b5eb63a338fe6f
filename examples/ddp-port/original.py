"""A typical PyTorch DDP training script, before the port to spotctl.elastic.

    torchrun --nproc-per-node 2 original.py

A small MLP learns a noisy function of its inputs. What most DDP scripts have:
init_process_group, a DistributedSampler, DDP, AdamW, a warmup + cosine LR schedule,
gradient clipping and a loss reduced across ranks for the log.
"""

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS = int(os.environ.get("STEPS", "40"))
BATCH = 16  # per rank
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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build()
    model = DDP(model)
    ds = make_dataset()
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            metric = loss.detach().clone()
            dist.all_reduce(metric)
            step += 1
            if rank == 0:
                print(f"step {step} loss {metric.item() / world:.5f} grad_norm {grad_norm:.4f} "
                      f"world {world}", flush=True)
            if step == STEPS:
                break
        epoch += 1
    dist.barrier()  # no rank tears gloo down while another is still in its last all_reduce
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
