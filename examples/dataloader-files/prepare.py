"""Write the example's data set to disk: SHARDS files of samples plus an index.

    python prepare.py data/        # train.py does this itself when data/ has no index

Each shard is a torch.save file {"x": float32 [n, FEATURES], "y": int64 [n]}; index.json
lists the shards and their sizes (they differ, as real shards do). The data is the same on
every machine that runs this (a fixed seed), so each node may write its own copy.
"""

import json
import os
import sys
from pathlib import Path

import torch

FEATURES = 16
CLASSES = 4
SHARD_SIZES = [72, 64, 56, 64]  # 256 samples
SEED = 0


def write_shards(root, sizes=SHARD_SIZES):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(SEED)
    centers = 2 * torch.randn(CLASSES, FEATURES, generator=g)
    shards = []
    for i, n in enumerate(sizes):
        y = torch.randint(CLASSES, (n,), generator=g)
        x = centers[y] + torch.randn(n, FEATURES, generator=g)
        name = f"shard-{i:05d}.pt"
        tmp = root / f".{name}.{os.getpid()}"
        torch.save({"x": x, "y": y}, tmp)
        os.replace(tmp, root / name)
        shards.append({"file": name, "samples": n})
    tmp = root / f".index.json.{os.getpid()}"
    tmp.write_text(json.dumps({"shards": shards}, indent=1))
    os.replace(tmp, root / "index.json")  # last: a folder with an index is complete


if __name__ == "__main__":
    write_shards(sys.argv[1] if len(sys.argv) > 1 else "data")
