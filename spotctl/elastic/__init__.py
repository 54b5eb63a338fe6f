"""spotctl.elastic: what a training script imports to survive preemptions with no lost step.

    from spotctl import elastic
    run = elastic.Run(model, optimizer, dataset_size=len(data), global_batch=64, seed=0)
    while run.next_step():                 # drain consensus, resume, periodic checkpoints
        idx = run.batch_indices()          # this rank's samples for this step
        loss_sum = loss_fn(run.model(x[idx]), y[idx], reduction="sum")
        run.optimizer.zero_grad()
        (loss_sum * run.loss_scale).backward()
        run.optimizer.step()
        run.end_step(loss=loss_sum.item())
    run.finish()

Global-batch policy: the global batch is FIXED (`global_batch` samples per step whatever the
world size); each step's samples are split across ranks, and `loss_scale` makes the DDP
gradient equal to the mean over the global batch. So a step computes the same update at
any world size, and rescaling changes speed, not the training trajectory.

Exact data position: the checkpoint stores (epoch, offset into that epoch's permutation).
Every sample of an epoch is consumed exactly once across any number of rescales: a drain
saves at the same step on every rank, and resumption continues from the saved offset.

Drain consensus: SIGUSR1 (sent by the node agent) sets a local flag; every step one tiny
all_reduce(MAX) makes all ranks see it at the same step S, save S synchronously, commit,
report "drained" to the agent and wait to be stopped (never exit 0 mid-job).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any


def _process_start_time() -> float:
    """Unix time this process started (Linux /proc), for the restart-time breakdown.
    Measured as now minus the process' age (/proc/uptime has 10 ms resolution; the boot
    time in /proc/stat only whole seconds)."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time()


_T_START = _process_start_time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from spotctl.elastic.checkpoint import Checkpointer  # noqa: E402

_T_IMPORTED = time.time()

__all__ = ["Run", "epoch_permutation", "split_batch"]
log = logging.getLogger("spotctl.elastic")
# Short process-group timeout: a vanished peer must not block survivors for 30 minutes.
PG_TIMEOUT_S = float(os.environ.get("SPOTCTL_PG_TIMEOUT_S", "60"))
# Forming the group: a peer that never shows up (it left during the rendezvous) must not
# hold the others for long; they fail, and torchrun re-forms without it.
PG_INIT_TIMEOUT_S = float(os.environ.get("SPOTCTL_PG_INIT_TIMEOUT_S", "30"))
REPORT_EVERY_S = 0.2


