"""Checkpoints with torch.distributed.checkpoint: async periodic saves, sync drain saves,
atomic commit, keep-last-K, resume at any world size, on a local path or an object store.

Layout under the checkpoint root (a path, or an fsspec URL such as s3://bucket/prefix or
gs://bucket/prefix):
    step-00000120/            DCP files (one per rank) + .metadata
    step-00000120/.spotctl-files.json   every file's size and sha256 (spotctl.elastic.ckptsafe)
    step-00000120/COMMIT      written by rank 0 after every rank's data is stored, with
                              those sizes and digests; a load checks the files against it
A step without COMMIT is never loaded. Rank 0 writes COMMIT last, only after DCP's finish
step has gathered all ranks' write results: on a path atomically (tmp+rename, fsync), on an
object store as one PUT (an object appears whole or not at all). A committed step is never
rewritten nor deleted except by keep-last-K pruning, which runs off the training thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from spotctl.elastic.ckptsafe import (  # noqa: E402
    FILES,
    DigestingWriter,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpoint,
    digest_file,
    safe_fsspec_reader,
)

log = logging.getLogger("spotctl.elastic")
COMMIT = "COMMIT"
# DCP raises CheckpointException, a BaseException subclass: catch it, not interrupts
_CKPT_ERRORS: tuple[type[BaseException], ...] = (Exception, dcp.api.CheckpointException)
# a load that fails is retried this many times before an older step is tried
LOAD_ATTEMPTS = int(os.environ.get("SPOTCTL_LOAD_ATTEMPTS", "2"))


def is_url(root: str | os.PathLike[str]) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _parse_step(name: str) -> int | None:
    name = name.rstrip("/").rsplit("/", 1)[-1]
    if not name.startswith("step-"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


# with checkpoint_writers unset (0), one writer per this much of a rank's share
AUTO_FILE_BYTES = 256 << 20


def auto_writers(share_bytes: int, most: int) -> int:
    """Writers for a rank's share of `share_bytes` when none were set: one per
    AUTO_FILE_BYTES, from 1 to `most`. A small model gets one file per rank, not a few
    empty ones."""
    return max(1, min(most, share_bytes // AUTO_FILE_BYTES))


class _AutoWriters:
    """Mixed into DCP's writers: with `auto_most` set, the thread count follows the size
    of this rank's share (auto_writers) when the data is written."""

    auto_most = 0
    thread_count: int

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.auto_most:
            share = 0
            for item in plan.items:
                t = item.tensor_data
                if t is not None:  # BYTE_IO items (small values) count for nothing
                    share += math.prod(t.size) * t.properties.dtype.itemsize
            self.thread_count = auto_writers(share, self.auto_most)
        return super().write_data(plan, planner)  # type: ignore[misc]


class AutoFileSystemWriter(DigestingWriter, _AutoWriters, dcp.FileSystemWriter):
    pass


