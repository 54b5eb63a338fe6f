"""The fault matrix's training script on the torchft engine: templates/train.py's model,
data and loop (the cluster copies the template next to this file as train.py), plus one
JSON line per step attempt to $CHAOS_STEP_LOG ({node} is the node id), written by local
rank 0 of each replica group:

  {"t", "pid", "start": true, "restored": N}        the process is up (N: checkpoint step)
  {"t", "pid", "step", "ok", "q", "replicas"}        step `step` computed in quorum `q`:
                                                     ok = committed, else to be run again

A notice, a kill or a join shows in these lines as the quorum (`q`, `replicas`) changes;
the fault matrix measures from them (scripts/chaos_lib/ft.py)."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import train as t  # noqa: E402

from spotctl import elastic  # noqa: E402


def main():
    device = elastic.init()
    x, y = t.make_data()
    model, opt, sched = t.build()
    run = elastic.Run(model, opt, dataset_size=t.DATASET_SIZE, global_batch=t.GLOBAL_BATCH,
                      seed=t.SEED, micro_batch=t.MICRO_BATCH, schedulers=[sched])
    out = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and os.environ.get("CHAOS_STEP_LOG"):
        path = os.environ["CHAOS_STEP_LOG"].replace("{node}",
                                                    os.environ.get("SPOTCTL_NODE_ID", "x"))
        out = open(path, "a", buffering=1)
        out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "start": True,
                              "restored": int(run.resume_step or 0)}) + "\n")
    while run.next_step():
        before = run.step
        q = getattr(run, "incarnation", "")
        replicas = getattr(run, "replicas", 1)
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for idx in run.micro_batches():
            ls = t.loss_sum(run.model, x[idx].to(device), y[idx].to(device))
            (ls * run.loss_scale).backward()
            total += ls.detach()
        opt.step()
        sched.step()
        if t.STEP_SLEEP_S:
            time.sleep(t.STEP_SLEEP_S)
        run.end_step(loss=total.item() / max(1, len(run.batch_indices())))
        if out is not None:
            out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "step": before + 1,
                                  "ok": run.step == before + 1, "q": q,
                                  "replicas": replicas}) + "\n")
    run.finish()


if __name__ == "__main__":
    main()
