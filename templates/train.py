"""Example elastic training script for spotctl (written by `spotctl init`).

A small GPT-style language model (causal self-attention, pre-norm blocks) learns
sequences drawn from a fixed random bigram table. The same file runs on CPU (gloo) and
on NVIDIA GPUs (NCCL, bf16 autocast; torch.compile with TRAIN_COMPILE=1). spotctl.elastic
checkpoints it (model, AdamW, LR schedule, RNG, data position), drains and resumes it at
any world size without losing a step. Run it through `spotctl up`, not directly.

Sizes come from the environment (defaults fit CI): TRAIN_DATASET_SIZE sequences of
TRAIN_SEQ_LEN tokens, TRAIN_GLOBAL_BATCH sequences per step (fixed at any world size),
TRAIN_MICRO_BATCH (at most this many per forward on a rank; 0 = the whole share).
TRAIN_CLIP: the gradient norm is clipped to it (0 = no clipping). On either engine the
gradients are the mean over the whole global batch by the time backward() returns, so
clipping (or a GradScaler, or a logged norm) sees what it would in plain training.
"""

import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

from spotctl import elastic

DATASET_SIZE = int(os.environ.get("TRAIN_DATASET_SIZE", "8192"))
GLOBAL_BATCH = int(os.environ.get("TRAIN_GLOBAL_BATCH", "32"))
# a number, or "auto" (each rank's share at the cluster's largest size; the default on CUDA)
_MB = os.environ.get("TRAIN_MICRO_BATCH", "")
MICRO_BATCH = "auto" if _MB == "auto" else (int(_MB or 0) or None)
SEQ_LEN = int(os.environ.get("TRAIN_SEQ_LEN", "16"))
VOCAB = int(os.environ.get("TRAIN_VOCAB", "32"))
DIM = int(os.environ.get("TRAIN_DIM", "32"))
LAYERS = int(os.environ.get("TRAIN_LAYERS", "2"))
HEADS = int(os.environ.get("TRAIN_HEADS", "2"))
LR = float(os.environ.get("TRAIN_LR", "3e-3"))
WARMUP = int(os.environ.get("TRAIN_WARMUP_STEPS", "20"))
OPTIM = os.environ.get("TRAIN_OPTIM", "adamw")  # adamw | sgd
COMPILE = os.environ.get("TRAIN_COMPILE", "0") == "1"
STEP_SLEEP_S = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0.05"))  # stands in for GPU work
CLIP = float(os.environ.get("TRAIN_CLIP", "1.0"))
SEED = 0


def make_data():
    """(inputs, targets): DATASET_SIZE sequences from a fixed random bigram table."""
    g = torch.Generator().manual_seed(SEED)
    table = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
    seq = torch.empty(DATASET_SIZE, SEQ_LEN + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(VOCAB, (DATASET_SIZE,), generator=g)
    for t in range(SEQ_LEN):
        seq[:, t + 1] = torch.multinomial(table[seq[:, t]], 1, generator=g).squeeze(1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, DIM))
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build():
    """(model, optimizer, scheduler): AdamW (or SGD) with linear warmup then cosine decay."""
    torch.manual_seed(SEED)
    model = GPT()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if OPTIM == "sgd":
        opt = torch.optim.SGD(groups, lr=LR * 10, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    horizon = max(1, int(os.environ.get("SPOTCTL_MAX_STEPS", "0")) or 10_000)

    def lr_at(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon)))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def loss_sum(model, x, y):
    """Sum over sequences of the mean token cross-entropy (times run.loss_scale, the
    gradient is the mean over the global batch)."""
    logits = model(x)
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
    return per_token / SEQ_LEN


def main():
    device = elastic.init()  # set_device(LOCAL_RANK) + NCCL/gloo group before anything else
    x, y = make_data()
    model, opt, sched = build()
    run = elastic.Run(model, opt, dataset_size=DATASET_SIZE, global_batch=GLOBAL_BATCH,
                      seed=SEED, micro_batch=MICRO_BATCH, schedulers=[sched])
    fwd = torch.compile(run.model) if COMPILE else run.model
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else torch.autocast("cpu", enabled=False))
    trace_dir = os.environ.get("SPOTCTL_TRACE_SAMPLES")
    # the sample trace (tests): one file per process, since on torchft a process outlives
    # its worker group; each line names the group and this rank's share of the batch
    trace = open(os.path.join(trace_dir, f"{os.getpid()}.txt"), "a") if trace_dir else None
    while run.next_step():
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for idx in run.micro_batches():
            with amp:
                ls = loss_sum(fwd, x[idx].to(device), y[idx].to(device))
            (ls * run.loss_scale).backward()
            total += ls.detach()
        if CLIP:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        if STEP_SLEEP_S:
            time.sleep(STEP_SLEEP_S)
        if trace:
            idx = run.batch_indices()
            trace.write(f"{run.incarnation} {run.dp_rank} {run.step + 1} {run.epoch} "
                        f"{' '.join(map(str, idx.tolist()))}\n")
            trace.flush()
        # the step's mean loss over the whole global batch (every rank's share): one small
        # reduction and one sync a step
        loss = run.all_reduce(total, "sum").item() / run.step_samples
        run.end_step(loss=loss)
        if run.is_main and run.step % 50 == 0:  # one process of the whole job
            print(f"step {run.step} loss {loss:.5f} world {run.dp_world}", flush=True)
    run.finish()


if __name__ == "__main__":
    main()
