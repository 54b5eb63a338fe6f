"""Training script for tests/elastic/test_reduce_dtype.py: one weight, two samples whose
gradients (1 + 2^-10 and 1 + 2^-9) differ only below bfloat16's precision. Each data-parallel
rank (or replica) takes one sample per step; the reduced gradient is their mean: exactly
1 + 3 * 2^-11 when reduced in fp32, exactly 1.0 when each was rounded to bfloat16 first.
RD_DTYPE=bf16 passes reduce_dtype=torch.bfloat16. Logs each committed step's gradient, as
the optimizer sees it, to $RD_LOG (worker k > 0: $RD_LOG.k)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from spotctl import elastic


def main() -> None:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dtype = torch.bfloat16 if os.environ.get("RD_DTYPE") == "bf16" else None
    run = elastic.Run(model, opt, dataset_size=2, global_batch=2, seed=0,
                      reduce_dtype=dtype)
    x = torch.tensor([[1 + 2.0**-10], [1 + 2.0**-9]])
    log = os.environ["RD_LOG"]
    if int(os.environ.get("LOCAL_RANK", "0")):
        log += "." + os.environ["LOCAL_RANK"]
    with open(log, "a", buffering=1) as out:
        while run.next_step():
            opt.zero_grad()
            for mb in run.micro_batches():
                (run.model(x[mb]).sum() * run.loss_scale).backward()
            grad = float(model.weight.grad.item())  # type: ignore[union-attr]
            opt.step()
            run.end_step()
            out.write(json.dumps({"step": run.step, "grad": grad,
                                  "ranks": getattr(run, "replicas", 1) * run.world}) + "\n")
    run.finish()


if __name__ == "__main__":
    main()
