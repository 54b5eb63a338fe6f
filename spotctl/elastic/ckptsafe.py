"""Checkpoints are data: what a load reads never runs code, and files that differ from what
the committing rank recorded are refused.

Any worker can write every node's checkpoint prefix, so a checkpoint's files are bytes
another process wrote. DCP (torch 2.13) loads three of its parts with pickle:

- `.metadata` (`FileSystemReader.read_metadata`: `pickle.load`): read here by
  `load_metadata`, which resolves only DCP's metadata classes, torch's `Size`, dtypes,
  layouts and memory formats, paths and builtin containers, and refuses every other
  global before anything of the file runs;
- every non-tensor value (`DefaultLoadPlanner.load_bytes`: `torch.load(weights_only=False)`):
  `SafeLoadPlanner` loads them with `weights_only=True`;
- tensors: DCP's reader uses `weights_only=True` already.

spotctl's own `extra` blob (schedulers, scaler, RNG states, user state) is loaded with
`weights_only=True` too (`load_extra`).

Digests: while DCP writes, every rank hashes each file it writes (sha256, as the bytes
pass, in the thread or process that writes them: nothing is read back and the training
step does not wait for it); DCP's gather hands them to the coordinating rank, which
writes them, with the digest of `.metadata`, beside the files (`FILES`). The commit puts
them in COMMIT (`files`: name -> [size, sha256]); a load checks every file's size and
the metadata's digest on every rank, and the data files' digests split across the ranks,
and refuses the checkpoint on a mismatch. (A member who can write the prefix can also
write a COMMIT that matches its files: the digests catch torn or swapped files; what
makes a planted file harmless is that loading it runs nothing.)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import WriteResult

FILES = ".spotctl-files.json"  # written by the coordinating rank beside DCP's files
DIGEST_FQN = "__spotctl_file_digests__"  # a write result carrying one rank's digests
CHUNK = 1 << 20

_META_GLOBALS = {
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                 "bytes", "bool", "object"},
    "collections": {"OrderedDict"},
    "torch": {"Size", "device", "layout", "memory_format"},
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "SerializationFormat"},
    "torch.distributed.checkpoint._extension": {"ExtensionRegistry"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file this loader does not load: a pickle naming a global outside the
    allow-list, or files that differ from what COMMIT recorded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name not in _META_GLOBALS["torch"]:
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                return dt
        elif name in _META_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"the checkpoint's DCP metadata names {module}.{name}, which "
                               f"spotctl does not load (it is no part of DCP's metadata)")


def load_metadata(stream: Any) -> Any:
    """DCP's `.metadata`, resolving only what DCP's metadata is made of."""
    return _MetadataUnpickler(stream).load()


def _read_metadata(reader: Any, **kwargs: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader._get_metadata_path(kwargs.get("rank"))
    with reader.fs.create_stream(path, "rb") as f:
        metadata = load_metadata(f)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, its metadata loaded by load_metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return _read_metadata(self, **kwargs)


def safe_fsspec_reader(path: str, **options: Any) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(FsspecReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return _read_metadata(self, **kwargs)

    return SafeFsspecReader(path, **options)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with every non-tensor value loaded by torch's weights-only
    loader (DCP's own uses `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = weights_only_load(value, f"the checkpoint's value {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def weights_only_load(data: Any, what: str, safe: list[Any] | None = None) -> Any:
    """torch.load(weights_only=True) with `bytes` allowed too (a bytes value pickles as
    a call of `bytes`), its refusal one line naming `what` and the global refused."""
    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with torch.serialization.safe_globals([bytes, bytearray, *(safe or [])]):
            return torch.load(src, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        named = [ln for ln in lines if "Unsupported global" in ln or "GLOBAL" in ln]
        why = (named or lines or [type(e).__name__])[0].split(" was not an allowed")[0]
        why = why.replace("WeightsUnpickler error: ", "")
        raise UnsafeCheckpoint(f"{what} is not plain data, refused by torch's weights-only "
                               f"loader ({why}; a class of your own in it: "
                               f"torch.serialization.add_safe_globals in train.py)") from None


def load_extra(blob: bytes) -> Any:
    """spotctl's `extra` (schedulers, scaler, RNG states, user state), data only. numpy's
    RNG state (an array and its dtype) is allowed when numpy is imported."""
    import sys

    np = sys.modules.get("numpy")
    safe: list[Any] = []
    if np is not None:
        core = getattr(np, "_core", None) or np.core
        safe = [core.multiarray._reconstruct, np.ndarray, np.dtype,
                type(np.dtype(np.uint32))]
    return weights_only_load(blob, "the checkpoint's extra state", safe)


# -- digests while writing


class _HashingStream:
    """A write stream that hashes what passes through it."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.sha.update(mv)
        self.size += mv.nbytes
        return int(self._inner.write(b) or mv.nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HashingFS:
    """DCP's file system object, recording (size, sha256) of every file written."""

    def __init__(self, inner: Any, record: dict[str, list[Any]], lock: threading.Lock):
        self._inner, self._record, self._lock = inner, record, lock

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            h = _HashingStream(stream)
            yield h
        with self._lock:
            self._record[os.path.basename(os.fspath(path))] = [h.size, h.sha.hexdigest()]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DigestingWriter:
    """Mixed into DCP's writers (before them): each rank's write results carry the
    digests of the files it wrote; the coordinator writes them all, with `.metadata`'s,
    into FILES."""

    fs: Any
    path: Any

    def write_data(self, plan: Any, planner: Any) -> Any:
        record: dict[str, list[Any]] = {}
        inner = self.fs
        self.fs = _HashingFS(inner, record, threading.Lock())
        try:
            results = super().write_data(plan, planner).wait()  # type: ignore[misc]
        finally:
            self.fs = inner
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result([*results, WriteResult(index=MetadataIndex(DIGEST_FQN),
                                              size_in_bytes=0, storage_data=record)])
        return fut

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        files: dict[str, list[Any]] = {}
        kept = []
        for wr_list in results:
            kept.append([wr for wr in wr_list if wr.index.fqn != DIGEST_FQN])
            for wr in wr_list:
                if wr.index.fqn == DIGEST_FQN:
                    files.update(wr.storage_data)
        super().finish(metadata, kept)  # type: ignore[misc]
        meta_path = self.fs.concat_path(self.path, ".metadata")
        files[".metadata"] = _digest_stream(self.fs, meta_path)
        with self.fs.create_stream(self.fs.concat_path(self.path, FILES), "wb") as f:
            f.write(json.dumps(files, sort_keys=True).encode())


def _digest_stream(fs: Any, path: Any) -> list[Any]:
    sha, size = hashlib.sha256(), 0
    with fs.create_stream(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return [size, sha.hexdigest()]


def digest_file(opener: Any) -> list[Any]:
    """[size, sha256] of what `opener()` (a context manager giving a binary stream) reads."""
    sha, size = hashlib.sha256(), 0
    with opener() as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return [size, sha.hexdigest()]
