"""A DataLoader over shard files on disk, through spotctl.elastic.

    torchrun --nproc-per-node 2 train.py       # or: spotctl up, with train.script = this file

The dataset maps a global sample index to (shard file, row) and memory-maps each shard on
first use in every DataLoader worker. run.dataloader() gives the DataLoader its batch
sampler: this rank's share of every step of a fixed global batch, from the run's saved
position on. So after a rescale (a restart at another world size, from the checkpoint)
every sample of the epoch is still trained exactly once. The script counts that: `seen`
(checkpointed with the run) says how often each sample was trained this epoch, and the
main process prints the count at the end of every epoch.
"""

import bisect
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from spotctl import elastic

DATA_DIR = Path(os.environ.get("DATA_DIR", Path(__file__).resolve().parent / "data"))
# STEPS, else `spotctl up --max-steps N` ([train] max_steps), else 24
STEPS = int(os.environ.get("STEPS") or os.environ.get("SPOTCTL_MAX_STEPS") or 0) or 24
LOADER_WORKERS = int(os.environ.get("LOADER_WORKERS", "2"))
GLOBAL_BATCH = 32  # samples per step, whatever the world size
MICRO_BATCH = 8
SEED = 0


class ShardedFiles(Dataset):
    """Samples stored in shard files listed by index.json; item i is (x, y, i)."""

    def __init__(self, root):
        self.root = Path(root)
        shards = json.loads((self.root / "index.json").read_text())["shards"]
        self.files = [s["file"] for s in shards]
        self.starts = [0]
        for s in shards:
            self.starts.append(self.starts[-1] + s["samples"])
        self._open = {}  # per worker process: shard number -> its tensors (memory-mapped)

    def __len__(self):
        return self.starts[-1]

    def __getitem__(self, i):
        k = bisect.bisect_right(self.starts, i) - 1
        if k not in self._open:
            self._open[k] = torch.load(self.root / self.files[k], mmap=True)
        shard, row = self._open[k], i - self.starts[k]
        return shard["x"][row], shard["y"][row], i


class Seen:
    """How many times each sample was trained in the current epoch (checkpointed)."""

    def __init__(self, n):
        self.counts = torch.zeros(n, dtype=torch.int64)

    def state_dict(self):
        return {"counts": self.counts}

    def load_state_dict(self, sd):
        self.counts = sd["counts"].clone()


def main():
    device = elastic.init()  # this rank's GPU, or the CPU
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (DATA_DIR / "index.json").exists():
        from prepare import write_shards  # one copy per node (a node-local folder)

        write_shards(DATA_DIR)
    dist.barrier()
    ds = ShardedFiles(DATA_DIR)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = Seen(len(ds))
    run = elastic.Run(model, opt, dataset_size=len(ds), global_batch=GLOBAL_BATCH, seed=SEED,
                      max_steps=STEPS, micro_batch=MICRO_BATCH, state={"seen": seen})
    loader = iter(run.dataloader(ds, num_workers=LOADER_WORKERS,
                                 persistent_workers=LOADER_WORKERS > 0))
    while run.next_step():
        opt.zero_grad()
        total = torch.zeros((), device=device)
        mine = torch.zeros(len(ds), dtype=torch.int64)  # (on the CPU, as the indices)
        for x, y, i in run.micro_batches(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss_sum = F.cross_entropy(run.model(x), y, reduction="sum")
            (loss_sum * run.loss_scale).backward()
            total += loss_sum.detach()
            mine.index_add_(0, i, torch.ones_like(i))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = run.all_reduce(total, "sum").item() / run.step_samples
        seen.counts += run.all_reduce(mine, "sum")  # a check, not needed for training
        epoch = run.epoch
        run.end_step(loss=loss)
        if run.is_main:
            print(f"step {run.step} loss {loss:.5f} world {run.dp_world}", flush=True)
        if run.epoch != epoch:
            if run.is_main:
                c = seen.counts
                print(f"epoch {epoch}: {int((c == 1).sum())} of {len(c)} samples trained "
                      f"once (min {int(c.min())}, max {int(c.max())})", flush=True)
            seen.counts.zero_()
    run.finish()


if __name__ == "__main__":
    main()
