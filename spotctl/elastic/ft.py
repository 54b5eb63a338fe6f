"""The torchft engine behind the same Run API: hot rescale, no worker restarts.

Every node's workers form one *replica group* under their own torchrun; a torchft Manager
in every worker joins the replica groups through the Lighthouse on the head (quorum per
step). A script written against `spotctl.elastic.Run` runs unchanged: `Run(...)` returns an
`FtRun` when SPOTCTL_ENGINE=torchft (the agent sets it from the spec's
`[train] engine`).

What spotctl adds to torchft (its own example loop has none of these):

- Fixed global batch: each step's `global_batch` samples are split over the replicas in
  the step's quorum (and the data-parallel ranks inside each), so a step computes the
  same update whatever the membership. `loss_scale` is computed per step.
- Exact data position: (epoch, offset) travel with the model in live recovery and in
  checkpoints, and advance only on a committed step. run.dataloader() follows it: its
  DataLoader is replaced, at the run's position, when the split or the step sequence
  changes.
- A failed step is applied by nobody: the optimizer (and LR scheduler) steps only when
  torchft's commit vote passes; otherwise the same step, same samples, runs again after
  the next quorum. A replica whose vote differs is behind by one step and heals from a
  peer at the next quorum.
- Notices are graceful leaves: SIGUSR1 makes the replica finish the step in flight,
  commit it, and leave the quorum (its Manager stops heartbeating); the survivors go on
  from memory. 0 steps lost, no checkpoint on the critical path.
- Full state in live recovery: model, optimizers, schedulers, scaler, user objects,
  per-rank RNG, data position (torchft's PGTransport over the replicas' own process
  group: no extra listener). Periodic checkpoints (DCP, the restart path's format) are
  written by the replica of rank 0 in the quorum, for the case every replica dies.

Listeners: the Manager's server binds the node's loopback (a replica group of one node:
only its workers call it; healing replicas take the transport's metadata as their own),
or the group's first node's address when the group spans nodes, not every interface as
torchft does by default; the Lighthouse binds the head's (spotctl.head).
"""

from __future__ import annotations

import collections
import gc
import hashlib
import logging
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel as DDP

from spotctl.elastic import (
    REPORT_EVERY_S,
    ElasticBatchSampler,
    Run,
    _is_sharded,
    _process_start_time,
    _rng_state,
    _set_rng_state,
    loss_value,
    micro_slices,
    peerload,
    write_status,
)
from spotctl.elastic.ftwatch import Watch, status_page
from spotctl.elastic.outer import OuterSync, SyncConfig, notice_action, notice_lead

log = logging.getLogger("spotctl.elastic.ft")
# cross-replica collectives and heals: a live replica held up (a first torch.compile step,
# a save's copy, a heal) must not fail the step for everyone, which on a GPU takes minutes;
# a vanished one is found by its heartbeats (spotctl.elastic.ftwatch), not by this bound
FT_TIMEOUT_S = float(os.environ.get("SPOTCTL_FT_TIMEOUT_S") or 0)  # 0: by device
# connecting to the replica group's Manager and store
FT_CONNECT_TIMEOUT_S = 10.0


def ft_timeout_s(device: torch.device) -> float:
    """The cross-replica timeout: SPOTCTL_FT_TIMEOUT_S, else 300 s on CUDA, 10 s on CPU."""
    return FT_TIMEOUT_S or (300.0 if device.type == "cuda" else 10.0)
FT_QUORUM_TIMEOUT_S = float(os.environ.get("SPOTCTL_FT_QUORUM_TIMEOUT_S", "120"))
# how often a replica group's manager asks the Lighthouse again after a failed quorum call
# (torchft spreads its retries over the quorum timeout: one every timeout / (retries + 1)).
# With none, a Lighthouse that restarts (with the head) fails the call in flight, and
# torchft 0.2.0 then never answers the group's workers: they wait out the whole quorum
# timeout and restart from the checkpoint. With a retry every ~0.5 s the group asks the
# restarted Lighthouse and goes on from memory.
FT_QUORUM_RETRY_S = float(os.environ.get("SPOTCTL_FT_QUORUM_RETRY_S", "0.5"))


def engine() -> str:
    return os.environ.get("SPOTCTL_ENGINE", "torchrun") or "torchrun"


class _Quorum:
    """A torchft QuorumResult with another quorum id (the rest read through)."""

    def __init__(self, q: Any, quorum_id: int):
        self._q = q
        self.quorum_id = quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._q, name)


class UniqueQuorums:
    """torchft's ManagerClient, with quorum ids unique across Lighthouse restarts.

    A Lighthouse numbers its quorums from 1, so one restarted with the head hands out ids
    the replicas used before. torchft reconfigures its process group only when the id
    changes and asks for a store prefix that is never reused (`.../torchft/{id}/{rank}`):
    an old id would keep a stale group or meet stale rendezvous keys, and the head would
    take the new quorum's worker group for an old one. Every member of a quorum gets the
    same (id, members, max step) in the round it forms, so each derives the same new id
    from them, and keeps it while the Lighthouse's id and the members stay the same."""

    def __init__(self, client: Any):
        self._client = client
        self._key: tuple[int, tuple[str, ...]] | None = None
        self.replica_ids: tuple[str, ...] = ()  # the current quorum's members
        self.quorum_id = -1
        self.lighthouse_quorum_id = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **kw: Any) -> Any:
        q = self._client._quorum(**kw)
        key = (int(q.quorum_id), tuple(q.replica_ids))
        self.replica_ids = key[1]
        if key != self._key:
            seed = f"{key[0]}|{','.join(key[1])}|{int(q.max_step)}".encode()
            self._key = key
            self.quorum_id = int(hashlib.sha1(seed).hexdigest()[:12], 16)
            self.lighthouse_quorum_id = key[0]
        return _Quorum(q, self.quorum_id)


def _await_start_peers(lighthouse: str, n: int, bound_s: float) -> None:
    """Before this replica's first quorum: while the Lighthouse has formed none yet (a new
    cluster), wait until `n` replicas heartbeat it (each starts when its Manager exists),
    at most `bound_s`. The Lighthouse's first quorum then waits for every heartbeating
    replica (its join timeout), so the cluster's first quorum has them all. A Lighthouse
    that has formed a quorum (a joiner, a restart) is not waited for. Read from its status
    page (torchft 0.2.0's: no API gives the heartbeat count)."""
    import re

    if n <= 1:
        return
    end = time.monotonic() + bound_s
    seen = -1
    while time.monotonic() < end:
        try:
            page = status_page(lighthouse)
        except OSError:
            time.sleep(0.1)
            continue
        qid = re.search(r"Current quorum_id: (\d+)", page)
        beats = re.search(r"\[(\d+) heartbeating\]", page)
        if qid is None or beats is None or int(qid.group(1)) > 0:
            return  # a quorum exists already (or a page this code cannot read)
        seen = int(beats.group(1))
        if seen >= n:
            return
        time.sleep(0.05)
    log.warning("started with %d of the %d replicas expected after %.0f s", seen, n, bound_s)


