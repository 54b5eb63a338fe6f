"""A real multi-process training run for spotctl.elastic tests: gloo groups started with
torch.multiprocessing (a forkserver that preloads torch), a drain requested at a chosen step ends an incarnation the
way the agent's stop would, and rank 0 records the global loss of every step."""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from spotctl import elastic

DIM = 6


class Drained(Exception):
    pass


class _TestRun(elastic.Run):
    def _after_drain(self) -> None:  # the agent would SIGTERM us here
        raise Drained


def worker_store(world: int) -> dist.TCPStore:
    """The workers' rendezvous store, hosted by the parent on a port the kernel picked and
    that stays bound: no port chosen first and bound later by a child (which an outgoing
    connection elsewhere can take in between). Keep it referenced until the workers end."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


@contextmanager
def single_rank_group() -> Iterator[Any]:
    """A one-process gloo job in this process (no store to host), and a second gloo group
    of it (the Checkpointer's); destroyed when the block ends."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def init_worker(rank: int, world: int, port: int) -> None:
    """A spawned worker joins the parent's store (`worker_store`) as a client: gloo group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


# Workers are forked from a forkserver that imported torch once (per pytest process)
# instead of each importing it anew (~2 CPU-s a worker, ~40 workers in the slow set).
# Only torch is preloaded: spotctl's modules read SPOTCTL_* settings at import, which a
# test may set, so they are imported in each worker after its environment is in place.
_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.multiprocessing"]
_preloaded = False


def _with_env(rank: int, worker: Callable[..., None], env: dict[str, str], *args: Any) -> None:
    """The worker's environment is the parent's at `spawn`, not the forkserver's (which was
    the parent's when the first worker of this pytest process was forked)."""
    os.environ.clear()
    os.environ.update(env)
    worker(rank, *args)


def spawn(worker: Callable[..., None], world: int, *args: Any) -> None:
    """Run `worker(rank, world, port, *args)` in `world` new processes over one store."""
    global _preloaded
    if not _preloaded:
        mp.set_forkserver_preload(_PRELOAD)
        _preloaded = True
    store = worker_store(world)
    try:
        mp.start_processes(_with_env, args=(worker, dict(os.environ), world, store.port, *args),
                           nprocs=world, join=True, start_method="forkserver")
    finally:
        del store


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def make_sched(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


USER_CLIP = 0.5  # cfg["user"]: every step's gradient norm is above it


def make_scaler(cfg: dict[str, Any]) -> Any:
    """cfg["user"]: a GradScaler, as mixed-precision scripts use (its scale grows every 3
    steps here, so a step applied twice or not at all would show in it)."""
    if not cfg.get("user"):
        return None
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)


def user_step(opt: torch.optim.Optimizer, params: Any, scaler: Any) -> float | None:
    """What scripts do between backward() and step(): unscale, clip, log the norm."""
    if scaler is None:
        opt.step()
        return None
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, USER_CLIP)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the shards
        norm = norm.full_tensor()
    scaler.step(opt)
    scaler.update()
    return float(norm)


def plain_run(cfg: dict[str, Any]) -> tuple[list[float], list[float | None]]:
    """The reference: one process, no spotctl, same data order, AdamW + scheduler (and with
    cfg["user"], a GradScaler and clipping). Returns each step's loss and gradient norm."""
    x, y = data(cfg["n"])
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = make_sched(opt)
    scaler = make_scaler(cfg)
    out, norms, epoch, offset = [], [], 0, 0
    for _ in range(cfg["steps"]):
        perm = elastic.epoch_permutation(cfg["n"], cfg["seed"], epoch)
        cnt = min(cfg["batch"], cfg["n"] - offset)
        idx = perm[offset : offset + cnt]
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        norms.append(user_step(opt, model.parameters(), scaler))
        sched.step()
        out.append(loss.item())
        offset += cnt
        if offset >= cfg["n"]:
            epoch, offset = epoch + 1, 0
    return out, norms


