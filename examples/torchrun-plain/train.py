"""A training script in the torch elastic style, with no spotctl import.

    torchrun --nproc-per-node 2 train.py

It forms its own process group, trains a small MLP with DDP, saves {"model", "opt",
"step"} every SAVE_EVERY steps (rank 0, written atomically) and resumes from that file
at start, at whatever world size it starts with: the contract of torchrun's elastic
docs. Under spotctl it runs unchanged as one torchrun job across the nodes; a notice or
a rescale restarts it at the new size and it resumes from its own checkpoint.

Optional, still no import: SAVE_ON_NOTICE=1 makes it watch the file spotctl names in
SPOTCTL_NOTICE_FILE and save at the step boundary when one comes (then nothing is redone);
elsewhere that variable is unset and nothing changes.

Environment: STEPS (100000), SAVE_EVERY (10), CKPT_PATH (checkpoint.pt), STEP_SLEEP_S
(0.05: a step long enough to preempt by hand), STEP_LOG (a JSON-lines file rank 0 appends
every step and every resume to; none by default).
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("STEPS", "100000"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
CKPT = os.environ.get("CKPT_PATH", "checkpoint.pt")
STEP_SLEEP_S = float(os.environ.get("STEP_SLEEP_S", "0.05"))
STEP_LOG = os.environ.get("STEP_LOG", "")
BATCH = 16  # per rank
NOTICE_FILE = os.environ.get("SPOTCTL_NOTICE_FILE", "") if os.environ.get("SAVE_ON_NOTICE") == "1" else ""
STARTED = time.time()


def record(**fields):
    print(" ".join(f"{k} {v}" for k, v in fields.items()), flush=True)
    if STEP_LOG:
        with open(STEP_LOG, "a") as f:
            f.write(json.dumps(dict(fields, t=round(time.time(), 3), pid=os.getpid())) + "\n")


def load_checkpoint(model, opt):
    if not os.path.exists(CKPT):
        return 0
    snap = torch.load(CKPT, map_location="cpu", weights_only=True)
    model.load_state_dict(snap["model"])
    opt.load_state_dict(snap["opt"])
    return int(snap["step"])


def save_checkpoint(model, opt, step):
    os.makedirs(os.path.dirname(os.path.abspath(CKPT)), exist_ok=True)
    tmp = f"{CKPT}.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, CKPT)


def noticed():
    """spotctl wrote a notice for this group (a file older than this process is a past
    round's)."""
    try:
        return bool(NOTICE_FILE) and os.path.getmtime(NOTICE_FILE) >= STARTED
    except OSError:
        return False


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.tanh(x.sum(dim=1, keepdim=True) / 4)
    return x, y


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = load_checkpoint(model, opt)  # every rank reads it: DDP starts from the same state
    model = DDP(model)
    if rank == 0:
        record(resumed=step, world=world)
    while step < STEPS:
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            record(step=step, loss=f"{loss.item():.5f}", world=world)
        if step % SAVE_EVERY == 0 and rank == 0:
            save_checkpoint(model.module, opt, step)
        if NOTICE_FILE:
            # every rank stops at the same step: a notice reaches the nodes at different times
            flag = torch.tensor([int(noticed())])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                if rank == 0 and step % SAVE_EVERY:
                    save_checkpoint(model.module, opt, step)
                dist.barrier()
                if rank == 0:
                    record(saved_on_notice=step, world=world)
                while True:  # SIGTERM ends it; torchrun restarts it at the new size
                    time.sleep(1)
        time.sleep(STEP_SLEEP_S)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
