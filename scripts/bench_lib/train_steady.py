"""The steady-state script of `scripts/bench overhead` (issue 58), written as users write
it, in two forms of one loop:

OVERHEAD_MODE=plain: plain DDP for `torchrun --nproc-per-node=N` (gloo on CPU, NCCL with
CUDA), nothing else: no thread settings (torchrun's own OMP_NUM_THREADS handling stands),
batches made per step on the rank itself. OVERHEAD_MODE=spotctl: the same loop through
spotctl.elastic.Run on either engine, the loss passed to end_step().

Both train an MLP of OVERHEAD_LAYERS (6) layers of width OVERHEAD_WIDTH (2048) with GELU,
cross-entropy over OVERHEAD_CLASSES classes, AdamW, no clipping, global batch
OVERHEAD_GLOBAL_BATCH (256) split over the ranks, for OVERHEAD_STEPS steps. Measurement
only, the same in both forms: the job's first rank appends "unix_time step world samples
cpu_s user_s sys_s pid" after every step to BENCH_STEP_LOG (this process's CPU time, all
its threads; then its user and kernel parts), and every rank writes what it runs with (threads, CPU affinity) once to
BENCH_STEP_LOG.<pid>.json.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

MODE = os.environ.get("OVERHEAD_MODE", "spotctl")
WIDTH = int(os.environ.get("OVERHEAD_WIDTH", "2048"))
LAYERS = int(os.environ.get("OVERHEAD_LAYERS", "6"))
CLASSES = int(os.environ.get("OVERHEAD_CLASSES", "1000"))
GLOBAL_BATCH = int(os.environ.get("OVERHEAD_GLOBAL_BATCH", "256"))
STEPS = int(os.environ.get("OVERHEAD_STEPS", "50"))
LOG = os.environ["BENCH_STEP_LOG"]


def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(n, device):
    return (torch.randn(n, WIDTH, device=device),
            torch.randint(0, CLASSES, (n,), device=device))


def describe():
    info = {"mode": MODE, "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None}
    with open(f"{LOG}.{os.getpid()}.json", "w") as f:
        json.dump(info, f)


def line(step, world, samples):
    t = os.times()
    return (f"{time.time():.4f} {step} {world} {samples} {time.process_time():.4f} "
            f"{t.user:.2f} {t.system:.2f} {os.getpid()}\n")


class Parts:
    """Wall and main-thread CPU seconds of each part of a step, one line per step to
    BENCH_STEP_LOG.<pid>.parts ("step" then name=wall/cpu pairs; "rest" is what ran since
    the previous step's last part: its step log line): the profile."""

    def __init__(self):
        self.f = open(f"{LOG}.{os.getpid()}.parts", "a")
        self.t, self.c, self.parts = time.perf_counter(), time.thread_time(), []

    def mark(self, name):
        t, c = time.perf_counter(), time.thread_time()
        self.parts.append(f"{name}={t - self.t:.5f}/{c - self.c:.5f}")
        self.t, self.c = t, c

    def end(self, step):
        self.f.write(f"{step} {' '.join(self.parts)}\n")
        self.f.flush()
        self.parts = []


def plain():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    describe()
    model, opt = build()
    model = nn.parallel.DistributedDataParallel(model.to(device))
    per = GLOBAL_BATCH // world
    log = open(LOG, "a") if rank == 0 else None
    parts = Parts()
    for step in range(STEPS):
        parts.mark("rest")
        x, y = batch(per, device)
        parts.mark("data")
        loss = nn.functional.cross_entropy(model(x), y)
        parts.mark("forward")
        opt.zero_grad()
        loss.backward()
        parts.mark("backward")
        opt.step()
        parts.mark("optimizer")
        parts.end(step + 1)
        if log:
            log.write(line(step + 1, world, per * world))
            log.flush()
    dist.destroy_process_group()


def elastic_run():
    from spotctl import elastic

    device = elastic.init()
    model, opt = build()
    run = elastic.Run(model, opt, dataset_size=GLOBAL_BATCH * STEPS,
                      global_batch=GLOBAL_BATCH, max_steps=STEPS)
    describe()
    log = None
    parts = Parts()
    while True:
        parts.mark("rest")
        if not run.next_step():
            break
        parts.mark("next_step")
        x, y = batch(len(run.batch_indices()), device)
        parts.mark("data")
        loss = nn.functional.cross_entropy(run.model(x), y)
        parts.mark("forward")
        opt.zero_grad()
        loss.backward()
        parts.mark("backward")
        opt.step()
        parts.mark("optimizer")
        run.end_step(loss.item())
        parts.mark("end_step")
        parts.end(run.step)
        # the job's first rank, asked every step: on torchft it is known once the first
        # quorum is, and moves to another replica when a quorum forms without it
        if run.is_main:
            log = log or open(LOG, "a")
            log.write(line(run.step, run.dp_world, run.step_samples))
            log.flush()
    run.finish()


if __name__ == "__main__":
    plain() if MODE == "plain" else elastic_run()
