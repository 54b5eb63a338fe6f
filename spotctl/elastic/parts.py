"""Checkpoint files on object stores uploaded in concurrent parts.

s3fs's and gcsfs's own file objects upload a file one part (one chunk) after another, so a
rank's multi-GB checkpoint file goes up at the speed of one connection. The streams here
keep up to PARTS_IN_FLIGHT parts of PART_BYTES uploading at once (through the file
system's own client and event loop), holding at most PARTS_IN_FLIGHT + 1 parts in memory:

- S3: one multipart upload, completed at close (a failure aborts it);
- GCS: each part a temporary object beside the file (`NAME.part-00001`, ...), composed
  into the file at close (32 sources per compose, at most 1024 components per object:
  GCS's limits, so parts grow past the first 256) and deleted; a failure
  deletes the parts it wrote. A node killed mid-save leaves parts in a step that never
  commits, which the checkpoint pruning removes with the step.

A file smaller than one part is one PUT, as before; the file appears whole or not at all
either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

PARTS_IN_FLIGHT = 4
GCS_COMPOSE_MOST = 32  # source objects per compose request


def part_bytes() -> int:
    """SPOTCTL_CHECKPOINT_PART_MB (default 32): S3 takes parts of 5 MiB to 5 GiB (GCS
    composes parts of any size; the same bounds apply)."""
    raw = os.environ.get("SPOTCTL_CHECKPOINT_PART_MB", "").strip() or "32"
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if not 5 <= mb <= 5120:
        raise ValueError(f"SPOTCTL_CHECKPOINT_PART_MB must be a whole number from 5 to 5120, "
                         f"not {raw!r}")
    return mb << 20


def _protocols(fs: Any) -> tuple[str, ...]:
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def is_s3(fs: Any) -> bool:
    return "s3" in _protocols(fs) and hasattr(fs, "_call_s3")


def is_gcs(fs: Any) -> bool:
    return bool({"gs", "gcs"} & set(_protocols(fs))) and hasattr(fs, "_merge")


class _Parts:
    """A write-only stream to one object (what DCP's writer needs: write, tell, close),
    sent in parts of `part` bytes, `in_flight` at once. Subclasses say how a part, a
    whole small file, the end and an abort go to the store."""

    def __init__(self, fs: Any, path: str, part: int | None = None,
                 in_flight: int = PARTS_IN_FLIGHT):
        self.fs = fs
        self.path = path
        self.part = part or part_bytes()
        self.in_flight = in_flight
        self.buf = bytearray()
        self.pos = 0
        self.parts: list[Future[Any]] = []
        self.closed = False

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.buf += mv
        self.pos += len(mv)
        while len(self.buf) >= (size := self._size(len(self.parts) + 1)):
            chunk = bytes(self.buf[:size])
            del self.buf[:size]
            self._send(chunk)
        return len(mv)

    def _size(self, number: int) -> int:
        """The size of part `number` (from 1)."""
        return self.part

    def _send(self, chunk: bytes) -> None:
        running = [f for f in self.parts if not f.done()]
        while len(running) >= self.in_flight:
            wait(running, return_when=FIRST_COMPLETED)
            running = [f for f in running if not f.done()]
        for f in self.parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        self.parts.append(self._part(len(self.parts) + 1, chunk))

    def close(self) -> None:
        """Upload what is left and make the object (raises if any part failed)."""
        if self.closed:
            return
        self.closed = True
        if not self.parts:
            self._whole(bytes(self.buf))
        else:
            if self.buf:
                self._send(bytes(self.buf))
            self.buf = bytearray()
            self._complete([f.result() for f in self.parts])
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """After a failure: no object, and no parts left stored (and billed)."""
        self.closed = True
        self.buf = bytearray()
        if self.parts:
            wait(self.parts)
            try:
                self._discard()
            except Exception:  # noqa: BLE001 - the write's own error is the one to raise
                pass

    # what subclasses provide
    def _part(self, number: int, chunk: bytes) -> Future[Any]:
        raise NotImplementedError

    def _whole(self, data: bytes) -> None:
        raise NotImplementedError

    def _complete(self, results: list[Any]) -> None:
        raise NotImplementedError

    def _discard(self) -> None:
        raise NotImplementedError


class PartsStream(_Parts):
    """S3: the parts of one multipart upload."""

    def __init__(self, fs: Any, path: str, part: int | None = None,
                 in_flight: int = PARTS_IN_FLIGHT):
        super().__init__(fs, path, part, in_flight)
        self.bucket, self.key, _ = fs.split_path(path)
        self.upload_id: str | None = None

    def _call(self, method: str, **kw: Any) -> Future[Any]:
        return self._run(self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kw))

    def _part(self, number: int, chunk: bytes) -> Future[Any]:
        if self.upload_id is None:
            self.upload_id = self._call("create_multipart_upload").result()["UploadId"]
        return self._call("upload_part", UploadId=self.upload_id, PartNumber=number, Body=chunk)

    def _whole(self, data: bytes) -> None:
        self._call("put_object", Body=data).result()

    def _complete(self, results: list[Any]) -> None:
        self._call("complete_multipart_upload", UploadId=self.upload_id,
                   MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": r["ETag"]}
                                              for i, r in enumerate(results)]}).result()

    def _discard(self) -> None:
        if self.upload_id is not None:
            self._call("abort_multipart_upload", UploadId=self.upload_id).result()


class GcsPartsStream(_Parts):
    """GCS: each part a temporary object, composed into the file at close. A composite
    object holds at most 1024 components, so the part size doubles every `same_size`
    parts (1024 parts of a 32 MiB start hold 120 GiB)."""

    same_size = 256

    def _size(self, number: int) -> int:
        return self.part << ((number - 1) // self.same_size)

    def _name(self, number: int) -> str:
        return f"{self.path}.part-{number:05d}"

    def _part(self, number: int, chunk: bytes) -> Future[Any]:
        return self._run(self.fs._pipe_file(self._name(number), chunk))

    def _whole(self, data: bytes) -> None:
        self._run(self.fs._pipe_file(self.path, data)).result()

    def _complete(self, results: list[Any]) -> None:
        names = [self._name(i + 1) for i in range(len(self.parts))]
        temp = f"{self.path}.part-composed"
        sources, made = names, []
        # more parts than one compose takes: fold them into a temporary object first, so
        # the file itself is written once, whole
        while len(sources) > GCS_COMPOSE_MOST:
            self._run(self.fs._merge(temp, sources[:GCS_COMPOSE_MOST])).result()
            sources, made = [temp, *sources[GCS_COMPOSE_MOST:]], [temp]
        self._run(self.fs._merge(self.path, sources)).result()
        try:  # the file is whole: parts left behind are pruned with their step
            self._delete(names + made)
        except Exception as e:  # noqa: BLE001 - the save itself succeeded
            logging.getLogger("spotctl.checkpoint").warning(
                "could not delete the parts of %s (pruned with its step): %s", self.path, e)

    def _discard(self) -> None:
        names = [self._name(i + 1) for i, f in enumerate(self.parts) if f.exception() is None]
        self._delete(names + [f"{self.path}.part-composed"], missing_ok=True)

    def _delete(self, names: list[str], missing_ok: bool = False) -> None:
        async def rm_all() -> None:
            gate = asyncio.Semaphore(self.in_flight)

            async def rm(name: str) -> None:
                async with gate:
                    await self.fs._rm_file(name)

            got = await asyncio.gather(*(rm(n) for n in names), return_exceptions=True)
            errors = [e for e in got if isinstance(e, BaseException)
                      and not (missing_ok and isinstance(e, FileNotFoundError))]
            if errors:
                raise errors[0]

        self._run(rm_all()).result()


class PartsFileSystem(FileSystem):
    """DCP's fsspec file system, with S3 and GCS writes in concurrent parts."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        kind: type[_Parts] | None = None
        if "w" in mode and self.fs is not None:
            kind = PartsStream if is_s3(self.fs) else GcsPartsStream if is_gcs(self.fs) else None
        if kind is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        parts = kind(self.fs, os.fspath(path))
        try:
            yield parts
            parts.close()
        except BaseException:
            parts.abort()
            raise


class PartsWriterMixin:
    """Mixed into DCP's FsspecWriter: its file system writes S3 and GCS objects in
    concurrent parts."""

    fs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parts = PartsFileSystem()
        parts.fs = self.fs.fs
        self.fs = parts
