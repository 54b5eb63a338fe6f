"""The zones benchmark's DiLoCo training (scripts/bench zones): the model, task, inner
optimizer and samples of train_zones.py, written against spotctl.elastic.Run alone, as a
user's script is. One torchrun per replica group, each in its network namespace; the
engine and the sync (SPOTCTL_ENGINE=torchft, SPOTCTL_SYNC=diloco, SPOTCTL_SYNC_EVERY,
SPOTCTL_OUTER_LR, SPOTCTL_OUTER_MOMENTUM: the spec's [train] section as the agent passes
it) come from the environment. Each step's global batch is ZB_BATCH per group, as DDP's.

The replica whose ZB_OUT is set writes (JSON) the step time (the mean over every step
after two warm-up steps, the syncs included), samples/s, the syncs it committed and
failed, and the held-out loss of the synced model after the last step (a sync: the
groups' models are then one).

Environment: ZB_HIDDEN, ZB_BATCH, ZB_GROUPS (replica groups), ZB_SAMPLES, ZB_OUT."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from train_zones import DATA, LR, make_model, task, write_result

from spotctl import elastic


def main() -> None:
    hidden = int(os.environ.get("ZB_HIDDEN", "256"))
    batch = int(os.environ.get("ZB_BATCH", "32"))
    groups = int(os.environ.get("ZB_GROUPS", "4"))
    samples = int(os.environ.get("ZB_SAMPLES", "4096"))
    torch.set_num_threads(1)
    x, y = task()
    model = make_model(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    glob = batch * groups
    steps = max(1, samples // glob)
    run = elastic.Run(model, opt, dataset_size=DATA, global_batch=glob, seed=61,
                      max_steps=steps)
    ends: list[float] = []
    sync_s: list[float] = []
    replicas = set()
    while run.next_step():
        idx = run.batch_indices()
        loss = nn.functional.mse_loss(run.model(x[idx]), y[idx], reduction="sum")
        opt.zero_grad()
        (loss * run.loss_scale).backward()
        opt.step()
        outer = run.outer_step
        run.end_step(loss=loss.item() / max(1, len(idx)))
        ends.append(time.perf_counter())
        replicas.add(run.replicas)
        if run.outer_step != outer:
            sync_s.append(run.sync_s)
    out = os.environ.get("ZB_OUT")
    if out and run.rank == 0:
        with torch.no_grad():
            held = nn.functional.mse_loss(model(x[DATA:]), y[DATA:]).item()
        warm = 2 if len(ends) > 4 else 0
        step = (ends[-1] - ends[warm - 1]) / (len(ends) - warm) if warm else (
            ends[-1] - ends[0]) / max(1, len(ends) - 1)
        res = {"world": groups, "steps": run.step, "samples": run.step * glob,
               "global_batch": glob, "params": sum(p.numel() for p in model.parameters()),
               "step_s": step, "samples_per_s": glob / step, "loss": held,
               "syncs": run.outer_step, "failed_syncs": run.failed_syncs,
               "sync_s": sorted(sync_s)[len(sync_s) // 2] if sync_s else None,
               "replicas": sorted(replicas)}
        write_result(out, res)
    run.finish()


if __name__ == "__main__":
    main()