def plain_losses(cfg: dict[str, Any]) -> list[float]:
    return plain_run(cfg)[0]


def _make_run(model: nn.Module, opt: Any, sched: Any, counter: Counter, mesh: Any,
              cfg: dict[str, Any], scaler: Any = None) -> _TestRun:
    return _TestRun(model, opt, dataset_size=cfg["n"], global_batch=cfg["batch"],
                   seed=cfg["seed"], max_steps=cfg["steps"], checkpoint_every=cfg["every"],
                   checkpoint_dir=cfg["root"], keep_last=3, micro_batch=cfg.get("micro"),
                   mesh=mesh, dp_dim="dp" if mesh is not None else None, schedulers=[sched],
                   state={"counter": counter}, scaler=scaler)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    init_worker(rank, world, port)
    model = make_model()
    mesh = None
    if cfg.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + rank)  # a different RNG stream per rank, to be carried
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = make_sched(opt)
    counter = Counter()
    x, y = data(cfg["n"])
    try:
        scaler = make_scaler(cfg)
        run = _make_run(model, opt, sched, counter, mesh, cfg, scaler)
    except elastic.ResumeMismatch as e:
        dist.destroy_process_group()
        Path(f"{cfg['out']}.r{rank}").write_text(json.dumps({"end": f"mismatch: {e}"}))
        _leave()  # the same SIGABRT at the interpreter's teardown was seen here once
    out = Path(cfg["out"])
    rec: dict[str, Any] = {"resume": run.resume_step, "counter": counter.n,
                           "lr": opt.param_groups[0]["lr"], "losses": {}, "rand": {},
                           "norms": {}}
    loader = None
    if cfg.get("loader"):
        from torch.utils.data import TensorDataset

        loader = iter(run.dataloader(TensorDataset(x, y), num_workers=cfg["loader"]))
    try:
        while True:
            if rank == cfg.get("drain_rank", 0) and run.step == cfg.get("drain_at"):
                run.drain_requested = True
            if not run.next_step():
                break
            total = torch.zeros(1)
            opt.zero_grad()
            sizes = rec.setdefault("micro", {})[run.step + 1] = []
            for mb in run.micro_batches(loader):
                xb, yb = (x[mb], y[mb]) if loader is None else mb
                sizes.append(len(xb))
                loss_sum = nn.functional.mse_loss(model(xb) if mesh is not None
                                                  else run.model(xb), yb, reduction="sum")
                scaled = loss_sum * run.loss_scale
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss_sum.detach()
            norm = user_step(opt, model.parameters(), scaler)
            sched.step()
            counter.n += 1
            rec["rand"][run.step + 1] = torch.rand(1).item()
            rec["norms"][run.step + 1] = norm
            # the step's global loss through the Run's own reduction (for metrics)
            rec["losses"][run.step + 1] = run.all_reduce(total, "sum").item() / run.step_samples
            rec.setdefault("main", {})[run.step + 1] = run.is_main
            run.end_step(loss=total.item())
        run.finish()
        rec["end"] = "finished"
    except Drained:
        rec["end"] = f"drained@{run.drain_step}"
        run.ckpt.close()
        dist.destroy_process_group()
    Path(f"{out}.r{rank}").write_text(json.dumps(rec))
    # Done: the record is all the parent reads. Leave without the interpreter's teardown:
    # once in ~8 fresh-clone CI runs a worker died there of SIGABRT ("terminate called
    # without an active exception", a C++ thread torn down at exit) after its work was
    # written, and spawn() failed the test for it. Not reproduced in 10 runs of the test
    # alone; the cause is not known (the process groups are destroyed by then).
    del loader  # a DataLoader's workers are shut down here, not left to the teardown
    _leave()


def _leave() -> None:
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    spawn(_worker, world, cfg)
    return [json.loads(Path(f"{cfg['out']}.r{r}").read_text()) for r in range(world)]
