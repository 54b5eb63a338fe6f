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

import io
import logging
import math
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
from spotctl.elastic.ckptsafe import load_extra  # noqa: E402
from spotctl.elastic.data import (  # noqa: E402
    ElasticBatchSampler,
    PermutationCache,
    auto_micro_batch,
    empty_like_batch,
    epoch_permutation,
    largest_dp_world,
    micro_slices,
    split_batch,
)
from spotctl.elastic.plain import (  # noqa: E402
    notice,
    notice_saved,
    own_init,
    report,
    write_status,
)

_T_IMPORTED = time.time()

__all__ = ["ElasticBatchSampler", "ResumeMismatch", "Run", "epoch_permutation", "init",
           "micro_slices", "notice", "notice_saved", "report", "split_batch"]
log = logging.getLogger("spotctl.elastic")
_cuda_answer: bool | None = None


def _cuda() -> bool:
    """Whether this process trains on CUDA, asked once, when a worker first needs it.
    Never at import: the warm zygote imports this module and then forks workers, and any
    CUDA query there (is_available() counts devices through the driver) poisons every
    forked child ("Cannot re-initialize CUDA in forked subprocess")."""
    global _cuda_answer
    if _cuda_answer is None:
        _cuda_answer = torch.cuda.is_available()
    return _cuda_answer


def _pg_timeout_s() -> float:
    """Collective timeout. Short on CPU/gloo (a vanished peer must not block survivors for
    30 minutes); long with CUDA, where a first step under torch.compile or a large load
    keeps peers waiting for minutes. SPOTCTL_PG_TIMEOUT_S overrides both."""
    return float(os.environ.get("SPOTCTL_PG_TIMEOUT_S", "900" if _cuda() else "60"))


# Forming the group: a peer that never shows up (it left during the rendezvous) must not
# hold the others for long; they fail, and torchrun re-forms without it.
PG_INIT_TIMEOUT_S = float(os.environ.get("SPOTCTL_PG_INIT_TIMEOUT_S", "30"))
REPORT_EVERY_S = 0.2


def loss_value(loss: float | torch.Tensor | None) -> float | None:
    """A loss for the status file (JSON): a finite float, or None (none given, NaN or
    infinite, or a tensor of more than one element)."""
    if loss is None:
        return None
    try:
        v = float(loss)
    except (TypeError, ValueError, RuntimeError):
        return None
    return v if math.isfinite(v) else None


def params_fingerprint(model: torch.nn.Module) -> str:
    """The model's parameters by name and (global) shape, as "<count>:<12 hex digits>": two
    scripts whose models differ in any parameter name or shape differ here. Names are
    taken without DDP's `module.` prefix."""
    import hashlib

    h = hashlib.sha256()
    n = 0
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        h.update(f"{name}:{tuple(p.shape)};".encode())
        n += 1
    return f"{n}:{h.hexdigest()[:12]}"


class ResumeMismatch(SystemExit):
    """The checkpoint was written for another model (its parameters' names and shapes) or
    with a different global_batch, dataset_size or seed: resuming would fail or silently
    change the training trajectory. Exits with one line (which the node's agent reports
    when it repeats: spotctl.agent.crashloop)."""


