"""Checkpoint files on S3 uploaded in concurrent parts.

s3fs's own file object uploads a multipart object one part after another, so a rank's
multi-GB checkpoint file goes up at the speed of one connection. PartsStream keeps up to
PARTS_IN_FLIGHT parts of PART_BYTES uploading at once (through s3fs's own client and
event loop), holding at most PARTS_IN_FLIGHT + 1 parts in memory. A file smaller than one
part is one PUT, as before; an object appears whole or not at all either way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

PARTS_IN_FLIGHT = 4


def part_bytes() -> int:
    """SPOTCTL_CHECKPOINT_PART_MB (default 32): S3 takes parts of 5 MiB to 5 GiB."""
    raw = os.environ.get("SPOTCTL_CHECKPOINT_PART_MB", "").strip() or "32"
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if not 5 <= mb <= 5120:
        raise ValueError(f"SPOTCTL_CHECKPOINT_PART_MB must be a whole number from 5 to 5120, "
                         f"not {raw!r}")
    return mb << 20


def is_s3(fs: Any) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in proto and hasattr(fs, "_call_s3")


class PartsStream:
    """A write-only stream to one S3 object (what DCP's writer needs: write, tell,
    close)."""

    def __init__(self, fs: Any, path: str, part: int | None = None,
                 in_flight: int = PARTS_IN_FLIGHT):
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part = part or part_bytes()
        self.in_flight = in_flight
        self.buf = bytearray()
        self.pos = 0
        self.upload_id: str | None = None
        self.parts: list[Future[Any]] = []
        self.closed = False

    def _call(self, method: str, **kw: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(
            self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kw), self.fs.loop)

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
        while len(self.buf) >= self.part:
            chunk = bytes(self.buf[: self.part])
            del self.buf[: self.part]
            self._send(chunk)
        return len(mv)

    def _send(self, chunk: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._call("create_multipart_upload").result()["UploadId"]
        running = [f for f in self.parts if not f.done()]
        while len(running) >= self.in_flight:
            wait(running, return_when=FIRST_COMPLETED)
            running = [f for f in running if not f.done()]
        for f in self.parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        self.parts.append(self._call("upload_part", UploadId=self.upload_id,
                                     PartNumber=len(self.parts) + 1, Body=chunk))

    def close(self) -> None:
        """Upload what is left and complete the object (raises if any part failed)."""
        if self.closed:
            return
        self.closed = True
        if self.upload_id is None:
            self._call("put_object", Body=bytes(self.buf)).result()
        else:
            if self.buf:
                self._send(bytes(self.buf))
            self.buf = bytearray()
            tags = [f.result()["ETag"] for f in self.parts]
            self._call("complete_multipart_upload", UploadId=self.upload_id,
                       MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": t}
                                                  for i, t in enumerate(tags)]}).result()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """After a failure: no object, and no parts left stored (and billed) on S3."""
        self.closed = True
        self.buf = bytearray()
        if self.upload_id is not None:
            wait(self.parts)
            try:
                self._call("abort_multipart_upload", UploadId=self.upload_id).result()
            except Exception:  # noqa: BLE001 - the write's own error is the one to raise
                pass


class PartsFileSystem(FileSystem):
    """DCP's fsspec file system, with S3 writes through PartsStream."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode or self.fs is None or not is_s3(self.fs):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = PartsStream(self.fs, os.fspath(path))
        try:
            yield stream
            stream.close()
        except BaseException:
            stream.abort()
            raise


class PartsWriterMixin:
    """Mixed into DCP's FsspecWriter: its file system writes S3 objects in concurrent
    parts."""

    fs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parts = PartsFileSystem()
        parts.fs = self.fs.fs
        self.fs = parts
