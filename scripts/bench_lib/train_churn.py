"""The churn benchmark's training script on spotctl's engines (scripts/bench churn): the
model, data and batch of train_torchft_bare.py (its baseline), written against
spotctl.elastic only. Each replica group's local rank 0 appends one JSON line per step
attempt to $CHURN_STEP_LOG ({node} is the node id):

  {"t", "pid", "start": true, "step"}                       the process is up, at `step`
  {"t", "pid", "step", "ok", "q", "replicas", "samples", "quorum_s"}
      step `step` computed in quorum `q` of `replicas` replica groups with `samples` of
      this replica's samples: ok = committed, else to be run again

CHURN_STEP_SLEEP_S paces the step (default 0.1 s): the machine is small and the point is
membership, not compute."""

import json
import os
import time

import torch
from torch import nn

from spotctl import elastic

DIM, N = 6, 512
GLOBAL_BATCH = int(os.environ.get("CHURN_GLOBAL_BATCH", "96"))


def main() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    run = elastic.Run(model, opt, dataset_size=N, global_batch=GLOBAL_BATCH, seed=3)
    delay = float(os.environ.get("CHURN_STEP_SLEEP_S", "0.1"))
    out = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        path = os.environ["CHURN_STEP_LOG"].replace("{node}",
                                                    os.environ.get("SPOTCTL_NODE_ID", "x"))
        out = open(path, "a", buffering=1)
        out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "start": True,
                              "step": run.step}) + "\n")
    while run.next_step():
        before = run.step
        q = getattr(run, "incarnation", "")
        replicas = getattr(run, "replicas", 1)
        idx = run.batch_indices()
        opt.zero_grad()
        loss = ((run.model(x[idx]) - y[idx]) ** 2).sum()
        (loss * run.loss_scale).backward()
        opt.step()
        if delay:
            time.sleep(delay)
        run.end_step(loss=loss.item() / max(1, len(idx)))
        if out is not None:
            out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "step": before + 1,
                                  "ok": run.step == before + 1, "q": q, "replicas": replicas,
                                  "samples": len(idx),
                                  "quorum_s": getattr(run, "quorum_s", None)}) + "\n")
    run.finish()


if __name__ == "__main__":
    main()