# glibc's mallopt() parameters (malloc.h) and what a worker sets them to
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
MALLOC_TRIM_BYTES = 1 << 30
_malloc_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Make this process' C heap keep freed memory for reuse instead of handing it back to
    the kernel at every free: glibc's mmap threshold fixed at its largest (32 MiB) and its
    trim threshold at 1 GiB. A CPU training step allocates and frees the same tensors every
    step (an optimizer's temporaries, gradients); with glibc's defaults those of 128 KiB to
    32 MiB come from pages that are returned and faulted in again, zeroed, at the next step
    whenever the heap's top happens to be free (16-20 thousand page faults, ~50 ms of
    kernel time per step of scripts/bench overhead's MLP, on plain DDP and both engines
    alike, per process at random). Done once per process; not done when the user set
    glibc's own malloc settings (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_,
    GLIBC_TUNABLES), with SPOTCTL_MALLOC_KEEP=0, or without glibc. Returns whether set."""
    global _malloc_kept
    if _malloc_kept is not None:
        return _malloc_kept
    _malloc_kept = False
    env = os.environ
    if (env.get("SPOTCTL_MALLOC_KEEP", "1") == "0" or "MALLOC_TRIM_THRESHOLD_" in env
            or "MALLOC_MMAP_THRESHOLD_" in env or "malloc" in env.get("GLIBC_TUNABLES", "")
            or not sys.platform.startswith("linux")):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # (1 on success; mmap first: setting it fixes both thresholds, which glibc otherwise
    # moves with each free)
    _malloc_kept = (mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES) == 1
                    and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES) == 1)
    return _malloc_kept


def _backend() -> str:
    return "cuda:nccl,cpu:gloo" if _cuda() else "gloo"


def init(timeout_s: float | None = None) -> torch.device:
    """Set this process' device and form the process group (idempotent). With CUDA:
    torch.cuda.set_device(LOCAL_RANK) first, then one group with cuda:nccl (training
    collectives) and cpu:gloo (control). Without CUDA: gloo. Returns the device to put
    the model and batches on. Call it before building a DeviceMesh / fully_shard. Also
    makes the C heap keep freed memory (keep_freed_memory)."""
    keep_freed_memory()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = _cuda()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        with own_init():  # route "elastic": not a plain script's group (spotctl.elastic.plain)
            _init_process_group(timeout_s or _pg_timeout_s(), device if cuda else None)
    return device


def _init_process_group(timeout_s: float, device_id: torch.device | None) -> None:
    """Over the worker store at MASTER_ADDR:MASTER_PORT. Rank 0 hosts that store on a
    socket bound to MASTER_ADDR only (TCPStore's own listener takes every interface, and
    the store has no authentication)."""
    from spotctl.sockets import listening_store

    env = os.environ
    timeout = timedelta(seconds=timeout_s)
    init_timeout = timedelta(seconds=PG_INIT_TIMEOUT_S)
    kw: dict[str, Any] = {"timeout": timeout}
    if device_id is not None:
        kw["device_id"] = device_id
    backend = _backend()
    try:
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        dist.init_process_group(backend, **kw)
        return
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # plain torchrun's c10d rendezvous: its agent already serves the store there
        dist.init_process_group(backend, **kw)
        return
    store = None
    if rank == 0:
        try:
            store = listening_store(addr, port, world_size=world, timeout=init_timeout,
                                    wait_for_workers=False)
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("worker store on %s:%s: %s; using torch's default listener", addr,
                        port, e)
            store = None
    if store is None and rank == 0:
        dist.init_process_group(backend, **kw)
        return
    if store is None:
        store = dist.TCPStore(addr, port, world, False, init_timeout, use_libuv=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)


def _is_sharded(model: torch.nn.Module) -> bool:
    """An FSDP2 module, or one holding DTensor parameters (tensor parallel): use as given."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without these
        return False
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _dp_coords(mesh: Any, dp_dim: str | tuple[str, ...] | None) -> tuple[int, int]:
    """(rank, size) of this process in the data-parallel dimension(s) of a DeviceMesh."""
    names = tuple(mesh.mesh_dim_names or ())
    if dp_dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"dp_dim must name the data-parallel dimension(s) of the "
                             f"{mesh.ndim}-D mesh {names}")
        dims = (0,)
    else:
        wanted = (dp_dim,) if isinstance(dp_dim, str) else tuple(dp_dim)
        for d in wanted:
            if d not in names:
                raise ValueError(f"dp_dim {d!r} is not a dimension of the mesh {names}")
        dims = tuple(names.index(d) for d in wanted)
    coord = mesh.get_coordinate()
    rank, size = 0, 1
    for d in dims:
        rank = rank * mesh.size(d) + coord[d]
        size *= mesh.size(d)
    return rank, size


def _rng_state() -> dict[str, Any]:
    import random

    st: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    import random

    random.setstate(st["python"])
    torch.set_rng_state(st["torch"].cpu())  # (CPU tensors only, as is the CUDA state)
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in st:
        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"].cpu())


REDUCE_DTYPES = (torch.bfloat16, torch.float16)


