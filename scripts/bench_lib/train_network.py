"""All-reduce bus bandwidth between the ranks of one torch.distributed job (nccl-tests
style): for each message size, the mean time of NETBENCH_ITERS all-reduces after two
warm-up ones, the slowest rank's time, algbw = bytes / time and busbw = algbw * 2(n-1)/n
(what each rank's link carries in a ring all-reduce). The job's own backend: NCCL on
CUDA, gloo otherwise. Rank 0 writes the results (JSON) to NETBENCH_OUT.

Runs under plain torchrun or as a spotctl cluster's training script (engine torchrun,
whose world spans the nodes)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    sizes = [int(s) for s in os.environ.get("NETBENCH_SIZES", "1048576,16777216").split(",")]
    iters = max(1, int(os.environ.get("NETBENCH_ITERS", "5")))
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
        for _ in range(2):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time
        secs = float(took.item())
        algbw = t.numel() * 4 / secs / 1e9
        rows.append({"bytes": t.numel() * 4, "seconds": secs, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (world - 1) / world})
    if rank == 0:
        out = os.environ["NETBENCH_OUT"]
        tmp = f"{out}.tmp"
        with open(tmp, "w") as f:
            json.dump({"world": world, "backend": dist.get_backend(), "iters": iters,
                       "rows": rows}, f)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
