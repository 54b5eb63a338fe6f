"""Bare torchft, its own example loop (torchft's train_ddp shape): OptimizerWrapper, async
quorum, gradients averaged with Manager.allreduce (torchft 0.2.0's DDP wrapper asserts in
its comm hook when a peer is SIGKILLed mid-allreduce, crashing the survivor), each replica
draws its own batch (the global batch grows and shrinks with membership), no notice path. The baseline of the torchft rows in
scripts/bench; logs committed steps like tests/elastic/ft_train.py. FT_LOG_ATTEMPTS=1 (the
churn benchmark): failed attempts too ("ok": false), and a "start" line when the process is
up, as train_churn.py logs them; every line carries the quorum id ("q") and this replica's
samples."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

DIM, N, BATCH = 6, 512, 16


def main() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)

    def state_dict() -> dict:
        return {"model": m.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        m.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    gate = os.environ.get("FT_JOIN_GATE")
    while gate and not os.path.exists(gate):  # a pre-started joiner waits here, imports done
        time.sleep(0.01)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=os.environ.get("SPOTCTL_FT_REPLICA_ID"), timeout=timedelta(seconds=10),
        hostname="127.0.0.1",
    )
    model = m
    opt = OptimizerWrapper(manager, inner)
    max_steps = int(os.environ.get("SPOTCTL_MAX_STEPS", "0")) or 1 << 60
    delay = float(os.environ.get("FT_STEP_DELAY", "0.02"))
    out = open(os.environ["FT_STEP_LOG"], "a", buffering=1)
    attempts = os.environ.get("FT_LOG_ATTEMPTS") == "1"
    if attempts:
        out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "start": True,
                              "step": manager.current_step()}) + "\n")
    rng = torch.Generator().manual_seed(os.getpid())
    while manager.current_step() < max_steps:
        before = manager.current_step()
        idx = torch.randint(0, N, (BATCH,), generator=rng)
        opt.zero_grad()  # starts the quorum (async, overlapping the forward pass)
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        loss.backward()
        for w in [manager.allreduce(p.grad) for p in m.parameters() if p.grad is not None]:
            w.wait()
        opt.step()  # commit vote
        ok = manager.current_step() == before + 1
        if ok or attempts:
            out.write(json.dumps({"t": time.time(), "step": before + 1, "ok": ok,
                                  "q": str(manager._quorum_id), "samples": BATCH,
                                  "replicas": manager.num_participants(), "pid": os.getpid(),
                                  "idx": [], "full_loss": float("nan"), "lr": 0.01}) + "\n")
        if delay:
            time.sleep(delay)


if __name__ == "__main__":
    main()