def _fsspec_writer() -> type:
    """AutoFsspecWriter (on S3 and GCS: files in concurrent parts, spotctl.elastic.parts), made
    on first use (fsspec is optional) and kept as a module
    attribute: the process-based async saver pickles the writer, and unpickling finds
    it there (through __getattr__ in a fresh process)."""
    cls = globals().get("AutoFsspecWriter")
    if cls is None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        from spotctl.elastic.parts import PartsWriterMixin

        cls = type("AutoFsspecWriter",
                   (DigestingWriter, _AutoWriters, PartsWriterMixin, FsspecWriter),
                   {"__module__": __name__})
        globals()["AutoFsspecWriter"] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name == "AutoFsspecWriter":
        return _fsspec_writer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _why(e: BaseException) -> str:
    """One line for a failed load: DCP wraps each rank's error in a CheckpointException
    whose own text names only the ranks."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for f in failures.values():
            inner = f[0] if isinstance(f, tuple) else f
            lines = [ln for ln in str(inner).splitlines() if ln.strip()]
            if lines:
                return lines[-1].strip()
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


class Store:
    """Where checkpoints live: a local (or mounted) directory. `writers`: threads that write
    each rank's share, each to a file of its own (DCP's thread_count); 0 = by the share's
    size (auto_writers), up to `auto_most`."""

    auto_most = 1  # a local disk: one writer unless set

    def __init__(self, root: str | os.PathLike[str], writers: int = 0):
        r = str(root)
        self.root = Path(r[7:] if r.startswith("file://") else r)
        self.writers = writers

    def _writer(self, cls: Any, step: int, **kwargs: Any) -> Any:
        w = cls(self.step_id(step), thread_count=self.writers or 1, **kwargs)
        w.auto_most = 0 if self.writers or self.auto_most <= 1 else self.auto_most
        return w

    def step_id(self, step: int) -> str:
        return str(self.root / _step_name(step))

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def steps(self) -> dict[int, bool]:
        """Every step directory: step -> committed."""
        out: dict[int, bool] = {}
        if not self.root.exists():
            return out
        for p in self.root.iterdir():
            s = _parse_step(p.name)
            if s is not None:
                out[s] = (p / COMMIT).exists()
        return out

    def committed(self, step: int) -> bool:
        return (self.root / _step_name(step) / COMMIT).exists()

    def has_metadata(self, step: int) -> bool:
        return (self.root / _step_name(step) / ".metadata").exists()

    def read_commit(self, step: int) -> dict[str, Any]:
        return json.loads((self.root / _step_name(step) / COMMIT).read_text())

    def write_commit(self, step: int, meta: dict[str, Any]) -> None:
        d = self.root / _step_name(step)
        tmp = d / (COMMIT + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / COMMIT)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, step: int) -> None:
        shutil.rmtree(self.root / _step_name(step), ignore_errors=True)

    def writer(self, step: int) -> Any:
        return self._writer(AutoFileSystemWriter, step)

    def reader(self, step: int) -> Any:
        return SafeFileSystemReader(self.step_id(step))

    def files(self, step: int) -> dict[str, int]:
        """Every file of a step: name -> size."""
        d = self.root / _step_name(step)
        return {p.name: p.stat().st_size for p in d.iterdir() if p.is_file()}

    def open(self, step: int, name: str) -> Any:
        return open(self.root / _step_name(step) / name, "rb")


class FsspecStore(Store):
    """Checkpoints on an object store (s3://, gs://, ...) through fsspec. Storage options
    (an endpoint, credentials) come from SPOTCTL_CHECKPOINT_STORAGE_OPTIONS (JSON) or the
    store's usual environment (AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS...)."""

    auto_most = 4  # each file its own upload: up to 4 in flight per rank unless set

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 writers: int = 0):
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.writers = writers
        env_opts = os.environ.get("SPOTCTL_CHECKPOINT_STORAGE_OPTIONS")
        self.options = dict(storage_options if storage_options is not None
                            else json.loads(env_opts) if env_opts else {})
        # its own instance, without a listings cache: the pruner thread and the training
        # thread list and read concurrently, and other ranks write meanwhile
        self.fs, self.path = url_to_fs(self.url, **{**self.options, "use_listings_cache": False,
                                                    "skip_instance_cache": True})
        self.path = self.path.rstrip("/")

    def _p(self, step: int, name: str = "") -> str:
        p = f"{self.path}/{_step_name(step)}"
        return f"{p}/{name}" if name else p

    def step_id(self, step: int) -> str:
        return f"{self.url}/{_step_name(step)}"

    def prepare(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def _fresh(self) -> None:
        # another rank or process wrote since the last listing: never trust a cached one
        self.fs.invalidate_cache()

    def steps(self) -> dict[int, bool]:
        self._fresh()
        out: dict[int, bool] = {}
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return out
        found = [s for s in (_parse_step(n) for n in names) if s is not None]
        if not found:
            return out
        commits = set()
        for p in self.fs.glob(f"{self.path}/step-*/{COMMIT}"):
            s = _parse_step(p.rsplit("/", 2)[-2])
            if s is not None:
                commits.add(s)
        return {s: s in commits for s in found}

    def committed(self, step: int) -> bool:
        self._fresh()
        return bool(self.fs.exists(self._p(step, COMMIT)))

    def has_metadata(self, step: int) -> bool:
        self._fresh()
        return bool(self.fs.exists(self._p(step, ".metadata")))

    def read_commit(self, step: int) -> dict[str, Any]:
        self._fresh()
        return json.loads(self.fs.cat_file(self._p(step, COMMIT)))

    def write_commit(self, step: int, meta: dict[str, Any]) -> None:
        self.fs.pipe_file(self._p(step, COMMIT), json.dumps(meta).encode())

    def remove(self, step: int) -> None:
        try:
            self.fs.rm(self._p(step), recursive=True)
        except FileNotFoundError:
            pass

    def writer(self, step: int) -> Any:
        # sync_files off: an object is stored once its upload returns, and DCP's fsync of a
        # stream without a file descriptor falls back to os.sync() of the whole machine
        return self._writer(_fsspec_writer(), step, sync_files=False, **self.options)

    def reader(self, step: int) -> Any:
        return safe_fsspec_reader(self.step_id(step), **self.options)

    def files(self, step: int) -> dict[str, int]:
        self._fresh()
        return {str(e["name"]).rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in self.fs.ls(self._p(step), detail=True) if e.get("type") == "file"}

    def open(self, step: int, name: str) -> Any:
        return self.fs.open(self._p(step, name), "rb")


def writers_from_env() -> int:
    """SPOTCTL_CHECKPOINT_WRITERS ([train] checkpoint_writers); 0 or unset: by size."""
    raw = os.environ.get("SPOTCTL_CHECKPOINT_WRITERS", "").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= 64:
        raise ValueError(f"SPOTCTL_CHECKPOINT_WRITERS must be a whole number from 0 to 64, "
                         f"not {raw!r}")
    return n


def open_store(root: str | os.PathLike[str]) -> Store:
    if is_url(root):
        if str(root).startswith(("s3://", "gs://", "gcs://")):
            from spotctl.elastic.parts import part_bytes

            part_bytes()  # a bad SPOTCTL_CHECKPOINT_PART_MB is refused here, not at a save
        return FsspecStore(str(root), writers=writers_from_env())
    if re.match(r"[a-z][a-z0-9+.-]*:/[^/]", str(root)):
        # Path("s3://b/x") is "s3:/b/x": never let that become a local folder named "s3:"
        raise ValueError(f"checkpoint dir {str(root)!r} looks like a URL that lost a '/'; "
                         "pass the URL as a string")
    return Store(root, writers=writers_from_env())


# -- helpers kept for tools and tests that look at a local checkpoint directory
def step_dir(root: Path, step: int) -> Path:
    return Path(root) / _step_name(step)


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """Committed checkpoint steps, newest first."""
    return sorted((s for s, c in open_store(root).steps().items() if c), reverse=True)


def read_commit(root: str | os.PathLike[str], step: int) -> dict[str, Any]:
    return open_store(root).read_commit(step)


def _storage_key(t: torch.Tensor) -> int:
    """The address of a tensor's storage (a DTensor's local shard); 0 when it has none."""
    local = getattr(t, "_local_tensor", t)
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class OverlapStager:
    """A persistent stager (DCP's AsyncStager protocol) that lets the next step's forward
    and backward run while the save's big copy is made.

    Staging buffers are allocated once and reused by every save (torch's StateDictStager
    caches one CPU storage per source storage): pinned host memory where CUDA is
    available, shared memory in process mode so the checkpoint process reads them without
    a copy. Tensors whose storage is in `protected` (the optimizers' parameters and state,
    which only optimizer.step() changes) are copied in a background thread; everything
    else (buffers, which a forward may update; non-tensor values) is copied before
    stage() returns. Whoever changes a protected tensor must call wait() first: the
    Checkpointer does it in an optimizer step pre-hook. With an empty `protected` set the
    whole state is copied before stage() returns (a plain synchronous stager).
    """

    _synchronize_after_execute = False

    def __init__(self, mode: str):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self.cuda = torch.cuda.is_available()
        shm = mode == "process"
        if shm:
            _more_open_files()
        # two caches, one per thread: a StateDictStager is not thread-safe
        self._now = StateDictStager(pin_memory=self.cuda, share_memory=shm)
        self._later = StateDictStager(pin_memory=self.cuda, share_memory=shm)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotctl-stage")
        self._stream: Any = torch.cuda.Stream() if self.cuda else None
        self.protected: set[int] = set()
        self.future: Future[Any] | None = None
        self.wait_s = 0.0  # how long wait() blocked, summed since the last stage()
        self.staged_bytes = 0  # the tensors the last stage() copied

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_leaves

        self.staged_bytes = sum(t.nbytes for t in tree_leaves(state_dict)
                                if isinstance(t, torch.Tensor))
        slots: list[tuple[tuple[Any, ...], torch.Tensor]] = []
        skeleton = _split(state_dict, self.protected, slots, ())
        staged = self._now.stage(skeleton)  # buffers, small tensors, non-tensor values
        self.wait_s = 0.0
        if not slots:
            fut: Future[Any] = Future()
            fut.set_result(staged)
            self.future = None
            return fut
        if self._stream is not None:
            # the copy stream starts after the work queued so far (the optimizer step)
            self._stream.wait_stream(torch.cuda.current_stream())
        tensors = [t for _, t in slots]
        paths = [p for p, _ in slots]

        def copy_rest() -> Any:
            if self._stream is not None:
                # a new thread's device is GPU 0: on any other rank's GPU, the stream's
                # context switch would make a CUDA context on GPU 0 (memory every rank
                # then holds there)
                torch.cuda.set_device(self._stream.device)
                with torch.cuda.stream(self._stream):
                    out = self._later.stage(tensors, non_blocking=True)
                self._stream.synchronize()
            else:
                out = self._later.stage(tensors)
            for path, t in zip(paths, out, strict=True):
                node = staged
                for k in path[:-1]:
                    node = node[k]
                node[path[-1]] = t
            return staged

        self.future = self._pool.submit(copy_rest)
        return self.future

    def wait(self) -> None:
        """Block until the background copy is done (its errors surface through the save's
        own future, not here)."""
        fut = self.future
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:  # noqa: BLE001 - reported by the upload future
            pass
        self.wait_s += time.perf_counter() - t0
        self.future = None

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        self._now.close()
        self._later.close()


def _split(obj: Any, protected: set[int], slots: list[tuple[tuple[Any, ...], torch.Tensor]],
           path: tuple[Any, ...]) -> Any:
    """A copy of obj's dicts and lists with each protected tensor replaced by None and
    recorded (path, tensor) in slots."""
    if isinstance(obj, torch.Tensor):
        if protected and obj.numel() and _storage_key(obj) in protected:
            slots.append((path, obj))
            return None
        return obj
    if isinstance(obj, dict):
        return {k: _split(v, protected, slots, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, protected, slots, (*path, i)) for i, v in enumerate(obj)]
    return obj


def _more_open_files() -> None:
    """Process mode shares each staged tensor's memory with the checkpoint process through
    a file descriptor of its own, held in both processes (torch's file_descriptor
    strategy): a few hundred tensors (FSDP2's shards with Adam's two moments: three a
    parameter) pass systemd's default soft limit of 1024 open files with the job's sockets,
    and the save fails. The soft limit goes up to the hard one (the checkpoint process,
    started later, inherits it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.warning("open files limit stays %d (process-mode saves hold one per tensor): %s",
                    soft, e)


def _plain_tensors(obj: Any, path: tuple[Any, ...], out: list[tuple[tuple[Any, ...], Any]]) -> None:
    """(path, tensor) of every plain tensor under obj through dicts alone (not a DTensor:
    FSDP2's shards are each rank's own; nothing under a list, such as an optimizer's
    param_groups: DCP may write a list whole, and one rank's copy would then lack what
    another's has)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(obj, dict):
        return
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            if not isinstance(v, DTensor):
                out.append(((*path, k), v))
        else:
            _plain_tensors(v, (*path, k), out)


def _without(obj: Any, drop: set[tuple[Any, ...]], path: tuple[Any, ...]) -> Any:
    if isinstance(obj, dict):
        return {k: _without(v, drop, (*path, k)) for k, v in obj.items() if (*path, k) not in drop}
    if isinstance(obj, list):
        return [_without(v, drop, (*path, i)) for i, v in enumerate(obj)]
    return obj


def share_of(state: dict[str, Any], pg: Any) -> dict[str, Any]:
    """This rank's share of `state` for a save. DCP writes a tensor that every rank holds
    under one name (DDP's whole model and optimizer) from one rank only, but a save first
    copies the state it is given: every rank would stage all of it (a node of 8 GPUs, 8
    copies in host memory). Each rank passes on instead its share of those tensors,
    balanced by size, and everything else. The shares are worked out alike on every rank
    from names, shapes and dtypes, and used only where those agree on every rank (one
    collective of `pg`); otherwise the whole state goes, as DCP is given it without this."""
    import hashlib

    world = dist.get_world_size(pg)
    found: list[tuple[tuple[Any, ...], Any]] = []
    _plain_tensors(state, (), found)
    if world < 2 or not found:
        return state
    found.sort(key=lambda pt: (-pt[1].nbytes, repr(pt[0])))
    digest = hashlib.blake2b(repr([(p, t.nbytes, str(t.dtype), tuple(t.shape))
                                   for p, t in found]).encode(), digest_size=7).digest()
    h = int.from_bytes(digest, "big")
    both = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
    if int(both[0]) != h or int(both[1]) != -h:
        return state  # the ranks hold different tensors: DCP sorts it out, as before
    me, load = dist.get_rank(pg), [0] * world
    drop: set[tuple[Any, ...]] = set()
    for path, t in found:  # largest first, each to the least loaded rank (lowest on a tie)
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += max(1, t.nbytes)
        if r != me:
            drop.add(path)
    return _without(state, drop, ())


def optimizer_storages(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages that only optimizer.step() changes: the optimized parameters and their
    optimizer state (exp_avg, step, ...)."""
    keys: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            keys.update(_storage_key(p) for p in group["params"])
        for st in opt.state.values():
            if isinstance(st, dict):
                keys.update(_storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
    keys.discard(0)
    return keys


def _no_main_in_checkpoint_process() -> None:
    """DCP starts its checkpoint process with multiprocessing's spawn, which runs the
    parent's main script again in the child before anything else (as `__mp_main__`). A
    training script whose loop is not under `if __name__ == "__main__":` would then train
    a second time in there, and the save waits for a child that never reports. The child
    needs nothing of the script (the state it is sent holds tensors, plain values and
    bytes), so the preparation data of that one process leaves the main script out; every
    other spawn (a DataLoader's, the user's) keeps it."""
    import multiprocessing.spawn as mps

    if getattr(mps.get_preparation_data, "_spotctl", False):
        return
    orig = mps.get_preparation_data

    def prepare(name: str) -> dict[str, Any]:
        d: dict[str, Any] = orig(name)
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_filename.endswith("_async_process_executor.py"):
                d.pop("init_main_from_path", None)
                d.pop("init_main_from_name", None)
                break
            f = f.f_back
        return d

    prepare._spotctl = True  # type: ignore[attr-defined]
    mps.get_preparation_data = prepare


_DAEMON_STORE: Any = None  # the checkpoint processes' store (rank 0), kept for the process


@contextlib.contextmanager
def _daemon_store(pg: Any) -> Iterator[None]:
    """Process mode: the checkpoint processes (one per rank, started by DCP at the first
    save) meet over a store of spotctl's, listening on MASTER_ADDR only, on a port the
    kernel gave it when it bound it. DCP's own way picks a free port, and the coordinator's
    checkpoint process binds it seconds later on every interface: an unauthenticated
    store open beyond the cluster's address, and a port that an outgoing connection on a
    busy machine can take in between (the save then fails with EADDRINUSE). Collective
    over `pg`; where the store cannot be had (no MASTER_ADDR, a torch without the prefix
    store, rank 0 not on MASTER_ADDR's host) DCP's own way is left as it is."""
    global _DAEMON_STORE
    from torch.distributed.checkpoint import _async_process_executor as ape

    addr = os.environ.get("MASTER_ADDR", "")
    info = getattr(ape, "_ProcessGroupInitInfo", None)
    if (getattr(ape, "_CHECKPOINT_PROCESS", None) is not None or not addr
            or "use_prefix_store" not in getattr(info, "__annotations__", {})):
        yield
        return
    port = torch.tensor([-1], dtype=torch.int64)
    if dist.get_rank(pg) == 0:
        from spotctl.sockets import listening_store

        try:
            _DAEMON_STORE = listening_store(addr, 0, wait_for_workers=False)
            port[0] = _DAEMON_STORE.port
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("checkpoint processes' store on %s: %s; DCP picks its port", addr, e)
    dist.broadcast(port, src=0 if pg is None else dist.get_global_rank(pg, 0), group=pg)
    if int(port[0]) < 0:
        yield
        return
    keys = ("DCP_USE_PREFIX_STORE", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(DCP_USE_PREFIX_STORE="1", MASTER_PORT=str(int(port[0])))
    try:  # DCP reads both while it starts the save, on this thread
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Checkpointer:
    """mode: "thread" (DCP's async save in a thread of this process) or "process" (a
    persistent checkpoint process per rank), both fed through a persistent OverlapStager.

    After guard(optimizers), save_async() returns once the small and forward-mutable parts
    are copied; the optimizers' parameters and state are copied while training goes on,
    and each optimizer's step() first waits for that copy (a step pre-hook), so the saved
    state is the state at the save step. Code that changes parameters or optimizer state
    outside optimizer.step() must call wait_staged() first."""

    def __init__(self, root: str | os.PathLike[str], keep_last: int, rank: int, pg: Any,
                 mode: str | None = None):
        self.store = open_store(root)
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.pg = pg  # a separate gloo group: async saves run collectives off the main thread
        self.mode = mode or os.environ.get("SPOTCTL_ASYNC_SAVE") or (
            "process" if torch.cuda.is_available() else "thread")
        if self.mode not in ("thread", "process"):
            raise ValueError(f"SPOTCTL_ASYNC_SAVE must be thread or process, not {self.mode!r}")
        self.stager: OverlapStager | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self.last_wait_s = 0.0
        self.pending: tuple[int, Any, dict[str, Any], float] | None = None
        self.started = 0  # the step of the newest async save started (the same on every rank)
        self.abandoned: int | None = None  # an async save left uncommitted by a drain
        self.last_committed = 0
        self.save_failures = 0
        self.last_block_s = 0.0
        self._pruner: threading.Thread | None = None
        if rank == 0:
            self.store.prepare()
            self.last_committed = max((s for s, c in self.store.steps().items() if c), default=0)

    # -- agreement
    def agreed_last_committed(self, pg: Any = None) -> int:
        """Rank 0's view of the newest committed step, on every rank (collective)."""
        pg = pg if pg is not None else self.pg
        t = torch.tensor([self.last_committed], dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(pg, 0), group=pg)
        self.last_committed = int(t.item())
        return self.last_committed

    # -- saving
    def guard(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Copy these optimizers' parameters and state off the training thread, and make
        each one's step() wait for that copy."""
        for opt in optimizers:
            self._optimizers.append(opt)
            self._hooks.append(opt.register_step_pre_hook(self._before_step))

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.wait_staged()

    def wait_staged(self) -> None:
        """Wait until the in-flight save's copy of the state is made (cheap when none is)."""
        if self.stager is not None and self.stager.future is not None:
            self.stager.wait()
            self.last_wait_s = self.stager.wait_s

    def save_async(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        self.wait_pending()
        self.started = step
        t0 = time.perf_counter()
        try:
            fut = self._async_save(step, state)
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            return
        self.last_block_s = time.perf_counter() - t0
        self.last_wait_s = 0.0
        self.pending = (step, fut, meta, t0)

    def _async_save(self, step: int, state: dict[str, Any]) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.stager is None:
            self.stager = OverlapStager(self.mode)
        self.stager.protected = optimizer_storages(self._optimizers) if self._optimizers else set()
        kind = (AsyncCheckpointerType.PROCESS if self.mode == "process"
                else AsyncCheckpointerType.THREAD)
        state = share_of(state, self.pg)
        writer = self.store.writer(step)
        # what it writes is staged in host memory already: DCP's loader that copies ahead
        # from the GPU (its choice for one writer when CUDA is there) would only make a
        # CUDA context on GPU 0 in the thread or checkpoint process that writes
        writer.per_thread_copy_ahead = 0
        if self.mode == "process":
            _no_main_in_checkpoint_process()
        with _daemon_store(self.pg) if self.mode == "process" else contextlib.nullcontext():
            return dcp.async_save(state, storage_writer=writer,
                                  process_group=self.pg, async_checkpointer_type=kind,
                                  async_stager=self.stager)

    @staticmethod
    def _upload(fut: Any) -> Future[Any]:
        return getattr(fut, "upload_completion", fut)

    def uploading(self) -> bool:
        """Whether this rank's part of the last async save is still being written."""
        return self.pending is not None and not self._upload(self.pending[1]).done()

    def poll(self) -> None:
        """Commit a finished async save (rank 0). Cheap: called every step."""
        if self.pending is not None and self._upload(self.pending[1]).done():
            self.wait_pending()

    def wait_pending(self) -> None:
        """Wait for the in-flight async save, then commit it (or record its failure)."""
        if self.pending is None:
            return
        step, fut, meta, _ = self.pending
        self.pending = None
        try:
            self._upload(fut).result()
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            return
        self._commit(step, meta)

    def save_sync(self, step: int, state: dict[str, Any], meta: dict[str, Any],
                  beside_pending: Any = None) -> bool:
        """Collective save + commit; returns True when step is committed. A step that is
        committed already (rank 0's view, agreed) is never written again.

        beside_pending: a process group of the same ranks that nothing else uses now (the
        drain's). An async save of an earlier step that is still uploading is then left
        behind, uncommitted (it finishes or dies on its own; the next commit's pruning
        removes what it wrote), and this save runs on that group beside it instead of
        waiting for it: a notice leaves 30 s on GCP. The async save's own group stays
        busy with it. An async save of this very step is waited for, as without it."""
        pg = self.pg
        if beside_pending is not None and self.started < step:
            pg = beside_pending
            if self.pending is not None:
                self.abandoned = self.pending[0]
                self.pending = None
                log.info("left the upload of step %d behind to save step %d", self.abandoned,
                         step)
        else:
            self.wait_pending()
        if self.agreed_last_committed(pg) >= step:
            return True
        ok = 1
        try:
            dcp.save(share_of(state, pg), storage_writer=self.store.writer(step), process_group=pg)
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            ok = 0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
        if int(flag.item()) != 1:
            return False
        self._commit(step, meta)
        return self.agreed_last_committed(pg) >= step

    def _commit(self, step: int, meta: dict[str, Any]) -> None:
        if self.rank != 0:
            self.last_committed = max(self.last_committed, step)
            return
        try:
            if not self.store.has_metadata(step):
                raise RuntimeError("DCP metadata missing")
            with self.store.open(step, FILES) as f:
                files = json.loads(f.read())
            self.store.write_commit(step, {**meta, "step": step, "committed_at": time.time(),
                                           "files": files})
        except _CKPT_ERRORS as e:
            self._failed(step, e)
            return
        self.last_committed = max(self.last_committed, step)
        self._prune_in_background()

    def _failed(self, step: int, err: BaseException) -> None:
        # A failed save (disk full, I/O error) must not stop training nor leave a partial
        # directory that looks good: it has no COMMIT, and rank 0 removes it. A committed
        # step is never removed here.
        self.save_failures += 1
        log.warning("checkpoint at step %d failed: %s", step, err)
        if self.rank == 0:
            try:
                if not self.store.committed(step):
                    self.store.remove(step)
            except _CKPT_ERRORS as e:
                log.warning("could not remove the failed step %d: %s", step, e)

    def _prune_in_background(self) -> None:
        if self._pruner is not None and self._pruner.is_alive():
            return  # the next commit prunes again
        self._pruner = threading.Thread(target=self._prune, name="spotctl-prune", daemon=True)
        self._pruner.start()

    def _prune(self) -> None:
        try:
            steps = self.store.steps()
            keep = sorted((s for s, c in steps.items() if c), reverse=True)[: self.keep_last]
            newest = keep[0] if keep else 0
            for s, committed in steps.items():
                if (committed and s not in keep) or (not committed and s < newest):
                    self.store.remove(s)
        except _CKPT_ERRORS as e:
            log.warning("pruning old checkpoints failed: %s", e)

    def close(self) -> None:
        self.wait_pending()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._pruner is not None:
            self._pruner.join(timeout=60)
        if self.stager is not None:
            try:
                self.stager.close()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self.stager = None

    # -- loading
    def committed_list(self) -> list[int]:
        """Committed steps, newest first, as rank 0 sees them (collective)."""
        steps = sorted((s for s, c in self.store.steps().items() if c),
                       reverse=True) if self.rank == 0 else []
        obj = [steps]
        dist.broadcast_object_list(obj, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return list(obj[0])

    def load(self, steps: list[int], state: dict[str, Any]) -> dict[str, Any]:
        """Load the newest of `steps` every rank can read (each tried LOAD_ATTEMPTS times,
        then an older one, loudly). Returns its COMMIT meta. Raises when none loads: a
        transient error must not restart training from scratch."""
        errors = []
        for s in steps:
            for attempt in range(LOAD_ATTEMPTS):
                ok = 1
                meta: dict[str, Any] = {}
                try:
                    meta = self.store.read_commit(s)
                    self.verify(s, meta)
                except _CKPT_ERRORS as e:
                    ok = -1 if isinstance(e, UnsafeCheckpoint) else 0
                    log.error("refused checkpoint step %d: %s", s, _why(e)) if ok < 0 else \
                        log.warning("loading checkpoint step %d (attempt %d): %s", s,
                                    attempt + 1, _why(e))
                    errors.append(f"step {s}: {_why(e)}")
                # every rank enters DCP's load (collectives) only when every rank's check
                # passed
                checked = torch.tensor([ok])
                dist.all_reduce(checked, op=dist.ReduceOp.MIN, group=self.pg)
                if int(checked.item()) == -1:
                    break
                if int(checked.item()) == 0:
                    time.sleep(0.5 * (attempt + 1))
                    continue
                try:
                    dcp.load(state, storage_reader=self.store.reader(s),
                             planner=SafeLoadPlanner(), process_group=self.pg)
                except _CKPT_ERRORS as e:
                    why = _why(e)
                    unsafe = isinstance(e, UnsafeCheckpoint) or "spotctl does not load" in why \
                        or "not plain data" in why
                    log.error("refused checkpoint step %d: %s", s, why) if unsafe else \
                        log.warning("loading checkpoint step %d (attempt %d): %s", s,
                                    attempt + 1, why)
                    errors.append(f"step {s}: {why}")
                    ok = -1 if unsafe else 0  # refused: not tried again
                flag = torch.tensor([ok])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
                if int(flag.item()) == -1:
                    break
                if int(flag.item()) == 1:
                    if s != steps[0]:
                        log.error("resumed from step %d: newer committed checkpoints %s did not "
                                  "load", s, [x for x in steps if x > s])
                    self.last_committed = s
                    return meta
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"committed checkpoints {steps} exist under {self.root} but none "
                           f"loads ({'; '.join(errors[-2:])}); refusing to start over")

    def verify(self, step: int, meta: dict[str, Any]) -> None:
        """Refuse (UnsafeCheckpoint) a step whose files differ from what its COMMIT
        recorded: every file's size and the metadata's digest here, the data files'
        digests split across the ranks (the load's agreement fails them all)."""
        want = meta.get("files")
        if want is None:
            log.warning("checkpoint step %d was committed without file digests (an older "
                        "spotctl): its files are not checked", step)
            return
        if not isinstance(want, dict) or ".metadata" not in want:
            raise UnsafeCheckpoint(f"step {step}: its COMMIT's file list is malformed")
        have = self.store.files(step)
        world = dist.get_world_size(self.pg) if self.pg is not None else 1
        rank = dist.get_rank(self.pg) if self.pg is not None else 0
        names = sorted(want)
        mine = {".metadata", *names[rank::world]}
        for name in names:
            size, digest = want[name]
            if have.get(name) != size:
                raise UnsafeCheckpoint(f"step {step}: {name} is {have.get(name)} bytes, its "
                                       f"COMMIT recorded {size}; refusing the checkpoint")
            if name in mine and digest_file(lambda n=name: self.store.open(step, n))[1] \
                    != digest:
                raise UnsafeCheckpoint(f"step {step}: {name} differs from what its COMMIT "
                                       f"recorded (sha256); refusing the checkpoint")

    def load_latest(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """COMMIT meta of the newest loadable checkpoint, None for a fresh start."""
        steps = self.committed_list()
        return self.load(steps, state) if steps else None

    def read_meta(self, step: int) -> dict[str, Any]:
        return self.store.read_commit(step)