def _gloo_group(timeout_s: float) -> Any:
    """torchft's reconfigurable gloo group, except that an abort (the next quorum's
    reconfiguration) does not wait for a collective still in flight: c10d's gloo abort
    waits for it, and one a vanished peer never finishes held the next quorum until the
    gloo timeout (aborting it in another thread held the new group's creation too: tried).
    The old group is dropped without an abort and kept referenced (freeing it joins its
    threads, which wait in that collective until the gloo timeout): the last 8 are kept."""
    from torchft import ProcessGroupGloo

    class Gloo(ProcessGroupGloo):  # type: ignore[misc]
        dropped: list[Any] = []

        def abort(self, errored: bool = True) -> None:
            if self._pg is not None:
                Gloo.dropped.append(self._pg)
                del Gloo.dropped[:-8]
            self._pg = None

    return Gloo(timeout=timedelta(seconds=timeout_s))


def _stop_timeout_loop() -> None:
    """torchft's timeout loop stopped and its thread joined, as its own shutdown() does,
    except that its watchdog thread is not joined (it sleeps up to 30 s between looks; it
    returns at its next look, finding the loop gone)."""
    from torchft import futures

    tm = futures._TIMEOUT_MANAGER
    with tm._lock:
        loop, thread = tm._event_loop, tm._event_loop_thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        tm._event_loop = tm._event_loop_thread = None


def _release_groups(ft_pg: Any, nccl: bool) -> None:
    """The cross-replica process group freed now, and the old ones _gloo_group dropped:
    freeing a c10d group (which releases the GIL) joins its threads. NCCL's communicators
    are shut down first (c10d's own end of a group, as destroy_process_group does)."""
    inner = getattr(ft_pg, "_pg", None)
    if nccl and inner is not None:
        try:
            inner.shutdown()
        except Exception as e:  # noqa: BLE001 - freed below all the same
            log.warning("the cross-replica NCCL group did not shut down cleanly: %s", e)
    del inner
    ft_pg.shutdown()  # torchft's wrappers: the c10d group is no longer referenced
    dropped = getattr(type(ft_pg), "dropped", None)
    if dropped:
        dropped.clear()
    gc.collect()  # works and futures held in reference cycles


class _HealMetadata:
    """torchft's ManagerClient, except that the checkpoint metadata a healing replica asks
    its source's Manager for is answered here: spotctl's transport (PGTransport over the
    replicas' own process group) has the same constant metadata on every replica, so no
    replica ever calls another's Manager, which may then listen on its node's loopback.
    Everything else goes to a real client, made at first use."""

    metadata = ""  # the transport's (FtRun sets it before torchft makes a client)

    def __init__(self, addr: str, connect_timeout: timedelta):
        self._args = (addr, connect_timeout)
        self._real: Any = None

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        if self.metadata:
            return self.metadata
        return str(self.__getattr__("_checkpoint_metadata")(rank, timeout=timeout))

    def __getattr__(self, name: str) -> Any:
        if self._real is None:
            from torchft._torchft import ManagerClient

            self._real = ManagerClient(self._args[0], connect_timeout=self._args[1])
        return getattr(self._real, name)


def _manager_host(env: Any) -> str:
    """Where a replica group's Manager is reached: its node's loopback when the group is
    one node (its clients are that node's workers alone), else the group's first node's
    cluster address, which the group's other nodes reach (through a filter: see
    _bound_manager_server)."""
    if int(env.get("SPOTCTL_FT_REPLICA_NODES") or 1) <= 1:
        return "127.0.0.1"
    return str(env.get("MASTER_ADDR", "127.0.0.1"))


# The ManagerService calls a group's workers make of their Manager (torchft 0.2.0's
# ManagerClient: the quorum, the commit vote, and the heal's metadata, which spotctl's
# replicas answer locally). `Kill` is not among them.
MANAGER_METHODS = frozenset({"/torchft.ManagerService/Quorum",
                             "/torchft.ManagerService/ShouldCommit",
                             "/torchft.ManagerService/CheckpointMetadata"})