def _reduce_dtype(dtype: Any) -> torch.dtype | None:
    """None (gradients are reduced in their own dtype) or one of REDUCE_DTYPES."""
    if dtype is None or dtype == torch.float32:
        return None
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be torch.bfloat16, torch.float16 or None, "
                         f"not {dtype!r}")
    return dtype  # type: ignore[no-any-return]


def _compressed_mean_hook(dtype, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: the bucket's mean over the ranks, sent in `dtype` (half the bytes of
    fp32) and written back into the bucket in its own dtype. torch's bf16_compress_hook
    does the same but refuses anything but CUDA/NCCL, and this must run on gloo too. (No annotations: DDP checks a
    hook's against its own types, and this module's are strings.)"""
    buf = bucket.buffer()
    wire = buf.to(dtype).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()  # type: ignore[union-attr]

    def back(f: torch.futures.Future[Any]) -> torch.Tensor:
        return buf.copy_(f.value()[0])

    return fut.then(back)


class Run:
    """One elastic training run. See the module docstring for the loop.

    model: a plain module (wrapped in DDP, on this rank's device), or one the user already
      parallelised: FSDP2 `fully_shard`, DTensor parameters (tensor parallel), or DDP; those
      are used as given.
    optimizer: one optimizer or a list of them.
    mesh / dp_dim: the DeviceMesh and the name(s) of its data-parallel dimension(s). Data is
      split, and loss_scale computed, over that dimension only (tensor-parallel peers see the
      same batch). Without a mesh, every rank is a data-parallel rank.
    micro_batch: at most this many samples per forward/backward on a rank; every rank runs
      the same number of micro-batches per step (empty ones where it has fewer samples) and
      gradients are synchronised on the last one only. Memory stays bounded at any world
      size; the update is still the mean over the fixed global batch. "auto" (what an
      unset micro_batch means on CUDA): each rank's share of global_batch at the cluster's
      largest size (the spec's gpus max, passed by the agent), so a smaller cluster runs
      more micro-batches of that same size, never bigger ones: a rescale that takes nodes
      away does not raise the memory a step needs. Unset on CPU: one micro-batch per step.
    schedulers, scaler, state: LR schedulers, a GradScaler, and named user objects with
      state_dict()/load_state_dict(): checkpointed and restored with the model.
    reduce_dtype: torch.bfloat16 (or torch.float16) to average gradients across
      data-parallel ranks in that dtype, half the bytes of fp32 on the network, each
      gradient kept in its own dtype; None (default) reduces them as they are. On the
      torchft engine it applies inside the replica (DDP) and across replicas.
    checkpoint_every / checkpoint_every_s: save every this many steps, and also when this
      many seconds have passed since the last save (0: steps only); the spec's [train]
      values by default. On the timer every rank saves at the same step: rank 0's clock
      decides.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Run:
        # the engine is chosen by the spec ([train] engine, passed as SPOTCTL_ENGINE),
        # never by the script: on torchft, Run(...) is an FtRun (spotctl.elastic.ft)
        if cls is Run and os.environ.get("SPOTCTL_ENGINE") == "torchft":
            from spotctl.elastic.ft import FtRun

            return super().__new__(FtRun)
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        dataset_size: int,
        global_batch: int,
        seed: int = 0,
        epochs: int = 1_000_000,
        max_steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        keep_last: int | None = None,
        *,
        micro_batch: int | str | None = None,
        mesh: Any = None,
        dp_dim: str | tuple[str, ...] | None = None,
        schedulers: Any = (),
        scaler: Any = None,
        state: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        checkpoint_every_s: float | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        t_init = self._setup(
            model, optimizer, dataset_size, global_batch, seed, epochs, max_steps,
            checkpoint_every, checkpoint_dir, keep_last, micro_batch=micro_batch, mesh=mesh,
            dp_dim=dp_dim, schedulers=schedulers, scaler=scaler, state=state, timeout_s=timeout_s,
            checkpoint_every_s=checkpoint_every_s, reduce_dtype=reduce_dtype,
        )  # fmt: skip
        t_restore = time.time()
        self.resume_step = self._restore()
        # periodic saves copy parameters and optimizer state while the next step's forward
        # and backward run; each optimizer's step() waits for that copy
        self.ckpt.guard(self.optimizers)
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
        self.phase = "train"
        self._report(force=True)

    def _setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        dataset_size: int,
        global_batch: int,
        seed: int = 0,
        epochs: int = 1_000_000,
        max_steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        keep_last: int | None = None,
        *,
        micro_batch: int | str | None = None,
        mesh: Any = None,
        dp_dim: str | tuple[str, ...] | None = None,
        schedulers: Any = (),
        scaler: Any = None,
        state: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        checkpoint_every_s: float | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> float:
        """What both engines set up before restoring: process groups, wrappers, the
        training state's parts, the checkpointer. Returns when it started."""
        env = os.environ
        if dataset_size < 1 or global_batch < 1:
            raise ValueError("dataset_size and global_batch must be >= 1")
        if micro_batch is not None and micro_batch != "auto" and (
                isinstance(micro_batch, bool) or not isinstance(micro_batch, int)
                or micro_batch < 1):
            raise ValueError(f"micro_batch must be a whole number >= 1 or \"auto\", "
                             f"not {micro_batch!r}")
        self.drain_requested = False
        signal.signal(signal.SIGUSR1, self._on_drain_signal)
        t_init = time.time()
        self.device = init(timeout_s)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        t = timedelta(seconds=timeout_s or _pg_timeout_s())
        # control traffic (drain flag, incarnation) and checkpoint coordination: CPU/gloo,
        # never a device synchronisation
        self.ctl_pg = dist.new_group(backend="gloo", timeout=t)
        self.ckpt_pg = dist.new_group(backend="gloo", timeout=t)
        # data-parallel coordinates inside this process group (the torchft engine scales
        # them by the replicas of each step's quorum)
        if mesh is not None:
            self.local_dp_rank, self.local_dp_world = _dp_coords(mesh, dp_dim)
        else:
            self.local_dp_rank, self.local_dp_world = self.rank, self.world
        self.dp_rank, self.dp_world = self.local_dp_rank, self.local_dp_world
        self.reduce_dtype = _reduce_dtype(reduce_dtype)
        self.params_fp = params_fingerprint(model)
        self.model = self._wrap(model)
        self.optimizer = optimizer
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self.schedulers = ([schedulers] if hasattr(schedulers, "state_dict")
                           else list(schedulers or ()))
        self.scaler = scaler
        self.user_state = dict(state or {})
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self._told_indices = False
        auto = micro_batch == "auto" or (micro_batch is None and self.device.type == "cuda")
        self.micro_batch: int | None = (self._auto_micro_batch() if auto else
                                        micro_batch if isinstance(micro_batch, int) else None)
        self.seed = seed
        self.epochs = epochs
        self.max_steps = max_steps if max_steps is not None else int(env.get("SPOTCTL_MAX_STEPS", "0"))
        self.every = checkpoint_every or int(env.get("SPOTCTL_CHECKPOINT_EVERY", "20"))
        # seconds between saves as well; rank 0's clock decides, every rank learns it
        # through the per-step control all_reduce (so all save at the same step)
        self.every_s = (checkpoint_every_s if checkpoint_every_s is not None
                        else float(env.get("SPOTCTL_CHECKPOINT_EVERY_S") or 0))
        if not 0 <= self.every_s < float("inf"):
            raise ValueError(f"checkpoint_every_s must be >= 0 seconds, not {self.every_s}")
        self._last_save_t = time.monotonic()
        self._time_due = False
        self._save_owed = False  # a due save put off while the one before it uploads
        self._upload_busy = False  # (agreed) some rank's last save is still uploading
        self._flags_after = self._flags_made_after = 0  # (of the flags read, of those sent)
        root = checkpoint_dir or env.get("SPOTCTL_CHECKPOINT_DIR") or "checkpoints"
        self.ckpt = Checkpointer(root, keep_last or int(env.get("SPOTCTL_KEEP_LAST", "3")),
                                 self.rank, self.ckpt_pg)
        self.status_dir = Path(env["SPOTCTL_STATUS_DIR"]) if env.get("SPOTCTL_STATUS_DIR") else None
        self.incarnation = self._make_incarnation()
        self.step = 0
        self.epoch = 0
        self.offset = 0  # samples of this epoch consumed
        self.phase = "init"
        self.loss: float | torch.Tensor | None = None  # as end_step() got it
        self.first_step_at: float | None = None
        self._t_last_report = 0.0
        self._rate_t0 = time.time()
        self._rate_samples = 0
        self.throughput: float | None = None
        self.drain_step: int | None = None
        self._perm = PermutationCache(dataset_size, seed)
        self._drain_work: Any = None
        self._drain_flag = torch.zeros(3, dtype=torch.int32)
        return t_init

    def _control_flags(self) -> torch.Tensor:
        """This rank's part of the per-step agreement (MAX over the ranks): [a notice
        came, a timed checkpoint is due]. Only rank 0's clock counts."""
        due = (self.every_s > 0 and self.rank == 0
               and time.monotonic() - self._last_save_t >= self.every_s)
        self._flags_made_after = self.ckpt.started  # the newest save these flags know of
        return torch.tensor([1 if self.drain_requested else 0, 1 if due else 0,
                             1 if self.ckpt.uploading() else 0], dtype=torch.int32)

    def _take_flags(self, flag: torch.Tensor) -> bool:
        """Read the agreed control flags (reduced with MAX over the group): note whether a
        timed save is due and whether some rank still uploads, as of the flags' sending;
        return whether to drain."""
        # a timed save that was due when these flags were made is no longer due once a
        # save started since (on the restart path the flags are read a step after they
        # were made): it would be a second save right after that one
        self._time_due = bool(flag[1].item()) and self._flags_made_after == self.ckpt.started
        self._upload_busy = bool(flag[2].item())
        self._flags_after = self._flags_made_after
        return bool(flag[0].item())

    def _save_now(self) -> bool:
        """Whether the step just finished is saved: every `every` steps, or when the
        agreed timer says so; either resets the timer."""
        due = self.step % self.every == 0 or self._time_due or self._save_owed
        # agreed flags from before the newest save started cannot speak for its upload
        busy = self._upload_busy or self._flags_after != self.ckpt.started
        if due and busy:
            # the previous save is still uploading on some rank: waiting for it here would
            # stall every rank for the rest of that upload. The save is owed instead and
            # made at the first step at which every rank's upload has finished.
            if not self._save_owed and self.rank == 0:
                log.info("step %d: the save of step %d is still uploading; saving later",
                         self.step, self.ckpt.started)
            self._save_owed = True
            self._time_due = False
            return False
        if due:
            self._time_due = self._save_owed = False
            self._last_save_t = time.monotonic()
        return due

    # -- setup
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if _is_sharded(model):
            if self.reduce_dtype is not None:
                raise ValueError("reduce_dtype applies to the DDP reduction; for an FSDP2 "
                                 "model set MixedPrecisionPolicy(reduce_dtype=...) in "
                                 "fully_shard")
            return model
        if not isinstance(model, DDP):
            if self.dp_world != self.world:
                raise ValueError("a plain module is wrapped in DDP over every rank: pass a "
                                 "module you parallelised yourself when the mesh has other "
                                 "dimensions")
            if self.device.type == "cuda":
                model.to(self.device)
                model = DDP(model, device_ids=[self.device.index],
                            output_device=self.device.index)
            else:
                model = DDP(model)
        if self.reduce_dtype is not None:
            model.register_comm_hook(self.reduce_dtype, _compressed_mean_hook)
        return model

    def _on_drain_signal(self, signum: int, frame: Any) -> None:
        self.drain_requested = True

    def _make_incarnation(self) -> str:
        obj = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0, group=self.ctl_pg)
        return str(obj[0])

    def _state(self, with_extra: bool = True) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizers)
        st: dict[str, Any] = {"model": msd, "optim": osd}
        if with_extra:
            # every rank's RNG state, gathered: DCP keeps one copy of a non-tensor value
            rngs: list[Any] = [None] * self.world
            dist.all_gather_object(rngs, _rng_state(), group=self.ctl_pg)
            extra = {
                "schedulers": [s.state_dict() for s in self.schedulers],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "user": {k: v.state_dict() for k, v in self.user_state.items()},
                "rng": rngs,
            }
            buf = io.BytesIO()
            torch.save(extra, buf)
            st["extra"] = buf.getvalue()
        return st

    def _check_meta(self, meta: dict[str, Any], step: int) -> None:
        # what the model is: its parameters' names and shapes (a checkpoint of another
        # model would fail inside DCP's load with a message about one tensor)
        for key, mine in (("params", self.params_fp), ("global_batch", self.global_batch),
                          ("dataset_size", self.dataset_size), ("seed", self.seed)):
            theirs = meta.get(key)
            if theirs is not None and theirs != mine:
                fresh = ("`spotctl down --purge`, or another cluster name" if
                         os.environ.get("SPOTCTL_NODE_ID") else "a new checkpoint_dir")
                what = (f"for another model (parameters {theirs}, this one's {mine})"
                        if key == "params" else
                        f"with {key}={theirs}, this run has {key}={mine}")
                msg = (f"spotctl.elastic: checkpoint step {step} under {self.ckpt.root} was "
                       f"written {what}; start fresh: {fresh}")
                log.error(msg)
                raise ResumeMismatch(msg)

    def _restore(self) -> int:
        steps = self.ckpt.committed_list()
        if not steps:
            # fresh start: never build DCP's state dict here, it would initialise the
            # optimizer with a zero-gradient step (Adam's step counter one ahead)
            return 0
        newest = [self.ckpt.read_meta(steps[0]) if self.rank == 0 else None]
        dist.broadcast_object_list(newest, src=0, group=self.ctl_pg)
        self._check_meta(newest[0] or {}, steps[0])
        state = self._state(with_extra=False)
        state["extra"] = b""
        meta = self.ckpt.load(steps, state)
        self._check_meta(meta, int(meta["step"]))
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if state["extra"]:
            extra = load_extra(state["extra"])
            for s, sd in zip(self.schedulers, extra["schedulers"], strict=False):
                s.load_state_dict(sd)
            if self.scaler is not None and extra.get("scaler"):
                self.scaler.load_state_dict(extra["scaler"])
            for k, obj in self.user_state.items():
                if k in extra["user"]:
                    obj.load_state_dict(extra["user"][k])
            rngs = extra["rng"]
            if self.rank < len(rngs) and len(rngs) == self.world:
                _set_rng_state(rngs[self.rank])
            else:
                # another world size: a fresh, deterministic stream per rank
                torch.manual_seed(self.seed * 1_000_003 + int(meta["step"]) * 1009 + self.rank)
        self.step = int(meta["step"])
        self.epoch = int(meta["epoch"])
        self.offset = int(meta["offset"])
        if self.rank == 0:
            log.info("resumed at step %d (epoch %d offset %d) with world size %d",
                     self.step, self.epoch, self.offset, self.world)
        return self.step

    def _meta(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "world_size": self.world,
                "incarnation": self.incarnation, "seed": self.seed,
                "global_batch": self.global_batch, "dataset_size": self.dataset_size,
                "micro_batch": self.micro_batch, "params": self.params_fp}

    # -- one view of the job, on either engine
    @property
    def is_main(self) -> bool:
        """True on exactly one process of the whole job at any step: log and write files
        there. (On torchft, `rank` and `world` are the replica group's own process group;
        use dp_rank / dp_world for the job's data-parallel coordinates.)"""
        return self.rank == 0

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Reduce a metric over every data-parallel rank of the job: op "sum", "mean",
        "max" or "min". `value`: a number (a float comes back) or a tensor (a new tensor
        comes back). Every process must call it at the same point of the step. Ranks that
        hold the same data (tensor-parallel peers) count once. On the torchft engine, when
        a replica fails during the step, the value across the job is unknown and comes back
        NaN (a tensor of integers: a float64 tensor of NaN), never a partial sum."""
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, mean, max or min, not {op!r}")
        number = not isinstance(value, torch.Tensor)
        t = (torch.tensor(float(value), dtype=torch.float64) if number
             else value.detach().clone())
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        self._reduce(t, op)
        if op == "mean":
            t /= self.dp_world
        return t.item() if number else t

    def mean(self, value: Any) -> Any:
        """all_reduce(value, "mean"): e.g. the global mean loss of a step."""
        return self.all_reduce(value, "mean")

    def _reduce(self, t: torch.Tensor, op: str) -> None:
        """Sum (or max/min) of `t` over the data-parallel ranks, in place."""
        if op in ("max", "min"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
            return
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if self.world != self.local_dp_world:  # non-data-parallel peers hold copies
            t /= self.world // self.local_dp_world

    def _auto_micro_batch(self) -> int:
        """micro_batch="auto": this rank's share of the global batch at the cluster's
        largest size (SPOTCTL_MAX_WORLD, every rank of every node; the agent sets it), or
        at this size when run without an agent."""
        largest = int(os.environ.get("SPOTCTL_MAX_WORLD") or 0)
        size = largest or self.world
        mb = auto_micro_batch(self.global_batch, self.world, self.local_dp_world, size)
        if self.rank == 0:
            log.info("micro_batch: %d samples (global_batch %d over the %d data-parallel "
                     "ranks of the %s); a smaller cluster runs more micro-batches of this "
                     "size", mb, self.global_batch,
                     largest_dp_world(self.world, self.local_dp_world, size),
                     "cluster's largest size" if largest else
                     "size it started at (SPOTCTL_MAX_WORLD not set)")
        return mb

    def sync_grads(self) -> None:
        """Gradients are averaged over every data-parallel rank during backward (DDP,
        FSDP2): nothing to do. Kept for scripts that call it on either engine."""

    # -- per step
    @property
    def step_samples(self) -> int:
        return min(self.global_batch, self.dataset_size - self.offset)

    @property
    def loss_scale(self) -> float:
        """Multiply a sum-reduced per-rank loss by this: the data-parallel gradient
        average then equals the mean over the global batch, whatever the world size."""
        return self.dp_world / self.step_samples

    def _slices(self) -> list[tuple[int, int]]:
        return micro_slices(self.step_samples, self.dp_world, self.dp_rank, self.micro_batch)

    def batch_indices(self) -> torch.Tensor:
        """This rank's dataset indices for the current step (all its micro-batches)."""
        perm = self._perm.get(self.epoch)
        a, b = split_batch(self.step_samples, self.dp_world, self.dp_rank)
        if self.micro_batch is not None and b - a > self.micro_batch and not self._told_indices:
            self._told_indices = True
            log.warning("batch_indices() gives this rank's whole share (%d samples) at once, "
                        "more than micro_batch (%d): loop over run.micro_batches() to keep "
                        "each forward/backward within it", b - a, self.micro_batch)
        return perm[self.offset + a : self.offset + b]

    def micro_batches(self, batches: Any = None) -> Any:
        """Yield this step's micro-batches: index tensors, or the next items of `batches`
        (an iterator over a DataLoader built on batch_sampler()). Gradient sync is turned
        off for all but the last, which every rank reaches together."""
        perm = self._perm.get(self.epoch)
        sl = self._slices()
        template = None
        try:
            for i, (a, b) in enumerate(sl):
                self._set_grad_sync(i == len(sl) - 1)
                if batches is None:
                    yield perm[self.offset + a : self.offset + b]
                elif b > a:
                    template = next(batches)
                    yield template
                else:  # an empty micro-batch (the sampler sends a stand-in if all are)
                    if template is None:
                        template = next(batches)
                    yield empty_like_batch(template)
        finally:
            self._set_grad_sync(True)

    def _set_grad_sync(self, on: bool) -> None:
        m = self.model
        if isinstance(m, DDP):
            m.require_backward_grad_sync = on
        elif hasattr(m, "set_requires_gradient_sync"):
            m.set_requires_gradient_sync(on)

    def batch_sampler(self) -> ElasticBatchSampler:
        """For torch.utils.data.DataLoader(ds, batch_sampler=run.batch_sampler(), ...):
        one batch per micro-batch of every step from the current position on."""
        return ElasticBatchSampler(self.dataset_size, self.global_batch, self.seed,
                                   self.dp_world, self.dp_rank, micro_batch=self.micro_batch,
                                   epoch=self.epoch, offset=self.offset, step=self.step,
                                   max_steps=self.max_steps or None, epochs=self.epochs)

    def dataloader(self, dataset: Any, **kwargs: Any) -> Any:
        """A torch.utils.data.DataLoader over `dataset` in this run's exact order (kwargs:
        num_workers, pin_memory, collate_fn...). Its worker seeds come from a generator of
        its own, so creating it after a resume leaves the global RNG streams where an
        uninterrupted run has them."""
        from torch.utils.data import DataLoader

        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.step)
        return DataLoader(dataset, batch_sampler=self.batch_sampler(), generator=g, **kwargs)

    def next_step(self) -> bool:
        """Agree on draining, then say whether to run a step. The agreement is one tiny
        all_reduce on a CPU/gloo group, started here and read at the next call: it never
        waits on the device, and every rank sees a notice at the same step."""
        self.ckpt.poll()
        if self._drain_work is not None:
            self._drain_work.wait()
            self._drain_work = None
            if self._take_flags(self._drain_flag):
                self._drain()
        if self.max_steps and self.step >= self.max_steps:
            return False
        if self.epoch >= self.epochs:
            return False
        self._drain_flag = self._control_flags()
        self._drain_work = dist.all_reduce(self._drain_flag, op=dist.ReduceOp.MAX,
                                           group=self.ctl_pg, async_op=True)
        return True

    def end_step(self, loss: float | torch.Tensor | None = None) -> None:
        """The step is done. `loss` (optional; a float or a one-element tensor) is shown by
        `status`; a tensor is read at the next report (every REPORT_EVERY_S), not here, so
        passing the loss tensor costs no device synchronisation per step."""
        n = self.step_samples
        self.step += 1
        self.offset += n
        self._rate_samples += n
        if self.offset >= self.dataset_size:
            self.epoch += 1
            self.offset = 0
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if self.first_step_at is None:
            self.first_step_at = time.time()
            self.startup["first_step"] = round(self.first_step_at - self._t_ready, 3)
            if self.rank == 0:
                log.info("restart breakdown: %s", self.startup)
            self._report(force=True)
        if self._save_now():
            self.ckpt.save_async(self.step, self._state(), self._meta())
        self._report()

    def _drain(self) -> None:
        self.phase = "draining"
        self._report(force=True)
        S = self.step
        # a step committed already (the resume step, or a periodic save just finished) is
        # never written again; save_sync agrees on rank 0's view first. A periodic save
        # still uploading is left behind: the drain saves beside it on the control group
        # (idle from here on), not after it
        ok = (self.ckpt.save_sync(S, self._state(), self._meta(), beside_pending=self.ctl_pg)
              if S > 0 else True)
        self.drain_step = S
        self.phase = "drained" if ok else "drain-failed"
        self._report(force=True)
        if self.rank == 0:
            log.info("drained at step %d (committed=%s); waiting to be stopped", S, ok)
        self._after_drain()

    def _after_drain(self) -> None:
        # Never exit 0 mid-job: the agent stops us (SIGTERM) once it is safe to re-form.
        while True:
            time.sleep(0.05)

    def finish(self) -> None:
        """End of training: final save (all ranks agree whether it is needed), then exit 0
        on every rank together."""
        if self._drain_work is not None:
            self._drain_work.wait()
            self._drain_work = None
        if self.step > 0:
            self.ckpt.save_sync(self.step, self._state(), self._meta())
        self.ckpt.close()
        self.phase = "done"
        self._report(force=True)
        dist.barrier(group=self.ctl_pg)
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
            "last_ckpt": self.ckpt.last_committed, "loss": loss_value(self.loss),
            "throughput": self.throughput, "drain_step": self.drain_step, "pid": os.getpid(),
            "epoch": self.epoch, "offset": self.offset,
            "startup": getattr(self, "startup", None), "micro_batch": self.micro_batch,
        }
        write_status(self.status_dir, self.local_rank, rep)


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s rank%(process)d %(message)s")
