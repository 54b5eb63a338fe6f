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
  forwards the same bytes, in order; a block that comes again on a connection whose
  dynamic table has not changed since it was decoded is checked from what it decoded
  to, H2RequestFilter._decode). A request (a header block opening a stream) passes
  only as `POST` to one of `allowed` (the LighthouseService methods the Managers call);
  a header block on an opened stream (trailers) carries no pseudo-header. Anything else,
  a frame that breaks the framing, an undecodable block, a PUSH_PROMISE, closes the
  connection before the offending frame reaches the Lighthouse.
- HTTP/1.x: a strict subset, one request per connection: a `GET` of a path in `http1_get`
  (the status page spotctl.elastic.ft reads before a new cluster's first quorum; torchft's
  Managers speak only HTTP/2), its head in printable ASCII with CRLF line ends (no bare LF
  or CR, NUL, other control byte or byte over 0x7E; HTAB only inside a header value), no
  body (`Content-Length: 0` at most), no upgrade, and nothing after the head: it is sent
  on with `Connection: close` and nothing more from that connection reaches the
  Lighthouse. torchft's parser (hyper) takes a bare LF as a line end, so a header value
  holding LF LF would otherwise end the allowed request and start a second one (the
  dashboard's kill route) behind it.
  Every other HTTP/1.x request is answered 403 and closed.

Every refusal is logged (one line each, at most 20 per 10 s; beyond that, one line per
window with the count left out).

Bounds, below the process's own descriptor limit (read at start: RLIMIT_NOFILE; the head
raises its soft limit to the hard one, spotctl.head.server): a forwarded connection holds
three descriptors of the process (the client's, the filter's to the Lighthouse and the
Lighthouse's accepted end), so at most a fifth of the limit in connections (4,096 at
most), half of them from one address. A connection is pending until its first request
passes: it has HELLO_S (10 s) for it, holds no upstream connection meanwhile, at most 16
are pending per address, and when the process is at its cap the oldest pending one is
closed for a newcomer. A connection with no bytes either way for IDLE_S (10 min, above a
quorum's 2 min long poll) is closed. Memory per connection: frames other than header
blocks are streamed (never buffered whole), a header block is at most 64 KiB, an HTTP/1
head 8 KiB. On local clusters and ssh hosts (through the controller's reverse forwards)
every replica connects from loopback, so the per-address caps are per-address for
cloud clusters only.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import threading
import time
from collections.abc import Iterable

log = logging.getLogger("spotctl.head.grpc_filter")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# the LighthouseService methods torchft 0.2.0's Managers call (its lighthouse client)
LIGHTHOUSE_METHODS = frozenset({"/torchft.LighthouseService/Quorum",
                                "/torchft.LighthouseService/Heartbeat"})
HELLO_S = 10.0  # from accept to the first request passed
IDLE_S = 600.0  # no bytes either way
MAX_HTTP1_HEAD = 8 * 1024
MAX_HEADER_BLOCK = 64 * 1024
MAX_CONNS = 4096  # the most, whatever the descriptor limit
PENDING_PER_ADDR = 16
FDS_PER_CONN = 3
LOG_WINDOW_S, LOG_PER_WINDOW = 10.0, 20
BACK_HIGH = 64 * 1024  # the client's send buffer over which the server is not read
SEEN_BLOCKS, SEEN_BLOCK_MAX = 16, 1024  # header blocks kept per connection, bytes each

_DATA, _HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x0, 0x1, 0x5, 0x9
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20
_FORBIDDEN_HTTP1 = (b"content-length", b"transfer-encoding", b"upgrade", b"expect",
                    b"http2-settings", b"connection")
_REQUEST_LINE = re.compile(rb"GET (/[!-~]*) HTTP/1\.[01]")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[\t -~]*")  # HTAB, SP and visible ASCII: no other control byte


class Refused(Exception):
    """What the filter does not pass; the connection is closed."""


def conn_budget(limit: int | None = None) -> int:
    """Connections the filter may hold under a descriptor limit (the process's soft
    RLIMIT_NOFILE when None): a fifth of it in forwarded connections of FDS_PER_CONN
    descriptors each, leaving the rest to the store, the API and the Lighthouse's own."""
    if limit is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(8, min(MAX_CONNS, limit * 3 // (5 * FDS_PER_CONN)))


class H2RequestFilter:
    """The client side of one HTTP/2 connection, after the preface: `feed` takes bytes as
    they arrive and returns those that may go on to the server; it raises Refused at the
    first frame that may not (nothing of it, or after it, is returned). Header blocks are
    held until whole (64 KiB at most) and checked; every other frame is passed on as its
    bytes arrive, so a connection never holds a whole (up to 16 MiB) frame."""

    def __init__(self, allowed: Iterable[str]):
        from hpack import Decoder

        self.allowed = frozenset(p.encode() for p in allowed)
        self._decoder = Decoder()
        self._buf = bytearray()
        self._pass = 0  # bytes of a streamed frame's payload still to pass on
        self._block: bytearray | None = None  # a header block awaiting its END_HEADERS
        self._held: list[bytes] = []  # its frames, sent on once the block passes
        self._block_sid = 0
        self._max_sid = 0  # the highest stream the client opened
        # header blocks seen whose decoding changed nothing, and their pseudo-headers
        self._seen: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}
        self.requests = 0

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while True:
            if self._pass:
                n = min(self._pass, len(self._buf))
                out += self._buf[:n]
                del self._buf[:n]
                self._pass -= n
                if self._pass:
                    break
                continue
            if len(self._buf) < 9:
                break
            length, ftype = int.from_bytes(self._buf[0:3], "big"), self._buf[3]
            if ftype in (_HEADERS, _CONTINUATION):
                if length > MAX_HEADER_BLOCK:
                    raise Refused("a header block over 64 KiB")
                if len(self._buf) < 9 + length:
                    break
                frame = bytes(self._buf[:9 + length])
                del self._buf[:9 + length]
                out += self._frame(frame)
                continue
            if self._block is not None:
                raise Refused("a frame inside a header block")
            if ftype == _PUSH_PROMISE:
                raise Refused("a PUSH_PROMISE from a client")
            out += self._buf[:9]
            del self._buf[:9]
            self._pass = length
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
        else:  # CONTINUATION
            if self._block is None or sid != self._block_sid:
                raise Refused("a CONTINUATION frame outside a header block")
            self._block += frame[9:]
            self._held.append(frame)
        if len(self._block) > MAX_HEADER_BLOCK:
            raise Refused("a header block over 64 KiB")
        if not flags & _END_HEADERS:
            return b""
        block, self._block = bytes(self._block), None
        pseudo = self._seen.get(block)
        if pseudo is None:
            pseudo = self._decode(block)
        self._check(sid, pseudo)
        return b"".join(self._held)

    def _decode(self, block: bytes) -> tuple[tuple[bytes, bytes], ...]:
        """The pseudo-headers of `block`, decoded in full. Kept for the next time the same
        bytes come while decoding them changed nothing of the decoder's state (its dynamic
        table's size and entries): decoding them again would give the same list and change
        nothing. A block that changes the state forgets every block kept (they may refer to
        entries that moved). gRPC clients send the same block for each call of a method once
        its headers are in the table (torchft's: a heartbeat's 35 bytes, its path a literal
        not indexed), and a decode in Python is most of the filter's work per request."""
        table = self._decoder.header_table
        before = (table.maxsize, tuple(table.dynamic_entries))
        try:
            headers = self._decoder.decode(block, raw=True)
        except Exception as e:  # noqa: BLE001 - any decoding failure refuses
            raise Refused(f"an undecodable header block ({type(e).__name__})") from None
        pseudo = tuple((bytes(k), bytes(v)) for k, v in headers if k.startswith(b":"))
        if (table.maxsize, tuple(table.dynamic_entries)) != before:
            self._seen.clear()
        elif len(block) <= SEEN_BLOCK_MAX:
            if len(self._seen) >= SEEN_BLOCKS:
                self._seen.clear()
            self._seen[block] = pseudo
        return pseudo

    def _check(self, sid: int, pseudo: tuple[tuple[bytes, bytes], ...]) -> None:
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
    a GET of an allowed path with its headers and `Connection: close`; Refused otherwise.
    Lines end in CRLF only; a bare CR or LF, or any other control byte, refuses."""
    lines = head.split(b"\r\n")
    for line in lines:
        if b"\r" in line or b"\n" in line:
            raise Refused("a bare CR or LF in an HTTP/1 head")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None or m.group(1).decode("latin-1") not in set(allowed_get):
        raise Refused(f"HTTP/1 request {lines[0][:80]!r}")
    kept = [lines[0]]
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise Refused(f"a malformed HTTP/1 header line {line[:80]!r}")
        if not _VALUE.fullmatch(value):
            raise Refused(f"a control byte in HTTP/1 header {name.decode('latin-1')!r}")
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


class _Conn:
    """One client connection's place in the filter's accounting."""

    def __init__(self, addr: str, writer: asyncio.StreamWriter):
        self.addr = addr
        self.writer = writer
        self.pending = True  # until its first request passes
        self.last = time.monotonic()  # bytes either way


class _Back(asyncio.Protocol):
    """The server's side of a passed HTTP/2 connection: what the server sends is written
    to the client from the event loop's read callback, as it arrives (no task, no stream
    buffer in between: at a quorum the Lighthouse answers every replica at once, and each
    answer's way through the filter adds to the last one's wait). Reading from the server
    pauses while the client's send buffer is over BACK_HIGH (the client does not read);
    `full` is a future while the server's send buffer is full (the client's bytes wait)."""

    def __init__(self, client: asyncio.StreamWriter, conn: _Conn):
        self.client, self.conn = client, conn
        self.server: asyncio.Transport | None = None
        self.full: asyncio.Future[None] | None = None
        self._resuming: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.server = transport

    def data_received(self, data: bytes) -> None:
        self.conn.last = time.monotonic()
        out = self.client.transport
        if out.is_closing():
            return  # the client's connection is going: this one goes with it (_handle)
        out.write(data)
        if out.get_write_buffer_size() > BACK_HIGH and self.server is not None:
            self.server.pause_reading()
            self._resuming = asyncio.ensure_future(self._resume())

    async def _resume(self) -> None:
        try:
            await self.client.drain()
        except (ConnectionError, OSError):
            return
        if self.server is not None and not self.server.is_closing():
            self.server.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self.full is None:
            self.full = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.full is not None:
            if not self.full.done():
                self.full.set_result(None)
            self.full = None


class GrpcFilter:
    """Serves host:port (port 0 = any free one) and forwards what passes to `upstream`
    (which may be changed while serving: new connections go to the new one). Runs its own
    event loop in a daemon thread; bound (or raising OSError) on return."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int],
                 allowed: Iterable[str] = LIGHTHOUSE_METHODS,
                 http1_get: Iterable[str] = ("/status",), name: str = "lighthouse filter"):
        self.upstream = upstream
        self.name = name
        self.allowed = frozenset(allowed)
        self.http1_get = frozenset(http1_get)
        self.max_conns = min(MAX_CONNS, conn_budget())
        self.max_per_addr = max(4, self.max_conns // 2)
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=fam, backlog=256)
        self.port = int(self._sock.getsockname()[1])
        self.refused = 0  # connections closed for what they sent (tests read it)
        self.dropped = 0  # connections closed for a cap or a timeout
        # both sides of every connection
        self._open: set[asyncio.StreamWriter | asyncio.BaseTransport] = set()
        self._conns: dict[asyncio.StreamWriter, _Conn] = {}  # in accept order
        self._log_window = (0.0, 0, 0)  # start, lines logged, lines left out
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
            self._reaper = self._loop.create_task(self._reap())
            self._ready.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    def stop(self) -> None:
        def close() -> None:
            self._server.close()
            self._reaper.cancel()
            for w in list(self._open):
                w.close()
            self._loop.call_later(0.2, self._loop.stop)

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(close)
            self._thread.join(5)
        self._sock.close()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _note(self, addr: str, why: object) -> None:
        """Log a refusal: every one, at most LOG_PER_WINDOW lines per LOG_WINDOW_S, then
        one line with how many the window left out."""
        now = time.monotonic()
        start, shown, hidden = self._log_window
        if now - start >= LOG_WINDOW_S:
            if hidden:
                log.warning("%s: %d more refusals in %.0f s not logged one by one (%d so far)",
                            self.name, hidden, LOG_WINDOW_S, self.refused)
            start, shown, hidden = now, 0, 0
        if shown < LOG_PER_WINDOW:
            log.warning("%s: closed a connection from %s: %s (%d so far)", self.name, addr,
                        why, self.refused)
            shown += 1
        else:
            hidden += 1
        self._log_window = (start, shown, hidden)

    def _admit(self, conn: _Conn) -> str | None:
        """Why `conn` may not be held (None: it may), closing the oldest pending
        connection of its address, or of all, to make room where that is the cap."""
        mine = [c for c in self._conns.values() if c.addr == conn.addr]
        pending = [c for c in mine if c.pending]
        if len(pending) >= PENDING_PER_ADDR:
            self._drop(pending[0])
        elif len(mine) >= self.max_per_addr:
            return f"{len(mine)} connections from this address (at most {self.max_per_addr})"
        elif len(self._conns) >= self.max_conns:
            oldest = next((c for c in self._conns.values() if c.pending), None)
            if oldest is None:
                return f"{len(self._conns)} connections (at most {self.max_conns})"
            self._drop(oldest)
        return None

    def _drop(self, conn: _Conn) -> None:
        self.dropped += 1
        self._conns.pop(conn.writer, None)
        conn.writer.close()

    async def _reap(self) -> None:
        """Close connections silent past HELLO_S before their first request, or IDLE_S."""
        while True:
            await asyncio.sleep(min(1.0, HELLO_S / 4))
            now = time.monotonic()
            for c in list(self._conns.values()):
                if now - c.last > (HELLO_S if c.pending else IDLE_S):
                    self._drop(c)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        conn = _Conn(str(peer[0]) if peer else "?", writer)
        full = self._admit(conn)
        if full is not None:
            self.dropped += 1
            self._note(conn.addr, full)
            writer.close()
            return
        self._conns[writer] = conn
        self._open.add(writer)
        up_w: asyncio.StreamWriter | asyncio.BaseTransport | None = None
        try:
            first = await asyncio.wait_for(self._hello(reader), HELLO_S)
            if first.startswith(PREFACE):
                flt = H2RequestFilter(self.allowed)
                send = bytearray(PREFACE + flt.feed(first[len(PREFACE):]))
                while not flt.requests:  # no upstream connection before a request passes
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed before a request")
                    send += flt.feed(data)
                    if len(send) > MAX_HEADER_BLOCK + 65536:
                        raise Refused("more than 128 KiB before a request")
                conn.pending = False
                conn.last = time.monotonic()
                up, back = await self._loop.create_connection(
                    lambda: _Back(writer, conn), *self.upstream)
                self._open.add(up)
                up_w = up
                up.write(bytes(send))
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    conn.last = time.monotonic()
                    up.write(flt.feed(data))
                    if back.full is not None:
                        await back.full
            else:
                end = first.find(b"\r\n\r\n")
                try:
                    request = http1_request(first if end < 0 else first[:end], self.http1_get)
                    if end < 0:
                        raise Refused("an HTTP/1 head with no CRLF CRLF end")
                    if first[end + 4:]:
                        raise Refused("bytes after the HTTP/1 request (one per connection)")
                except Refused:
                    writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                    await writer.drain()
                    raise
                conn.pending = False
                up_r, up_w = await asyncio.open_connection(*self.upstream)
                self._open.add(up_w)
                up_w.write(request)
                await self._copy(up_r, writer, conn)
        except Refused as e:
            self.refused += 1
            self._note(conn.addr, e)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._conns.pop(writer, None)
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
            if not PREFACE.startswith(buf[:len(PREFACE)]):
                if b"\r\n\r\n" in buf:
                    return buf
                # a strict HTTP/1 head holds no LF but in CRLF: refuse at once, not at 8 KiB
                if re.search(rb"[\x00-\x08\x0a-\x1f\x7f-\xff]", buf.replace(b"\r\n", b"")):
                    if not buf.endswith(b"\r"):
                        return buf
            if len(buf) > MAX_HTTP1_HEAD:
                raise Refused("an HTTP/1 head over 8 KiB")
            data = await reader.read(4096)
            if not data:
                raise ConnectionError("closed before a request")
            buf += data

    @staticmethod
    async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    conn: _Conn) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                conn.last = time.monotonic()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()