def _init_process_group() -> None:
    """gloo over the worker store at MASTER_ADDR:MASTER_PORT. Rank 0 hosts that store on
    a socket bound to MASTER_ADDR only (TCPStore's own listener takes every interface,
    and the store has no authentication)."""
    import socket

    env = os.environ
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    init_timeout = timedelta(seconds=PG_INIT_TIMEOUT_S)
    try:
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = None
    if rank == 0:
        try:
            fam, _, _, _, sa = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(fam, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sa)
            sock.listen(512)
            store = dist.TCPStore(addr, port, world, True, init_timeout, wait_for_workers=False,
                                  master_listen_fd=sock.detach(), use_libuv=True)
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("worker store on %s:%s: %s; using torch's default listener", addr,
                        port, e)
            store = None
    if store is None and rank == 0:
        dist.init_process_group("gloo", timeout=timeout)
        return
    if store is None:
        store = dist.TCPStore(addr, port, world, False, init_timeout, use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def split_batch(count: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous share [start, end) of `count` items for `rank` of `world` (sizes differ
    by at most one)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class Run:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset_size: int,
        global_batch: int,
        seed: int = 0,
        epochs: int = 1_000_000,
        max_steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        keep_last: int | None = None,
    ):
        env = os.environ
        self.drain_requested = False
        signal.signal(signal.SIGUSR1, self._on_drain_signal)
        t_init = time.time()
        if not dist.is_initialized():
            _init_process_group()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
        self.model = DDP(model)
        self.optimizer = optimizer
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.seed = seed
        self.epochs = epochs
        self.max_steps = max_steps if max_steps is not None else int(env.get("SPOTCTL_MAX_STEPS", "0"))
        self.every = checkpoint_every or int(env.get("SPOTCTL_CHECKPOINT_EVERY", "20"))
        root = checkpoint_dir or env.get("SPOTCTL_CHECKPOINT_DIR") or "checkpoints"
        self.ckpt = Checkpointer(Path(root), keep_last or int(env.get("SPOTCTL_KEEP_LAST", "3")),
                                 self.rank, self.ckpt_pg)
        self.status_dir = Path(env["SPOTCTL_STATUS_DIR"]) if env.get("SPOTCTL_STATUS_DIR") else None
        self.incarnation = self._make_incarnation()
        self.step = 0
        self.epoch = 0
        self.offset = 0  # samples of this epoch consumed
        self.phase = "init"
        self.loss: float | None = None
        self.first_step_at: float | None = None
        self._t_last_report = 0.0
        self._rate_t0 = time.time()
        self._rate_samples = 0
        self.throughput: float | None = None
        self.drain_step: int | None = None
        t_restore = time.time()
        self.resume_step = self._restore()
        t_ready = time.time()
        # where a restart's time goes (seconds): interpreter + imports, process group and
        # model setup, checkpoint load; `first_step` is added after the first step
        # a worker forked from the warm zygote starts after the imports: they cost it 0
        t_proc = _process_start_time()
        self.startup = {
            "imports": round(max(0.0, _T_IMPORTED - t_proc), 3),
            "process_group": round(t_restore - t_init, 3),
            "restore": round(t_ready - t_restore, 3),
            "started_at": round(t_proc, 3),
            "forked_warm": t_proc > _T_IMPORTED,
        }
        self._t_ready = t_ready
        self._this_step: tuple[int, int] | None = None
        self.phase = "train"
        self._report(force=True)

    # -- setup
    def _on_drain_signal(self, signum: int, frame: Any) -> None:
        self.drain_requested = True

    def _make_incarnation(self) -> str:
        obj = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        return str(obj[0])

    def _state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def _restore(self) -> int:
        state = self._state()
        meta = self.ckpt.load_latest(state)
        if meta is None:
            return 0
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(meta["step"])
        self.epoch = int(meta["epoch"])
        self.offset = int(meta["offset"])
        if self.rank == 0:
            log.info("resumed at step %d (epoch %d offset %d) with world size %d",
                     self.step, self.epoch, self.offset, self.world)
        return self.step

    def _meta(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "world_size": self.world,
                "incarnation": self.incarnation, "seed": self.seed}

    # -- per step
    @property
    def step_samples(self) -> int:
        return min(self.global_batch, self.dataset_size - self.offset)

    @property
    def loss_scale(self) -> float:
        """Multiply a sum-reduced per-rank loss by this: DDP's gradient average over ranks
        then equals the mean over the global batch, whatever the world size."""
        return self.world / self.step_samples

    def batch_indices(self) -> torch.Tensor:
        """This rank's dataset indices for the current step."""
        perm = epoch_permutation(self.dataset_size, self.seed, self.epoch)
        n = self.step_samples
        a, b = split_batch(n, self.world, self.rank)
        return perm[self.offset + a : self.offset + b]

    def next_step(self) -> bool:
        """Agree on draining (one tiny collective), then say whether to run a step."""
        self.ckpt.poll()
        flag = torch.tensor([1 if self.drain_requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            self._drain()
        if self.max_steps and self.step >= self.max_steps:
            return False
        if self.epoch >= self.epochs:
            return False
        return True

    def end_step(self, loss: float | None = None) -> None:
        n = self.step_samples
        self.step += 1
        self.offset += n
        self._rate_samples += n
        if self.offset >= self.dataset_size:
            self.epoch += 1
            self.offset = 0
        self.loss = loss if loss is None or loss == loss else None  # NaN is not JSON
        if self.first_step_at is None:
            self.first_step_at = time.time()
            self.startup["first_step"] = round(self.first_step_at - self._t_ready, 3)
            if self.rank == 0:
                log.info("restart breakdown: %s", self.startup)
            self._report(force=True)
        if self.step % self.every == 0:
            self.ckpt.save_async(self.step, self._state(), self._meta())
        self._report()

    def _drain(self) -> None:
        self.phase = "draining"
        self._report(force=True)
        S = self.step
        ok = self.ckpt.save_sync(S, self._state(), self._meta())
        self.drain_step = S
        self.phase = "drained" if ok else "drain-failed"
        self._report(force=True)
        if self.rank == 0:
            log.info("drained at step %d (committed=%s); waiting to be stopped", S, ok)
        # Never exit 0 mid-job: the agent stops us (SIGTERM) once it is safe to re-form.
        while True:
            time.sleep(0.05)

    def finish(self) -> None:
        """End of training: final save, then exit 0 on every rank together."""
        self.ckpt.wait_pending()
        if self.ckpt.last_committed < self.step:
            self.ckpt.save_sync(self.step, self._state(), self._meta())
        self.phase = "done"
        self._report(force=True)
        dist.barrier()
        dist.destroy_process_group()

    # -- reporting to the agent
    def _report(self, force: bool = False) -> None:
        if self.status_dir is None:
            return
        now = time.time()
        if not force and now - self._t_last_report < REPORT_EVERY_S:
            return
        dt = now - self._rate_t0
        if dt >= 1.0:
            self.throughput = self._rate_samples / dt
            self._rate_t0, self._rate_samples = now, 0
        self._t_last_report = now
        rep = {
            "rank": self.rank, "local_rank": self.local_rank, "world_size": self.world,
            "step": self.step, "phase": self.phase, "incarnation": self.incarnation,
            "resume_step": getattr(self, "resume_step", 0), "first_step_at": self.first_step_at,
            "last_ckpt": self.ckpt.last_committed, "loss": self.loss,
            "throughput": self.throughput, "drain_step": self.drain_step, "pid": os.getpid(),
            "epoch": self.epoch, "offset": self.offset,
            "startup": getattr(self, "startup", None),
        }
        path = self.status_dir / f"worker-{self.local_rank}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(rep))
            os.replace(tmp, path)
        except OSError:
            pass


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s rank%(process)d %(message)s")
