"""Training script for the torchft-engine tests and bench: written against spotctl.elastic
only (the engine comes from SPOTCTL_ENGINE). Logs one JSON line per committed step to
$FT_STEP_LOG (worker k > 0 of a replica group to $FT_STEP_LOG.k): time, step, this replica's samples, the quorum's size, and the model's loss
over the whole dataset after the step (equal on every replica, and to an uninterrupted
run's, if no step was lost, repeated or half-applied). FT_FSDP=1: the model is FSDP2
`fully_shard` over the replica group's workers (HSDP with torchft across the groups).
FT_MICRO_BATCH: micro-batches of at most that many samples; FT_LOADER=k: the batches come
from run.dataloader() with k DataLoader workers (the dataset yields each sample's index).
FT_USER=1: what training scripts do between backward() and step(): a GradScaler (scale,
unscale_, step, update), gradient clipping to FT_CLIP (default 0.05, so it always clips),
the gradient norm logged, and the step's global mean loss from run.all_reduce; each is
logged ("norm", "scale", "gloss") to compare with an uninterrupted one-process run.
FT_OPT=sgd: SGD with momentum instead of AdamW. FT_FREEZE=<node>:k: that node's worker
stops itself (SIGSTOP) at the start of step k, inside its quorum. FT_DIE_GATE=<file>: once
the file exists, the worker's next step dies right after its commit vote (FT_USER=1), before
its metric all_reduce: SIGKILL of its torchrun agent and of itself, as a VM that vanishes
there. Every record has the model's parameters' digest and the outer step (diloco/localsgd:
SPOTCTL_SYNC); a sync nobody applied is a record {"rewound": k, "step": the round's start}.
FT_NOTICE_GATE=<file> (diloco/localsgd): once the file exists, the worker gives itself the
agent's notice (SIGUSR1) at the start of the next step that is its round's second.
After finish(), <log>.finish records how long it took and the threads still
running."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import torch
from torch import nn

from spotctl import elastic

DIM, N, BATCH = 6, 512, 16


def main() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    torch.manual_seed(int(os.environ.get("FT_INIT_SEED", "0")))
    model = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))
    if os.environ.get("FT_FSDP") == "1":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dev = elastic.init()  # the replica group's own process group
        fully_shard(model, mesh=init_device_mesh(dev.type, (dist.get_world_size(),)))
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
           if os.environ.get("FT_OPT") == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    user = os.environ.get("FT_USER") == "1"
    clip = float(os.environ.get("FT_CLIP", "0.05"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=7) if user else None
    die_gate = os.environ.get("FT_DIE_GATE")
    gate = os.environ.get("FT_JOIN_GATE")
    while gate and not os.path.exists(gate):  # a pre-started joiner waits here, imports done
        time.sleep(0.01)
    run = elastic.Run(model, opt, dataset_size=N, global_batch=BATCH, seed=3,
                      schedulers=[sched], scaler=scaler,
                      micro_batch=int(os.environ.get("FT_MICRO_BATCH", "0")) or None)
    loader = None
    if os.environ.get("FT_LOADER"):
        from torch.utils.data import TensorDataset

        loader = iter(run.dataloader(TensorDataset(x, y, torch.arange(N)),
                                     num_workers=int(os.environ["FT_LOADER"])))
    delay = float(os.environ.get("FT_STEP_DELAY", "0.02"))
    log = os.environ["FT_STEP_LOG"].replace("{node}", os.environ.get("SPOTCTL_NODE_ID", "x"))
    if int(os.environ.get("LOCAL_RANK", "0")):
        log += "." + os.environ["LOCAL_RANK"]
    out = open(log, "a", buffering=1)
    node, _, at = os.environ.get("FT_FREEZE", "").partition(":")
    freeze_at = int(at) if node and node == os.environ.get("SPOTCTL_NODE_ID") else 0
    notice_gate = os.environ.get("FT_NOTICE_GATE")
    every = int(os.environ.get("SPOTCTL_SYNC_EVERY") or 1)
    while run.next_step():
        before = run.step
        if notice_gate and run.step % every == 1 and os.path.exists(notice_gate):
            os.kill(os.getpid(), signal.SIGUSR1)  # mid-round: the step ends, then the notice
            notice_gate = None
        if freeze_at and run.step + 1 == freeze_at:
            # inside this step's quorum, before its collectives: as a VM that vanishes
            # mid-step (no socket closed, no heartbeat sent), until a SIGCONT or SIGKILL
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        idx: list[int] = []
        loss_sum = 0.0
        for mb in run.micro_batches(loader):
            xb, yb, ib = (x[mb], y[mb], mb) if loader is None else mb
            loss = ((run.model(xb) - yb) ** 2).sum()
            scaled = loss * run.loss_scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            loss_sum += loss.item()
            idx += ib.tolist()
        user_log = {}
        if scaler is not None:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the replica's shards
                norm = norm.full_tensor()
            scaler.step(opt)  # the commit vote (the first optimizer.step of the step)
            if die_gate and os.path.exists(die_gate):
                os.kill(os.getppid(), signal.SIGKILL)  # torchrun's agent: no restart
                os.kill(os.getpid(), signal.SIGKILL)
            scaler.update()
            user_log = {"norm": float(norm), "scale": scaler.get_scale(),
                        "gloss": run.all_reduce(loss_sum, "sum") / run.step_samples,
                        "main": run.is_main}
        else:
            opt.step()
        sched.step()
        failed_syncs = getattr(run, "failed_syncs", 0)
        run.end_step(loss=loss_sum)
        if getattr(run, "failed_syncs", 0) != failed_syncs:
            # diloco/localsgd: the round's sync was applied by nobody; back at its start
            out.write(json.dumps({"t": time.time(), "rewound": before + 1, "step": run.step,
                                  "pid": os.getpid(), "dropped": run.dropped_steps}) + "\n")
        elif run.step == before + 1:
            with torch.no_grad():
                full = float(((model(x) - y) ** 2).mean())
                # the parameters as this worker holds them (after a sync: the synced ones);
                # copied first: numpy() on the parameter's own storage would make it
                # unresizable, and FSDP2 frees an unsharded parameter by resizing it to 0
                digest = hashlib.sha1(b"".join(
                    (p.to_local() if hasattr(p, "to_local") else p).detach()
                    .to("cpu", copy=True).numpy().tobytes()
                    for p in model.parameters())).hexdigest()
            out.write(json.dumps({
                "t": time.time(), "step": run.step, "idx": idx, "full_loss": full,
                "replicas": getattr(run, "replicas", 1), "pid": os.getpid(),
                "quorum_s": getattr(run, "quorum_s", None),
                "lr": sched.get_last_lr()[0], "wrapper": type(run.model).__name__,
                "loaders": getattr(loader, "restarts", None),
                "healed": getattr(run, "healed_in_place", None),
                "outer": getattr(run, "outer_step", None), "digest": digest, **user_log,
            }) + "\n")
        if delay:
            time.sleep(delay)
    t0 = time.time()
    run.finish()
    # what is left running once finish() returns, beside the step log (<log>.finish)
    with open(log + ".finish", "w") as f:
        json.dump({"finish_s": time.time() - t0, "step": run.step,
                   "threads": [t.name for t in threading.enumerate()
                               if t is not threading.main_thread()]}, f)


if __name__ == "__main__":
    main()