class _FilteredManager:
    """A ManagerServer on loopback behind spotctl's gRPC filter on the cluster address:
    its address() is the filter's, which is what the group's workers are told."""

    def __init__(self, real: Any, filt: Any, host: str):
        self._real, self._filter = real, filt
        self._address = f"http://[{host}]:{filt.port}" if ":" in host else (
            f"http://{host}:{filt.port}")

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        self._filter.stop()
        self._real.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _bound_manager_server(host: str) -> Any:
    """torchft's ManagerServer, bound to `host` instead of every interface. A group that
    spans nodes (`host` not loopback) gets its Manager on loopback and, on `host`, the
    filter the head puts in front of the Lighthouse (spotctl.head.grpc_filter), passing
    MANAGER_METHODS only: torchft serves `Kill` to anyone who reaches the Manager, and the
    group's other nodes must reach it."""
    from torchft._torchft import ManagerServer

    def make(**kw: Any) -> Any:
        port = kw["bind"].rsplit(":", 1)[1]
        if host in ("127.0.0.1", "localhost", "::1"):
            kw["bind"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            return ManagerServer(**kw)
        from spotctl.head.grpc_filter import GrpcFilter

        kw["bind"], kw["hostname"] = "127.0.0.1:0", "127.0.0.1"
        real = ManagerServer(**kw)
        try:
            up = int(real.address().rsplit(":", 1)[1])
            filt = GrpcFilter(host, int(port), ("127.0.0.1", up), allowed=MANAGER_METHODS,
                              http1_get=(), name="manager filter")
        except BaseException:
            real.shutdown()
            raise
        out = _FilteredManager(real, filt, host)
        log.info("replica group's Manager: %s, filtered (Kill refused)", out.address())
        return out

    return make


_GATES: dict[int, Any] = {}  # id(gated object) -> its FtRun
_GATED_CLASSES: dict[tuple[type, str], type] = {}


def _gate(obj: Any, run: FtRun, name: str, gated: Any) -> None:
    """Route obj.<name>(...) through gated(obj, run, original, ...). Done by swapping in a
    subclass (an attribute on the instance would land in a state_dict that holds the
    instance's __dict__, as an LR scheduler's does)."""
    base = type(obj)
    if (base, name) not in _GATED_CLASSES:
        orig = getattr(base, name)

        def method(self: Any, *a: Any, **kw: Any) -> Any:
            r = _GATES.get(id(self))
            return orig(self, *a, **kw) if r is None else gated(self, r, orig, *a, **kw)

        _GATED_CLASSES[(base, name)] = type(base.__name__, (base,), {name: method})
    obj.__class__ = _GATED_CLASSES[(base, name)]
    _GATES[id(obj)] = run


def _scheduler_step(sched: Any, run: FtRun, orig: Any, *a: Any, **kw: Any) -> Any:
    """An LR scheduler steps only with a committed step."""
    if run._decision is False:
        return None  # the optimizer step was not applied: neither is its schedule
    return orig(sched, *a, **kw)


def _scaler_update(scaler: Any, run: FtRun, orig: Any, *a: Any, **kw: Any) -> Any:
    """A GradScaler's update() follows the commit vote: a step nobody applies leaves the
    scale as it was (an overflow found in the globally averaged gradients, seen alike by
    every replica, updates it as in plain training). update() takes the vote when the
    scaler skipped optimizer.step() for an inf."""
    if not run._commit():
        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
        return None
    return orig(scaler, *a, **kw)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    out = []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            out.append(t._local_tensor if hasattr(t, "_local_tensor") else t)
    return out


def _on_device(tree: Any, device_type: str) -> Any:
    """A heal's target: the tensors on the transport's device; any other (on NCCL: the CPU
    RNG states, an optimizer's CPU step counts) is left out. Given a target elsewhere,
    torchft receives onto its own device and leaves the tensor there (torch.set_rng_state
    then refuses a CUDA tensor); given none, it hands back a CPU copy."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: None if isinstance(t, torch.Tensor)
                    and t.device.type != device_type else t, tree)


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _create_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give an optimizer that has never stepped its state tensors (Adam's moments, ...)
    without changing anything it trains: one step of the optimizer's own class with zero
    gradients and a learning rate of 0 (as DCP does before loading into an optimizer).
    The step bypasses the commit gate and any scheduler's wrapper. Left as it is when it
    has state, or gradients (mid-step)."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return
    lrs = [g.get("lr") for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            type(opt).step(opt)
    finally:
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p in params:
            p.grad = None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DDP) else model


class QuorumLoader:
    """FtRun.dataloader(): see there."""

    def __init__(self, run: FtRun, dataset: Any, kwargs: dict[str, Any]):
        self.run, self.dataset, self.kwargs = run, dataset, kwargs

    def __iter__(self) -> _QuorumLoaderIter:
        return _QuorumLoaderIter(self)


class _QuorumLoaderIter:
    """Yields the batches of the run's current step. `_at` is the step (and split) whose
    batches the DataLoader yields next, `_left` how many of them are still due; when the
    run is somewhere else at a next(), the DataLoader is replaced by one starting there."""

    def __init__(self, loader: QuorumLoader):
        self.loader = loader
        self._it: Any = None
        self._at: tuple[int, int, int, int, int] | None = None
        self._left = 0
        self.restarts = 0  # DataLoaders started (for tests)

    def __iter__(self) -> _QuorumLoaderIter:
        return self

    def _batches(self, at: tuple[int, int, int, int, int]) -> int:
        """How many batches ElasticBatchSampler yields for the step at `at`."""
        r = self.loader.run
        _, _, offset, world, rank = at
        sl = micro_slices(min(r.global_batch, r.dataset_size - offset), world, rank,
                          r.micro_batch)
        return 1 if sl[0][0] == sl[0][1] else sum(1 for a, b in sl if b > a)

    def __next__(self) -> Any:
        from torch.utils.data import DataLoader

        r = self.loader.run
        here = (r.step, r.epoch, r.offset, r.dp_world, r.dp_rank)
        if self._it is None or self._at != here:
            self._it = None  # its workers stop before the next ones start
            g = torch.Generator()
            g.manual_seed(r.seed * 1_000_003 + r.step)
            sampler = ElasticBatchSampler(
                r.dataset_size, r.global_batch, r.seed, r.dp_world, r.dp_rank,
                micro_batch=r.micro_batch, epoch=r.epoch, offset=r.offset, step=r.step,
                max_steps=r.max_steps or None, epochs=r.epochs)
            self._it = iter(DataLoader(self.loader.dataset, batch_sampler=sampler, generator=g,
                                       **self.loader.kwargs))
            self._at, self._left = here, self._batches(here)
            self.restarts += 1
        batch = next(self._it)
        self._left -= 1
        if self._left == 0:  # the step's last batch: the DataLoader goes on to the next step
            step, epoch, offset, world, rank = self._at
            offset += min(r.global_batch, r.dataset_size - offset)
            if offset >= r.dataset_size:
                epoch, offset = epoch + 1, 0
            self._at = (step + 1, epoch, offset, world, rank)
            self._left = self._batches(self._at)
        return batch


class FtRun(Run):
    """Run on the torchft engine. Same constructor and loop as Run (see spotctl.elastic)."""

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

        from torchft import Manager, ProcessGroupNCCL
        from torchft import manager as ft_manager
        from torchft.checkpointing.pg_transport import PGTransport

        env = os.environ
        if not env.get("TORCHFT_LIGHTHOUSE"):
            raise SystemExit("spotctl.elastic: SPOTCTL_ENGINE=torchft needs TORCHFT_LIGHTHOUSE "
                             "(the head's Lighthouse address; the agent sets it)")
        # [train] sync: "ddp" (every step across replica groups) or groups that train on
        # their own and sync every H steps (spotctl.elastic.outer); _wrap reads it
        self.sync = SyncConfig.from_env(env)
        # the replica group's own process group, wrappers, state parts, checkpointer
        t_init = self._setup(
            model, optimizer, dataset_size, global_batch, seed, epochs, max_steps,
            checkpoint_every, checkpoint_dir, keep_last, micro_batch=micro_batch, mesh=mesh,
            dp_dim=dp_dim, schedulers=schedulers, scaler=scaler, state=state, timeout_s=timeout_s,
            checkpoint_every_s=checkpoint_every_s, reduce_dtype=reduce_dtype,
        )  # fmt: skip
        # per step: the commit vote (None until taken) and the quorum's shape
        self._decision: bool | None = None
        self.replicas = 0
        self.replica_rank: int | None = None
        self.failed_steps = 0
        self._quorum_seen: int | None = None
        # the pause of the last regroup this replica went through, measured by itself:
        # the gap between its last commit in the old quorum and its first in the new,
        # less its usual step time then (a join's pause too, which the head cannot time:
        # torchft regroups before the head learns why)
        self.regroup_pause_s: float | None = None
        self._last_commit_t: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=20)
        self._regroup_from: tuple[float, float] | None = None
        # seconds the last next_step() waited for its (synchronous) quorum: the per-step
        # price of splitting each step's batch over its quorum (scripts/bench quorum)
        self.quorum_s = 0.0
        # a periodic checkpoint's step, saved once this replica has asked for the next
        # quorum (see _save_due_checkpoint)
        self._save_due: int | None = None
        # diloco/localsgd: the synced parameters and the outer optimizer, the state of the
        # round's start (what a sync nobody applies rewinds to), the syncs that failed and
        # the local steps they dropped
        self._outer = (OuterSync(list(_unwrap(self.model).named_parameters()), self.sync)
                       if self.sync.local else None)
        self._round: dict[str, Any] | None = None
        self._outer_in_ckpt = True  # (False while restoring a checkpoint written on ddp)
        self.failed_syncs = 0
        self.dropped_steps = 0
        self._drop_agreed = False  # a notice in a round: leave now, its local steps dropped
        self.notice_dropped: int | None = None  # ... how many (reported: a notice_drop event)
        self.sync_s = 0.0  # seconds the last sync took (its averaging and vote)
        t_restore = time.time()
        self.resume_step = self._restore()  # the last committed checkpoint, if any
        if self._outer is not None:
            self._outer.save()  # a checkpoint is written at a sync: its model is the synced one
        # as on the restart path: a periodic save copies parameters and optimizer state
        # while the next step's forward and backward run, and each optimizer's step()
        # waits for that copy (not one synchronous copy of the whole state per save)
        self.ckpt.guard(self.optimizers)
        t_ready = time.time()

        host = _manager_host(env)
        ft_manager.ManagerServer = _bound_manager_server(host)  # type: ignore[attr-defined]
        ft_manager.ManagerClient = _HealMetadata  # type: ignore[attr-defined,misc]
        # across replicas: NCCL with CUDA (torchft's abortable, reconfigurable wrapper),
        # gloo on CPU; SPOTCTL_FT_PG overrides
        backend = env.get("SPOTCTL_FT_PG") or ("nccl" if self.device.type == "cuda" else "gloo")
        self.ft_timeout_s = timeout = ft_timeout_s(self.device)
        if backend == "nccl":
            # torchft warns and sets it itself when unset: its bound on a non-blocking op
            env.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(timeout))
            # c10d's watchdog, by default, takes the process down at a collective's error:
            # a replica that died mid-collective (its connections closed) would take every
            # survivor with it, before the watch or torchft could fail the step. Clean-up
            # only (abort the communicator, raise in the step) leaves that to them. Read
            # as each NCCL group is made: torchft's, made at each quorum, and later ones.
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            self._ft_pg = ProcessGroupNCCL(timeout=timedelta(seconds=timeout))
        elif backend == "gloo":
            self._ft_pg = _gloo_group(timeout)
        else:
            raise SystemExit(f"spotctl.elastic: SPOTCTL_FT_PG must be nccl or gloo, not {backend!r}")
        self._ft_device = self.device if backend == "nccl" else torch.device("cpu")
        # live recovery over the same group: tensors go through it on its device, received
        # in place into this replica's own state (_heal_target), not into new host memory
        # that is then copied to the device
        self.healed_in_place: tuple[int, int] | None = None
        self._heal_storages: set[int] | None = None
        # what a peer sends beside the tensors is loaded as metadata, never as code
        peerload.install()
        transport = PGTransport(self._ft_pg, timeout=timedelta(seconds=timeout),
                                device=self.device if backend == "nccl" else torch.device("cpu"),
                                state_dict=self._heal_target)
        _HealMetadata.metadata = transport.metadata()
        self.manager = Manager(
            pg=self._ft_pg,
            load_state_dict=self._load_live,
            state_dict=self._live_state,
            min_replica_size=int(env.get("SPOTCTL_FT_MIN_REPLICAS", "1")),
            # the quorum decides this step's data split: wait for it before the batch
            use_async_quorum=False,
            timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=FT_QUORUM_TIMEOUT_S),
            quorum_retries=max(0, int(FT_QUORUM_TIMEOUT_S / max(FT_QUORUM_RETRY_S, 0.1)) - 1),
            connect_timeout=timedelta(seconds=FT_CONNECT_TIMEOUT_S),
            # its Rust side heartbeats the Lighthouse this often: a silent replica is gone
            # after the Lighthouse's heartbeat timeout (250 ms), a heartbeating one is
            # waited for (spotctl.head.lighthouse)
            heartbeat_interval=timedelta(milliseconds=float(
                env.get("SPOTCTL_FT_HEARTBEAT_INTERVAL_MS", "50"))),
            replica_id=env.get("SPOTCTL_FT_REPLICA_ID") or env.get("SPOTCTL_NODE_ID") or None,
            hostname=host,
            checkpoint_transport=transport,
        )
        # the Manager's address as the group's store gives it to the group's workers (a
        # spanning group's: the filter on its first node), for the worker's report
        try:
            self.manager_address = self.manager._store.get("manager_addr").decode()
        except Exception:  # noqa: BLE001 - torchft's internals; the report goes without
            self.manager_address = ""
        self._quorums = UniqueQuorums(self.manager._client)
        self.manager._client = self._quorums
        # a quorum member that stops heartbeating while a collective waits for it fails
        # the step at once, not after the timeout above
        self._watch = Watch(env["TORCHFT_LIGHTHOUSE"], self.manager._replica_id or "",
                            lambda: self._quorums.replica_ids, self._replica_gone,
                            device=self._ft_device)
        # torchft's step: committed steps, or on diloco/localsgd committed syncs (the
        # outer step); a replica behind the quorum's largest heals from a peer
        self.manager.load_state_dict({"step": self.outer_step if self._outer else self.step,
                                      "batches_committed": 0})
        for o in self.optimizers:
            o.step = self._gated(o.step)  # type: ignore[method-assign]
        for s in self.schedulers:
            _gate(s, self, "step", _scheduler_step)
        if self.scaler is not None:
            _gate(self.scaler, self, "update", _scaler_update)
        t_proc = _process_start_time()
        self.startup = {
            "imports": 0.0,
            "process_group": round(t_restore - t_init, 3),
            "restore": round(t_ready - t_restore, 3),
            "started_at": round(t_proc, 3),
            "forked_warm": False,
        }
        self._t_ready = t_ready
        # "init" until the first quorum: before it this replica is in no group, and a report
        # of phase "train" here (rank 0, world 1, the torchrun incarnation) made the head
        # take a starting joiner for a new one-replica worker group, ignore the survivors'
        # reports as an old group's, and record the join as 1 -> N
        self.phase = "init"
        self._report(force=True)
        # a new cluster starts together: the first quorum waits (bounded) for the replicas
        # started with it, instead of one replica training and the others healing in
        # (nodes launched together; a replica group may span several)
        _await_start_peers(env["TORCHFT_LIGHTHOUSE"],
                           int(env.get("SPOTCTL_FT_START_REPLICAS") or 0)
                           // max(1, int(env.get("SPOTCTL_FT_REPLICA_NODES") or 1)),
                           float(env.get("SPOTCTL_FT_START_WAIT_S", "30")))

    # -- setup
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Inside a replica group as on the restart path (DDP over the group's ranks, or
        FSDP2/DTensor as given), with the cross-replica average added to the gradient
        reduction that runs during backward (as HSDP does): when backward returns, every
        gradient is the mean over the whole global batch, before any user code (clipping,
        a GradScaler's unscale, a norm log) reads it. A one-process replica is wrapped too,
        for the same hook."""
        self._grads_synced = False
        if self.sync.local:  # groups train on their own: inside the group as on torchrun
            return Run._wrap(self, model)
        if _is_sharded(model):
            self._hook_fsdp(model)
            return model
        if isinstance(model, DDP):
            if not model.find_unused_parameters:
                raise ValueError(
                    "spotctl.elastic on the torchft engine: pass the plain module (spotctl "
                    "wraps it in DDP), or a DDP built with find_unused_parameters=True: "
                    "DDP otherwise re-orders its gradient buckets after its first step, and "
                    "a replica that joins later would average gradients misaligned with "
                    "its peers'")
            model.register_comm_hook(None, self._ddp_hook)
            return model
        if self.local_dp_world != self.world:
            raise ValueError("a plain module is wrapped in DDP over every rank of the replica: "
                             "pass a module you parallelised yourself when the mesh has "
                             "other dimensions")
        # find_unused_parameters=True keeps DDP's first bucket layout for good (it rebuilds
        # buckets in gradient-ready order after the first step otherwise): the cross-replica
        # reduction goes bucket by bucket, and a joiner's buckets must match its peers'
        if self.device.type == "cuda":
            model.to(self.device)
            ddp = DDP(model, device_ids=[self.device.index], output_device=self.device.index,
                      find_unused_parameters=True)
        else:
            ddp = DDP(model, find_unused_parameters=True)
        ddp.register_comm_hook(None, self._ddp_hook)
        return ddp

    def _hook_fsdp(self, model: torch.nn.Module) -> None:
        """FSDP2 inside the replica: the cross-replica average runs on each reduce-scattered
        gradient shard, in FSDP's own reduction during backward. A model FSDP cannot hook
        (several parameter groups per module), or DTensors without FSDP, are averaged by
        sync_grads() (explicit, or at the first optimizer step)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            return
        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        try:
            for m in mods:
                m.set_all_reduce_hook(self._fsdp_hook)
        except (ValueError, AttributeError) as e:
            log.warning("FSDP all-reduce hook unavailable (%s): gradients are averaged "
                        "across replicas at sync_grads() or the optimizer step", e)
            for m in mods:
                for g in m._get_fsdp_state()._fsdp_param_groups:  # type: ignore[attr-defined]
                    g._all_reduce_hook = None

    def _ddp_hook(self, _state, bucket):  # type: ignore[no-untyped-def]
        # (no annotations: DDP checks a hook's against dist.GradBucket and Future, and this
        # module's are strings)
        buf = bucket.buffer()
        # reduce_dtype: the mean is taken in that dtype (inside the replica and across
        # replicas) and written back into the bucket in its own
        wire = self._on_wire(buf)
        if self.world > 1:  # the replica's own ranks first, as DDP's default hook does
            wire.div_(self.world)
            dist.all_reduce(wire)
        fut = self._cross_replica_future(wire)
        if wire is buf:
            return fut
        return fut.then(lambda f: buf.copy_(f.value()))

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.reduce_dtype in (None, t.dtype) else t.to(self.reduce_dtype)

    def _fsdp_hook(self, reduced: torch.Tensor) -> None:
        if reduced.is_cuda:
            # made on FSDP's reduce-scatter stream, reduced on this one: without the mark
            # the allocator could hand it to the next reduce-scatter (FSDP drops it once
            # cast to the parameters' dtype) while the cross-replica reduction still runs
            reduced.record_stream(torch.cuda.current_stream())
        wire = self._on_wire(reduced)
        self._cross_replica_mean(wire)
        if wire is not reduced:
            reduced.copy_(wire)

    def _cross_replica_future(self, t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Start averaging `t` across replicas and return a future of it, not waited here:
        DDP waits for every bucket's at the end of backward, so the reduction of one bucket
        overlaps the backward of the next. On an error the future completes with `t` as it
        is and the Manager has the error (the step's vote fails, everyone runs it again).
        On CUDA the collective is waited for as torchft's own DDP hook does (the wait orders
        streams; the host goes on)."""
        work = self.manager.allreduce(t)
        self._grads_synced = True
        # the process group's own work; none when torchft skipped the collective (this
        # step failed already: its work is done, and waiting on it returns at once)
        inner = getattr(work, "_work", None)
        if t.device.type == "cuda" or inner is None:
            with self._watch.watching():
                work.wait()
            self._track()
            fut = getattr(work.get_future(), "_fut", None)
            if fut is None:  # torchft failed before its chain existed: the vote fails
                fut = torch.futures.Future()
                fut.set_result(t)
            return fut  # type: ignore[no-any-return]
        # torchft's Work builds its averaging chain only once the collective is done (its
        # callbacks read a loop variable), so the chain here is our own: sum, then divide
        n = self.manager.num_participants()

        def average(f: torch.futures.Future[Any]) -> torch.Tensor:
            f.value()  # raises the collective's error, for wrap_future to report
            return t.div_(n)

        return self.manager.wrap_future(self._watch.guard(inner.get_future()).then(average), t)

    def _cross_replica_mean(self, t: torch.Tensor) -> None:
        """Average `t` in place over the quorum's participating replicas. On an error the
        values are garbage and the step's vote fails: everyone runs the step again."""
        self._wait(self.manager.allreduce(t))
        self._grads_synced = True

    def _wait(self, work: Any, host: bool = False) -> None:
        """Wait for a cross-replica collective: until it completes, or until the watch
        finds a member of the quorum gone (the step then fails, as on a timeout). On
        NCCL the watch aborts the group, which ends the wait. NCCL's wait only orders
        the current stream after the collective; `host`: the host waits for it too (a
        value read next, such as whether it failed)."""
        inner = getattr(work, "_work", None)
        if inner is None or self._ft_device.type == "cuda":
            with self._watch.watching():
                work.wait()
                if host and self._ft_device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                    # an abort at torchft's own timeout marks only its group
                    if (err := self._ft_pg.errored()) is not None:
                        self.manager.report_error(err)
            if not host:
                self._track()
            return
        try:
            self._watch.guard(inner.get_future()).wait()
        except Exception as e:  # noqa: BLE001 - reported: the step's vote fails
            self.manager.report_error(e)
            return
        work.wait()  # done: runs torchft's own continuation (an average's division)

    def _track(self) -> None:
        """NCCL: the collective just waited for only ordered the current stream; the watch
        looks until the stream has passed it, wherever the host then blocks."""
        if self._ft_device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record()
        self._watch.track(ev.query)

    def _replica_gone(self, err: Exception) -> None:
        self.manager.report_error(err)
        if self._ft_device.type == "cuda":
            self._ft_pg.abort()  # NCCL: ends the collective the host waits on

    # -- live recovery: what a joiner receives from a peer (same local rank)
    def _live_state(self) -> dict[str, Any]:
        # native state dicts: DCP's get_state_dict would initialise an empty optimizer
        # with a zero-gradient step (at step 0 a peer may be asked for its state)
        return {
            "model": _unwrap(self.model).state_dict(),
            "optim": [o.state_dict() for o in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "user": {k: v.state_dict() for k, v in self.user_state.items()},
            "rng": _rng_state(),
            "pos": {"step": self.step, "epoch": self.epoch, "offset": self.offset,
                    "seed": self.seed, "global_batch": self.global_batch,
                    "dataset_size": self.dataset_size},
            # diloco/localsgd: a heal is at a round's start, where the model is the synced
            # one; the outer optimizer's state and step come with it
            "outer": self._outer.state() if self._outer is not None else {},
        }

    def _state(self, with_extra: bool = True) -> dict[str, Any]:
        st = super()._state(with_extra)
        if getattr(self, "_outer", None) is not None and self._outer_in_ckpt:
            st["outer"] = self._outer.state()  # type: ignore[union-attr]
        return st

    def _restore(self) -> int:
        """As Run's; diloco/localsgd resuming from a checkpoint written on ddp (a job
        switched to it) starts its outer optimizer fresh (the checkpoint has none)."""
        steps = self.ckpt.committed_list()
        if self._outer is not None and steps:
            meta = [self.ckpt.read_meta(steps[0]) if self.rank == 0 else None]
            dist.broadcast_object_list(meta, src=0, group=self.ctl_pg)
            self._outer_in_ckpt = (meta[0] or {}).get("sync", "ddp") != "ddp"
        try:
            return super()._restore()
        finally:
            self._outer_in_ckpt = True

    def _meta(self) -> dict[str, Any]:
        return {**super()._meta(), "sync": self.sync.mode, "sync_every": self.sync.every}

    @property
    def outer_step(self) -> int:
        """Syncs committed (diloco/localsgd; 0 on ddp)."""
        return int(self._outer.step) if self._outer is not None else 0

    def _heal_target(self) -> dict[str, Any]:
        """What a heal receives into: the live state, with each optimizer's state made
        first if it has none yet (a joiner's), so that the optimizer's tensors are received
        in place too, on their device."""
        # a save's copy still in flight must finish before its tensors are overwritten
        self.ckpt.wait_staged()
        for o in self.optimizers:
            _create_optimizer_state(o)
        st = _on_device(self._live_state(), self._ft_device.type)
        self._heal_storages = {_storage(t) for t in _tensor_leaves(st)}
        # the shape torchft sends (Manager._manager_state_dict): ours under "default"
        return {"user": {"default": st}, "torchft": {}}

    def _load_live(self, st: dict[str, Any]) -> None:
        if self._heal_storages is not None:  # how much of the heal landed in place
            got = _tensor_leaves(st)
            self.healed_in_place = (sum(_storage(t) in self._heal_storages for t in got), len(got))
            self._heal_storages = None
        pos = st["pos"]
        self._check_meta(pos, int(pos["step"]))
        _unwrap(self.model).load_state_dict(st["model"])
        self._load_inner(st)
        if self._outer is not None:
            self._outer.load(st.get("outer") or {})
        self.step, self.epoch, self.offset = int(pos["step"]), int(pos["epoch"]), int(pos["offset"])
        log.info("recovered step %d (epoch %d offset %d) from a live peer", self.step,
                 self.epoch, self.offset)

    # -- per step
    def next_step(self) -> bool:
        # diloco/localsgd: a notice is taken at a round's start (the sync before it
        # committed, or failed and was rewound): the group leaves with nothing unsynced
        # unless it drops them ([train] on_notice: spotctl.elastic.outer.notice_action)
        if self._leave_agreed() and (self._round is None or self._drop_agreed):
            self._leave()
        if self.max_steps and self.step >= self.max_steps:
            return False
        if self.epoch >= self.epochs:
            return False
        self._decision = None
        self._grads_synced = False
        if self._outer is not None and self._round is not None:
            self.quorum_s = 0.0  # inside a round: no quorum, the round's split holds
            self.ckpt.poll()  # (a save started at the round's start commits when written)
            return True
        t_quorum = time.perf_counter()
        self.manager.start_quorum()  # sync: quorum, PG reconfigure, healing applied
        self.quorum_s = time.perf_counter() - t_quorum
        # (diloco/localsgd: torchft's step is the outer step; a heal set the position)
        now = self.manager.current_step() if self._outer is None else self.step
        self._save_due_checkpoint(now)
        self.ckpt.poll()
        self.step = now
        self.replicas = max(1, self.manager.num_participants())
        r = self.manager.participating_rank()
        self.replica_rank = r
        self.phase = "train"
        self.dp_world = self.replicas * self.local_dp_world
        self.dp_rank = (r or 0) * self.local_dp_world + self.local_dp_rank
        qid = self.manager._quorum_id
        if qid != self._quorum_seen:
            # a new membership: reported to the head as a new worker group, so a rescale
            # event records it (from the first step committed in it)
            self._quorum_seen = qid
            # the Lighthouse's own quorum number, then the spotctl id that stays unique
            # when a restarted Lighthouse numbers from 1 again
            self.incarnation = f"ft-q{self._quorums.lighthouse_quorum_id}-{qid:012x}"
            self.resume_step = self.step
            self.first_step_at = None
            if self._last_commit_t is not None:
                usual = statistics.median(self._gaps) if self._gaps else 0.0
                self._regroup_from = (self._last_commit_t, usual)
            self._gaps.clear()
        if self.max_steps and self.step >= self.max_steps:  # healed to the end
            return False
        if self._outer is not None:
            self._begin_round()
        return True

    # -- diloco/localsgd: rounds of local steps, a sync at the end of each
    def _load_inner(self, st: dict[str, Any]) -> None:
        """The optimizers, schedulers, scaler, user state and RNG from `st` (a heal's state,
        or a round's start that a failed sync rewinds to)."""
        for o, sd in zip(self.optimizers, st["optim"], strict=True):
            o.load_state_dict(sd)
        for s, sd in zip(self.schedulers, st["schedulers"], strict=True):
            s.load_state_dict(sd)
        if self.scaler is not None and st.get("scaler"):
            self.scaler.load_state_dict(st["scaler"])
        for k, obj in self.user_state.items():
            if k in st["user"]:
                obj.load_state_dict(st["user"][k])
        _set_rng_state(st["rng"])

    def _begin_round(self) -> None:
        """The state a sync nobody applies rewinds to (beside the synced parameters): the
        position, the inner optimizers, schedulers, scaler, user state and RNG, copied to
        the CPU (one copy of the optimizer state per round)."""
        from torch.utils._pytree import tree_map

        st = self._live_state()
        del st["model"], st["outer"]
        self._round = {
            "pos": (self.step, self.epoch, self.offset),
            "state": tree_map(lambda t: t.detach().to("cpu", copy=True)
                              if isinstance(t, torch.Tensor) else t, st),
        }

    def _sync_due(self) -> bool:
        assert self._round is not None
        return (self.step - self._round["pos"][0] >= self.sync.every
                or bool(self.max_steps and self.step >= self.max_steps)
                or self.epoch >= self.epochs)

    def _average_across_groups(self, tensors: list[torch.Tensor]) -> bool:
        """Average `tensors` in place over the quorum's replica groups (one collective per
        dtype), then torchft's commit vote: whether every group applies the sync."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        works = []
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts]).to(self._ft_device)
            works.append((ts, flat, self.manager.allreduce(flat)))
        for ts, flat, w in works:
            self._wait(w, host=True)
            if self.manager.errored():
                continue
            i = 0
            for t in ts:
                t.copy_(flat[i : i + t.numel()].view_as(t))
                i += t.numel()
        if self._ft_device.type == "cuda":
            with self._watch.watching():
                torch.cuda.current_stream().synchronize()
        return bool(self.manager.should_commit())

    def _sync_round(self) -> bool:
        """The round's sync: committed, or rewound by every group to the round's start
        (a group gone mid-round: its samples of the round are trained again by the next
        quorum's groups, so none is lost or counted twice)."""
        assert self._outer is not None and self._round is not None
        t0 = time.perf_counter()
        ok = self._outer.sync(self._average_across_groups)
        self.sync_s = time.perf_counter() - t0
        if ok:
            self._round = None
            return True
        start, epoch, offset = self._round["pos"]
        st = self._round["state"]
        self._load_inner(st)
        self.failed_syncs += 1
        self.dropped_steps += self.step - start
        if self.rank == 0:
            log.warning("sync at step %d not committed (%s): the %d local steps since step %d "
                        "are dropped and trained again", self.step, self.manager.errored(),
                        self.step - start, start)
        self.step, self.epoch, self.offset = start, epoch, offset
        self._round = None
        self._report(force=True)
        return False

    def batch_sampler(self) -> Any:
        # a DataLoader prefetches from its sampler for a fixed split; here the split
        # changes with every quorum: run.dataloader() follows it
        raise NotImplementedError(
            "spotctl.elastic on the torchft engine: batch_sampler() is not supported (a "
            "sampler is read ahead for a fixed split, and the split changes with every "
            "quorum); use run.dataloader(dataset, ...), run.batch_indices() or "
            "run.micro_batches()")

    def dataloader(self, dataset: Any, **kwargs: Any) -> QuorumLoader:
        """An iterable of this worker's micro-batches, in the run's exact order, from
        DataLoaders over `dataset` (kwargs: num_workers, pin_memory, collate_fn...): one is
        kept while the quorum and the step sequence hold (its workers prefetch), and a new
        one starts at the run's position when they change (a join, a leave, a redone or
        healed step). Use it as on the restart path: run.micro_batches(iter(loader))."""
        return QuorumLoader(self, dataset, kwargs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and self.replica_rank == 0

    def _reduce(self, t: torch.Tensor, op: str) -> None:
        """Inside the replica group, then across the quorum's replicas (torchft's group:
        on NCCL the value travels on this worker's GPU)."""
        super()._reduce(t, op)
        if self._outer is not None:
            return  # diloco/localsgd: this group's ranks only (no per-step cross-group traffic)
        dev = t.device
        x = t.to(self._ft_device)
        rop = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "max": ReduceOp.MAX,
               "min": ReduceOp.MIN}[op]
        # (host: all_reduce reads whether it failed next)
        self._wait(self.manager.allreduce(x, reduce_op=rop), host=True)
        t.copy_(x.to(dev))

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """As on the restart path, except when a replica failed during the step: torchft's
        collectives are no-ops from the first error on, so the sum holds this replica's
        part alone. The value across the job is unknown: NaN (a tensor of integers comes
        back as a float64 tensor of NaN), never a partial sum that looks like a real one."""
        if self._outer is not None:
            # diloco/localsgd: over this replica group's ranks only (its own mean for "mean")
            if op != "mean":
                return super().all_reduce(value, op)
            total = super().all_reduce(value, "sum")
            return total / self.local_dp_world
        out = super().all_reduce(value, op)
        if self.manager.errored() is None:
            return out
        log.warning("run.all_reduce: a replica failed during step %d; its value is NaN",
                    self.step + 1)
        if not isinstance(value, torch.Tensor):
            return float("nan")
        dtype = out.dtype if out.is_floating_point() else torch.float64
        return torch.full(value.shape, float("nan"), dtype=dtype, device=value.device)

    def _leave_agreed(self) -> bool:
        """The control flags agreed over the group's ranks (a notice came...), and on
        diloco/localsgd whether a rank's notice drops the round (_drop_agreed)."""
        flag = self._control_flags()
        if self._outer is not None:  # (ddp's steps have no round to drop: no 4th flag)
            flag = torch.cat([flag, torch.tensor([1 if self._notice_drop_vote() else 0],
                                                 dtype=torch.int32)])
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctl_pg)
        self._drop_agreed = self._outer is not None and bool(flag[3].item())
        return self._take_flags(flag)

    def _notice_drop_vote(self) -> bool:
        """diloco/localsgd, a notice in the middle of a round: whether this rank would leave
        now, dropping the round's local steps, rather than at the round's sync."""
        if not self.drain_requested or self._outer is None or self._round is None:
            return False
        left = self._round["pos"][0] + self.sync.every - self.step
        if self.max_steps:
            left = min(left, self.max_steps - self.step)
        step_s = statistics.median(self._gaps) if self._gaps else 0.0
        return notice_action(self.sync.on_notice, notice_lead(), left, step_s,
                             self.sync_s) == "drop"

    def _gated(self, step_fn: Any) -> Any:
        def step(*a: Any, **kw: Any) -> Any:
            if self._commit():
                return step_fn(*a, **kw)
            return None
        # an LR scheduler made before the Run wrapped optimizer.step to see it called; its
        # mark stays (step_fn still calls that wrapper), or the scheduler's first step
        # would warn that optimizer.step() was overridden after it
        if getattr(step_fn, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        return step

    def _commit(self) -> bool:
        """torchft's commit vote: the first optimizer.step() of a step takes it (gradients
        already averaged across replicas during backward), the others follow it."""
        if self._decision is None and self._outer is not None:
            self._decision = True  # a local step: no vote (the sync has one)
        if self._decision is None:
            self.sync_grads()
            if self._ft_device.type == "cuda":
                # NCCL's waits only order streams: the host waits here (should_commit
                # would, unwatched), so the watch looks meanwhile and a replica gone
                # mid-step aborts the group instead of holding everyone to the timeout
                with self._watch.watching():
                    torch.cuda.current_stream().synchronize()
            self._decision = bool(self.manager.should_commit())
        return self._decision

    def sync_grads(self) -> None:
        """Average this step's gradients over the quorum's replicas now, unless backward did
        (the wrapped model's reduction does it whenever it can). For models spotctl cannot
        hook: call it between backward() and any code that reads gradients."""
        if not self._grads_synced and self._outer is None:
            self._allreduce_grads()
            self._grads_synced = True

    def _allreduce_grads(self) -> None:
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in _unwrap(self.model).parameters():
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "to_local"):  # DTensor (FSDP2 inside the replica): same shards
                g = g.to_local()
            grads.setdefault(g.dtype, []).append(g)
        works = []
        for gs in grads.values():
            flat = self._on_wire(torch.cat([g.reshape(-1) for g in gs]))
            works.append((gs, flat, self.manager.allreduce(flat)))
        for gs, flat, w in works:
            self._wait(w)
            if self.manager.errored():
                continue
            i = 0
            for g in gs:
                n = g.numel()
                g.copy_(flat[i : i + n].view_as(g))
                i += n

    def end_step(self, loss: float | torch.Tensor | None = None) -> None:
        if self._decision is None:
            self._commit()  # the script stepped no optimizer (a skipped scaler step)
        if not self._decision:
            self.failed_steps += 1
            if self.rank == 0:
                log.warning("step %d not committed (%s); running it again", self.step,
                            self.manager.errored())
            self._decision = None
            self._report()
            return
        self._decision = None
        n = self.step_samples
        self.step += 1
        self.offset += n
        self._rate_samples += n
        if self.offset >= self.dataset_size:
            self.epoch += 1
            self.offset = 0
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        t = time.time()
        if self.first_step_at is None:
            self.first_step_at = t
            self.startup["first_step"] = round(self.first_step_at - self._t_ready, 3)
            if self._regroup_from is not None:
                since, usual = self._regroup_from
                self.regroup_pause_s = round(max(0.0, t - since - usual), 3)
                self._regroup_from = None
            self._report(force=True)
        elif self._last_commit_t is not None:
            self._gaps.append(t - self._last_commit_t)
        self._last_commit_t = t
        if self._outer is not None:
            assert self._round is not None
            if not self._sync_due():
                self._report()
                return
            since = self._round["pos"][0]
            if not self._sync_round():
                return
            # saved at syncs only (the model is then the synced one): when a multiple of
            # checkpoint_every (or the timer) fell in the round
            if self.step // self.every > since // self.every:
                self._save_owed = True
        # (every replica keeps the timer in step; replica 0 of the quorum saves)
        if self._save_now() and self.replica_rank == 0:
            self._save_due = self.step
        self._report()

    def _save_due_checkpoint(self, now: int) -> None:
        """The periodic checkpoint of the last committed step, started after this replica
        asked for the next quorum, not before: the save's blocking part and the commit of
        the one before it (poll) would make the saving replica late to that quorum, and a
        replica more than the Lighthouse's join timeout late is left out of it and heals
        back at the next (seen under load). `now`: the step after the quorum; a replica
        healed to another step no longer holds the due step's state and skips it."""
        due, self._save_due = self._save_due, None
        if due is None or now != due:
            return
        self.ckpt.save_async(due, self._state(), self._meta())

    def _leave(self) -> None:
        """A notice: the last step is committed; leave the quorum and exit. The survivors
        form their next quorum without this replica and go on from memory."""
        self._save_due_checkpoint(self.step)  # a due checkpoint is written before leaving
        self.drain_step = self.step
        if self._round is not None:
            # diloco/localsgd, on_notice dropped the round: the group's state is the last
            # synced one; the others' sync of this round fails, they train it again
            start = self._round["pos"][0]
            self.notice_dropped = self.step - start
            self.drain_step = start
            if self.rank == 0:
                log.warning("notice at step %d, in a round: leaving now, the %d local steps "
                            "since the sync at step %d dropped", self.step,
                            self.notice_dropped, start)
        self.phase = "drained"  # the head knows this phase: stopped after a commit
        self._report(force=True)
        if self.rank == 0:
            log.info("left the quorum after step %d", self.step)
        # heartbeats stop first: the Lighthouse waits (its long join timeout) for a replica
        # that still heartbeats, so the survivors would wait out a save in flight here
        try:
            self.manager.shutdown(wait=False)
        finally:
            self.ckpt.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _report(self, force: bool = False) -> None:
        """As Run's, with the quorum's view: rank and world size over every replica (the
        head counts one worker group), the quorum as the incarnation, replicas."""
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
        rank = (self.replica_rank or 0) * self.world + self.rank
        rep = {
            "rank": rank, "local_rank": self.local_rank,
            "world_size": max(1, self.replicas) * self.world,
            "step": self.step, "phase": self.phase, "incarnation": self.incarnation,
            "resume_step": getattr(self, "resume_step", 0), "first_step_at": self.first_step_at,
            "last_ckpt": self.ckpt.last_committed, "loss": loss_value(self.loss),
            "throughput": self.throughput, "drain_step": self.drain_step, "pid": os.getpid(),
            "epoch": self.epoch, "offset": self.offset,
            "startup": getattr(self, "startup", None), "engine": "torchft",
            "replicas": self.replicas, "failed_steps": self.failed_steps, "micro_batch": self.micro_batch,
            "regroup_pause_s": self.regroup_pause_s,
            "manager": getattr(self, "manager_address", ""),
            "sync": self.sync.mode, "outer_step": self.outer_step,
            "failed_syncs": self.failed_syncs, "dropped_steps": self.dropped_steps,
            "notice_dropped": self.notice_dropped,
            "sync_s": round(self.sync_s, 4),
        }
        write_status(self.status_dir, self.local_rank, rep)

    def finish(self) -> None:
        """End of training: the replica of rank 0 in the last quorum writes the final
        checkpoint; every replica then exits 0."""
        self._save_due = None  # the final checkpoint below is of the same step or newer
        if self.step > 0 and self.replica_rank == 0:
            self.ckpt.save_sync(self.step, self._state(), self._meta())
        self.ckpt.close()
        self.phase = "done"
        self._report(force=True)
        self._close_cross_replica()
        dist.barrier(group=self.ctl_pg)
        dist.destroy_process_group()

    def _close_cross_replica(self) -> None:
        """Ends, while the interpreter is fully alive, everything of torchft's and the
        watch's that could call into Python from a thread of its own later: the Manager and
        its executor, the watch's thread, torchft's timeout loop (a timer still pending for
        a collective of a dropped group would fire into torch) and the cross-replica groups,
        the current one and the dropped ones (their gloo threads run the futures' Python
        callbacks when a collective ends, and free tensors Python holds). Left to the
        interpreter's shutdown, any of them taking the GIL then aborts the process
        (`terminate called without an active exception`, exit -6) after training is done.
        A dropped group whose collective a vanished peer never finishes is waited for until
        its own timeout."""
        self.manager.shutdown(wait=True)
        self._watch.close()
        _stop_timeout_loop()
        t0 = time.monotonic()
        pending = len(getattr(type(self._ft_pg), "dropped", ()))
        _release_groups(self._ft_pg, nccl=self._ft_device.type != "cpu")
        waited = time.monotonic() - t0
        if waited > 1.0:
            log.info("waited %.1f s for %d dropped cross-replica group(s) to end",
                     waited, pending)
