"""A filter in front of torchft's Lighthouse: only its gRPC methods pass. (The same filter
fronts the Manager of a replica group that spans nodes, passing the ManagerService calls
the group's workers make and not `Kill`: spotctl.elastic.ft._bound_manager_server.)

torchft 0.2.0's Lighthouse serves, on the port of its gRPC service, an HTTP dashboard
whose `POST /replica/<id>/kill` makes the Lighthouse call that replica's Manager `Kill`
RPC, which exits the worker. It has no authentication and no switch to turn the dashboard
off. So the head binds the Lighthouse on loopback and serves its cluster address through
this filter, which passes:

- HTTP/2 with prior knowledge (what torchft's Managers speak): every frame is parsed, every
  header block decoded with an HPACK decoder kept in step with the Lighthouse's (the filter
  forwards the same bytes, in order). A request (a header block opening a stream) passes
  only as `POST` to one of `allowed` (the LighthouseService methods the Managers call);
  a header block on an opened stream (trailers) carries no pseudo-header. Anything else,
  a frame that breaks the framing, an undecodable block, a PUSH_PROMISE, closes the
  connection before the offending frame reaches the Lighthouse.
- HTTP/1.x: one `GET` of a path in `http1_get` (the status page spotctl.elastic.ft reads
  before a new cluster's first quorum), without a body (`Content-Length: 0` at most) or an
  upgrade, sent on with `Connection: close`; nothing after it on that connection reaches
  the Lighthouse.
  Every other HTTP/1.x request is answered 403 and closed.

Bounds: a new connection has 10 s to show which it is; HTTP/1 heads are at most 8 KiB, a
header block 64 KiB, a frame 16 MiB - 1 (the protocol's largest); at most 4,096
connections (newcomers beyond are closed). There is no cap per address: on local clusters
and ssh hosts (through the controller's reverse forwards) every replica connects from
loopback, and a head takes up to 1,024 nodes, each Manager holding a connection or two.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections.abc import Iterable

log = logging.getLogger("spotctl.head.grpc_filter")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# the LighthouseService methods torchft 0.2.0's Managers call (its lighthouse client)
LIGHTHOUSE_METHODS = frozenset({"/torchft.LighthouseService/Quorum",
                                "/torchft.LighthouseService/Heartbeat"})
HELLO_S = 10.0
MAX_HTTP1_HEAD = 8 * 1024
MAX_HEADER_BLOCK = 64 * 1024
MAX_CONNS = 4096

_DATA, _HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x0, 0x1, 0x5, 0x9
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20
_FORBIDDEN_HTTP1 = (b"content-length", b"transfer-encoding", b"upgrade", b"expect",
                    b"http2-settings", b"connection")
_REQUEST_LINE = re.compile(rb"GET (\S+) HTTP/1\.[01]")


class Refused(Exception):
    """What the filter does not pass; the connection is closed."""


class H2RequestFilter:
    """The client side of one HTTP/2 connection, after the preface: `feed` takes bytes as
    they arrive and returns those that may go on to the server, frame by frame; it raises
    Refused at the first frame that may not (nothing of it, or after it, is returned)."""

    def __init__(self, allowed: Iterable[str]):
        from hpack import Decoder

        self.allowed = frozenset(p.encode() for p in allowed)
        self._decoder = Decoder()
        self._buf = bytearray()
        self._block: bytearray | None = None  # a header block awaiting its END_HEADERS
        self._held: list[bytes] = []  # its frames, sent on once the block passes
        self._block_sid = 0
        self._max_sid = 0  # the highest stream the client opened
        self.requests = 0

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[0:3], "big")
            if len(self._buf) < 9 + length:
                break
            frame = bytes(self._buf[:9 + length])
            del self._buf[:9 + length]
            out += self._frame(frame)
        return bytes(out)

    def _frame(self, frame: bytes) -> bytes:
        ftype, flags = frame[3], frame[4]
        sid = int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
        if ftype == _HEADERS:
            if self._block is not None:
                raise Refused("a HEADERS frame inside another header block")
            payload = frame[9:]
            if flags & _PADDED:
                if not payload or payload[0] >= len(payload):
                    raise Refused("bad padding")
                payload = payload[1:len(payload) - payload[0]]
            if flags & _PRIORITY:
                if len(payload) < 5:
                    raise Refused("a short PRIORITY field")
                payload = payload[5:]
            self._block, self._held, self._block_sid = bytearray(payload), [frame], sid
        elif ftype == _CONTINUATION:
            if self._block is None or sid != self._block_sid:
                raise Refused("a CONTINUATION frame outside a header block")
            self._block += frame[9:]
            self._held.append(frame)
        elif self._block is not None:
            raise Refused("a frame inside a header block")
        elif ftype == _PUSH_PROMISE:
            raise Refused("a PUSH_PROMISE from a client")
        else:
            return frame
        if len(self._block) > MAX_HEADER_BLOCK:
            raise Refused("a header block over 64 KiB")
        if not flags & _END_HEADERS:
            return b""
        block, self._block = bytes(self._block), None
        try:
            headers = [(bytes(k), bytes(v)) for k, v in self._decoder.decode(block, raw=True)]
        except Exception as e:  # noqa: BLE001 - any decoding failure refuses
            raise Refused(f"an undecodable header block ({type(e).__name__})") from None
        self._check(sid, headers)
        return b"".join(self._held)

    def _check(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        pseudo = [(k, v) for k, v in headers if k.startswith(b":")]
        if sid == 0:
            raise Refused("a header block on stream 0")
        if sid <= self._max_sid:  # trailers of an opened stream
            if pseudo:
                raise Refused("pseudo-headers in trailers")
            return
        self._max_sid = sid
        paths = [v for k, v in pseudo if k == b":path"]
        methods = [v for k, v in pseudo if k == b":method"]
        if len(paths) != 1 or paths[0] not in self.allowed:
            raise Refused(f"path {b','.join(paths)!r} is not a method this filter passes")
        if methods != [b"POST"]:
            raise Refused(f"method {b','.join(methods)!r} is not POST")
        self.requests += 1


def http1_request(head: bytes, allowed_get: Iterable[str]) -> bytes:
    """The request to send on for an HTTP/1.x head (up to and without its blank line):
    a GET of an allowed path with its headers and `Connection: close`; Refused otherwise."""
    lines = head.split(b"\r\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None or m.group(1).decode("latin-1") not in set(allowed_get):
        raise Refused(f"HTTP/1 request {lines[0][:80]!r}")
    kept = [lines[0]]
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or name != name.strip() or not name:
            raise Refused("a malformed HTTP/1 header line")
        if name.lower() == b"content-length" and value.strip() == b"0":
            kept.append(line)
            continue
        if name.lower() in _FORBIDDEN_HTTP1:
            if name.lower() == b"connection":
                continue  # replaced by Connection: close below
            raise Refused(f"HTTP/1 header {name.decode('latin-1')!r}")
        kept.append(line)
    kept.append(b"Connection: close")
    return b"\r\n".join(kept) + b"\r\n\r\n"


class GrpcFilter:
    """Serves host:port (port 0 = any free one) and forwards what passes to `upstream`.
    Runs its own event loop in a daemon thread; bound (or raising OSError) on return."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int],
                 allowed: Iterable[str] = LIGHTHOUSE_METHODS,
                 http1_get: Iterable[str] = ("/status",), name: str = "lighthouse filter"):
        self.upstream = upstream
        self.name = name
        self.allowed = frozenset(allowed)
        self.http1_get = frozenset(http1_get)
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=fam, backlog=256)
        self.port = int(self._sock.getsockname()[1])
        self.refused = 0  # connections closed for what they sent (tests read it)
        self._open: set[asyncio.StreamWriter] = set()  # both sides of every connection
        self._conns = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name.replace(" ", "-"),
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, sock=self._sock)
            self._ready.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    def stop(self) -> None:
        def close() -> None:
            self._server.close()
            for w in list(self._open):
                w.close()
            self._loop.call_later(0.2, self._loop.stop)

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(close)
            self._thread.join(5)
        self._sock.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        addr = str(peer[0]) if peer else "?"
        if self._conns >= MAX_CONNS:
            writer.close()
            return
        self._conns += 1
        self._open.add(writer)
        up_w: asyncio.StreamWriter | None = None
        try:
            first = await asyncio.wait_for(self._hello(reader), HELLO_S)
            if first.startswith(PREFACE):
                flt = H2RequestFilter(self.allowed)
                send = PREFACE + flt.feed(first[len(PREFACE):])
                up_r, up_w = await asyncio.open_connection(*self.upstream)
                self._open.add(up_w)
                up_w.write(send)
                back = asyncio.ensure_future(self._copy(up_r, writer))
                try:
                    while True:
                        data = await reader.read(65536)
                        if not data:
                            break
                        up_w.write(flt.feed(data))
                        await up_w.drain()
                finally:
                    back.cancel()
            else:
                end = first.find(b"\r\n\r\n")
                try:
                    request = http1_request(first[:end], self.http1_get)
                except Refused:
                    writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                    await writer.drain()
                    raise
                up_r, up_w = await asyncio.open_connection(*self.upstream)
                self._open.add(up_w)
                up_w.write(request)
                await self._copy(up_r, writer)
        except Refused as e:
            self.refused += 1
            if self.refused <= 20 or self.refused % 1000 == 0:  # a flood cannot fill the log
                log.warning("%s: closed a connection from %s: %s (%d so far)", self.name,
                            addr, e, self.refused)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._conns -= 1
            for w in (writer, up_w):
                if w is not None:
                    self._open.discard(w)
                    w.close()

    @staticmethod
    async def _hello(reader: asyncio.StreamReader) -> bytes:
        """Enough of the start to tell HTTP/2 (its preface) from an HTTP/1 head."""
        buf = b""
        while True:
            if len(buf) >= len(PREFACE) and buf.startswith(PREFACE):
                return buf
            if not PREFACE.startswith(buf[:len(PREFACE)]) and b"\r\n\r\n" in buf:
                return buf
            if len(buf) > MAX_HTTP1_HEAD:
                raise Refused("an HTTP/1 head over 8 KiB")
            data = await reader.read(4096)
            if not data:
                raise ConnectionError("closed before a request")
            buf += data

    @staticmethod
    async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()
