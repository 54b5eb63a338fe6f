"""The filter in front of the head's Lighthouse (spotctl.head.grpc_filter): torchft's own
client gets its quorum through it, spotctl's start-up check reads the status page, and
nothing else of the Lighthouse's HTTP side passes, whatever the encoding (HTTP/1.1, HTTP/2
with HPACK's static and dynamic tables, Huffman strings, CONTINUATION frames, padding).
The whole attack on a running cluster is tests/security/test_torchft_attacks.py."""

from __future__ import annotations

import importlib.util
import re
import socket
import urllib.request
from datetime import timedelta

import pytest

pytest.importorskip("hpack")
from hpack import Encoder  # noqa: E402

from spotctl.head.grpc_filter import (  # noqa: E402
    LIGHTHOUSE_METHODS,
    H2RequestFilter,
    Refused,
    http1_request,
)
from tests.conftest import send_and_read, wait_until  # noqa: E402
from tests.security.torchft_attacks import _frame, grpc_call, http1, kill_request  # noqa: E402

HAVE_FT = importlib.util.find_spec("torchft") is not None
QUORUM = "/torchft.LighthouseService/Quorum"
KILL = "/replica/r1/kill"


def _req(path: str, method: str = "POST") -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "http"), (":path", path),
            (":authority", "10.0.0.5:29510"), ("content-type", "application/grpc"),
            ("te", "trailers")]


def _data(sid: int) -> bytes:
    return _frame(0x0, 0x1, sid, b"\x00\x00\x00\x00\x00")


def test_allowed_requests_pass_byte_for_byte_in_any_split() -> None:
    enc = Encoder()
    # the same request twice: the second refers to the dynamic table the first filled
    wire = (_frame(0x4, 0, 0, b"") + _frame(0x1, 0x4, 1, enc.encode(_req(QUORUM))) + _data(1)
            + _frame(0x1, 0x4, 3, enc.encode(_req(QUORUM))) + _data(3)
            + _frame(0x1, 0x5, 1, enc.encode([("x-trailer", "1")])))  # trailers of stream 1
    whole = H2RequestFilter(LIGHTHOUSE_METHODS)
    assert whole.feed(wire) == wire and whole.requests == 2
    one = H2RequestFilter(LIGHTHOUSE_METHODS)
    assert b"".join(one.feed(wire[i:i + 1]) for i in range(len(wire))) == wire


def _refused_at(frames: list[bytes]) -> bytes:
    """What passed before the filter refused (it must refuse)."""
    f = H2RequestFilter(LIGHTHOUSE_METHODS)
    passed = b""
    for fr in frames:
        try:
            passed += f.feed(fr)
        except Refused:
            return passed
    raise AssertionError("the filter passed every frame")


def test_a_large_frame_is_streamed_not_held() -> None:
    """A member's 16 MiB frames held whole cost 16 MiB per connection (issue 60): frames
    other than header blocks pass as their bytes arrive; a header block over 64 KiB is
    refused from its frame header."""
    enc = Encoder()
    f = H2RequestFilter(LIGHTHOUSE_METHODS)
    opened = _frame(0x1, 0x4, 1, enc.encode(_req(QUORUM)))
    assert f.feed(opened) == opened
    head = (16 * 1024 * 1024 - 1).to_bytes(3, "big") + bytes([0x0, 0x0]) + (1).to_bytes(4, "big")
    chunk = b"\0" * 65536
    assert f.feed(head + chunk) == head + chunk
    for _ in range(16):
        assert f.feed(chunk) == chunk
    assert len(f._buf) == 0
    with pytest.raises(Refused):
        H2RequestFilter(LIGHTHOUSE_METHODS).feed((70000).to_bytes(3, "big") + b"\x01\x04"
                                                 + (1).to_bytes(4, "big"))


def test_the_kill_route_never_reaches_the_lighthouse_however_encoded() -> None:
    enc = Encoder()
    ok = _frame(0x1, 0x4, 1, enc.encode(_req(QUORUM)))
    # plain, after an allowed request (dynamic table in use), Huffman-free, as a GET
    assert _refused_at([ok, _data(1), _frame(0x1, 0x4, 3, enc.encode(_req(KILL)))]) == ok + _data(1)
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(_req(KILL), huffman=False))]) == b""
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(_req(QUORUM, "GET")))]) == b""
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(_req("/")))]) == b""
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(_req(QUORUM + "?x")))]) == b""
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(
        _req("/torchft.ManagerService/Kill")))]) == b""
    # the path in a CONTINUATION frame: nothing of the block passes
    block = Encoder().encode(_req(KILL))
    assert _refused_at([_frame(0x1, 0, 1, block[:4]), _frame(0x9, 0x4, 1, block[4:])]) == b""
    # padded and with a priority field
    padded = bytes([3]) + b"\0\0\0\x00\x10" + Encoder().encode(_req(KILL)) + b"\0\0\0"
    assert _refused_at([_frame(0x1, 0x4 | 0x8 | 0x20, 1, padded)]) == b""
    # two paths, one allowed; a pseudo-header smuggled into trailers
    assert _refused_at([_frame(0x1, 0x4, 1, Encoder().encode(
        [*_req(QUORUM), (":path", KILL)]))]) == b""
    enc2 = Encoder()
    first = _frame(0x1, 0x4, 1, enc2.encode(_req(QUORUM)))
    assert _refused_at([first, _frame(0x1, 0x5, 1, enc2.encode([(":path", KILL)]))]) == first
    # framing: a DATA frame inside a header block, a stray CONTINUATION, a PUSH_PROMISE,
    # an undecodable block
    assert _refused_at([_frame(0x1, 0, 1, block[:4]), _data(1)]) == b""
    assert _refused_at([_frame(0x9, 0x4, 1, block)]) == b""
    assert _refused_at([_frame(0x5, 0x4, 1, b"\0\0\0\x02" + block)]) == b""
    assert _refused_at([_frame(0x1, 0x4, 1, b"\xff\xff\xff\xff")]) == b""


def test_http1_passes_only_a_get_of_the_status_page() -> None:
    assert http1_request(b"GET /status HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\n"
                         b"Content-Length: 0", ["/status"]) == (
        b"GET /status HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    for head in (b"POST /replica/r1/kill HTTP/1.1\r\nHost: h", b"GET / HTTP/1.1",
                 b"GET /status?x HTTP/1.1", b"GET /replica/r1/kill HTTP/1.1",
                 b"GET /status HTTP/1.1\r\nContent-Length: 5",
                 b"GET /status HTTP/1.1\r\nTransfer-Encoding: chunked",
                 b"GET /status HTTP/1.1\r\nUpgrade: h2c",
                 b"GET /status HTTP/1.1\r\nHost : h", b"GET  /status HTTP/1.1"):
        with pytest.raises(Refused):
            http1_request(head, ["/status"])


def test_http1_is_a_strict_subset_with_crlf_line_ends_and_no_control_bytes() -> None:
    # hyper (torchft's HTTP/1 parser) takes a bare LF as a line end: each of these would
    # end the allowed GET inside a header and start a second request behind it
    smuggle = b"POST /replica/r1/kill HTTP/1.1\r\nHost: h\r\nContent-Length: 0"
    for head in (b"GET /status HTTP/1.1\r\nX-A: a\n\n" + smuggle,
                 b"GET /status HTTP/1.1\r\nX-A: a\n" + smuggle,
                 b"GET /status HTTP/1.1\nHost: h",
                 b"GET /status HTTP/1.1\r\nX-A: a\rb",
                 b"GET /status HTTP/1.1\r\nX-A: a\x00b",
                 b"GET /status HTTP/1.1\r\nX-A: a\x0bb",
                 b"GET /status HTTP/1.1\r\nX-A: a\x7fb",
                 b"GET /status HTTP/1.1\r\nX-A: \xc3\xa9",
                 b"GET /status HTTP/1.1\r\nX\x00A: a",
                 b"GET /status\x00 HTTP/1.1",
                 b"GET /status HTTP/1.1\r\n: a"):
        with pytest.raises(Refused):
            http1_request(head, ["/status"])
    # HTAB inside a value is the one control byte allowed
    assert http1_request(b"GET /status HTTP/1.1\r\nX-A: a\tb", ["/status"]).startswith(
        b"GET /status HTTP/1.1\r\nX-A: a\tb\r\n")


class _FakeManagerAddress:
    """A listener given to the Lighthouse as a replica's Manager address: its dashboard's
    kill route makes the Lighthouse dial it (torchft's ManagerClient, then `Kill`), so a
    connection here is the Lighthouse serving a kill."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.dialled: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                c.settimeout(5)
                try:
                    self.dialled.append(c.recv(4096) or b"(closed)")
                except OSError:
                    self.dialled.append(b"(no bytes)")


@pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")
def test_a_kill_smuggled_behind_the_status_page_never_reaches_the_lighthouse(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 60, finding 1: `GET /status` with a header value holding LF LF and the kill
    route behind it. Judged by the Lighthouse's own behaviour: it dials the replica's
    Manager address to serve a kill, and through the filter it never does."""
    from torchft.coordination import LighthouseClient

    from spotctl.head.lighthouse import Lighthouse
    manager = _FakeManagerAddress()
    lh = Lighthouse("127.0.0.1")
    try:
        client = LighthouseClient(lh.address, connect_timeout=timedelta(seconds=10))
        client.heartbeat("r1")
        client.quorum("r1", timeout=timedelta(seconds=10), address=manager.address,
                      store_address="127.0.0.1:9", step=1, world_size=1)
        kill = b"POST /replica/r1/kill HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
        attacks = [
            b"GET /status HTTP/1.1\r\nHost: h\r\nX-A: a\n\n" + kill,  # the issue's
            b"GET /status HTTP/1.1\nHost: h\n\n" + kill,  # LF line ends throughout
            b"GET /status HTTP/1.1\r\nHost: h\r\n\r\n" + kill,  # plainly pipelined
            b"GET /status HTTP/1.1\r\nHost: h\r\nX-A: a\r\x00\n\n" + kill,
        ]
        with caplog.at_level("WARNING", logger="spotctl.head.grpc_filter"):
            for a in attacks:
                answer = send_and_read("127.0.0.1", lh.port, a)
                assert answer.startswith(b"HTTP/1.1 403") and answer.count(b"HTTP/1.") == 1, \
                    answer[:200]
        # each answered before any kill could have been (the Lighthouse answers a kill
        # once it has dialled the Manager)
        assert manager.dialled == [], "the Lighthouse served a smuggled kill"
        assert lh.refused == len(attacks)
        assert len([r for r in caplog.records if "closed a connection" in r.message]) \
            == len(attacks)
        # the same bytes on torchft's own (unfiltered, loopback) listener are served: the
        # probe sees a kill when there is one, and it is the first it saw
        with socket.create_connection(("127.0.0.1", lh.inner_port), timeout=10) as s:
            s.sendall(attacks[0])
            wait_until(lambda: manager.dialled, 30, "the Lighthouse to dial the Manager address")
        # and the status page still passes, alone
        with urllib.request.urlopen(f"{lh.address}/status", timeout=10) as r:
            assert b"<b>r1</b>" in r.read()
    finally:
        lh.stop()
        manager.sock.close()


@pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")
def test_torchfts_client_gets_its_quorum_through_the_filter_and_nothing_else_passes() -> None:
    from torchft.coordination import LighthouseClient

    from spotctl.head.lighthouse import Lighthouse

    lh = Lighthouse("127.0.0.1")
    try:
        client = LighthouseClient(lh.address, connect_timeout=timedelta(seconds=10))
        client.heartbeat("r1")
        q = client.quorum("r1", timeout=timedelta(seconds=10), address="http://127.0.0.1:9",
                          store_address="127.0.0.1:9", step=3, world_size=1)
        assert [m.replica_id for m in q.participants] == ["r1"]
        with urllib.request.urlopen(f"{lh.address}/status", timeout=10) as r:
            assert b"<b>r1</b>" in r.read()
        assert lh.refused == 0

        assert http1(lh.address, "POST", KILL).status == "403"
        assert http1(lh.address, "GET", "/").status == "403"
        assert grpc_call(lh.address, KILL).closed
        assert grpc_call(lh.address, "/torchft.ManagerService/Kill", kill_request()).closed
        with socket.create_connection(("127.0.0.1", lh.port), timeout=10) as s:
            s.sendall(b"\x16\x03\x01\x00\x05hello\r\n\r\n")  # neither protocol
            assert s.recv(100).startswith(b"HTTP/1.1 403")
        # torchft's own server (loopback) serves the dashboard the filter keeps out
        assert http1(lh.inner_address, "GET", "/").status == "200"
        # and the client still gets its quorum on the same Lighthouse
        assert client.quorum("r1", timeout=timedelta(seconds=10), address="http://127.0.0.1:9",
                             store_address="127.0.0.1:9", step=4, world_size=1).quorum_id >= 1
    finally:
        lh.stop()


def test_connections_are_capped_and_a_silent_one_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from spotctl.head import grpc_filter

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    up = ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    monkeypatch.setattr(grpc_filter, "MAX_CONNS", 2)
    monkeypatch.setattr(grpc_filter, "HELLO_S", 3.0)
    f = grpc_filter.GrpcFilter("127.0.0.1", 0, ("127.0.0.1", up.server_address[1]))
    url = f"http://127.0.0.1:{f.port}"
    try:
        held = [socket.create_connection(("127.0.0.1", f.port), timeout=10) for _ in range(2)]
        for s in held:
            s.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface: each holds a slot
        wait_until(lambda: f.connections == 2, 10, "both held")
        # at the cap, a newcomer takes the place of the oldest that has sent no request
        assert http1(url, "GET", "/status").status == "200"
        assert _closed(held[0])
        assert _closed(held[1])  # silent past HELLO_S: closed
        for s in held:
            s.close()
        assert http1(url, "GET", "/status").status == "200"
    finally:
        f.stop()
        up.shutdown()


def _closed(s: socket.socket) -> bool:
    """The peer closed without a byte (a reset counts); a socket timeout raises."""
    try:
        return s.recv(10) == b""
    except ConnectionResetError:
        return True


def test_the_connection_budget_is_a_fifth_of_the_descriptor_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kills: grpc_filter.py conn_budget's arithmetic, its floor of 8, the soft limit read
    ([0], not the hard [1]) and an unlimited soft limit (mutmut 2026-12-07, 11 survivors):
    three descriptors a connection, three fifths of the limit for them."""
    import resource

    from spotctl.head import grpc_filter

    assert [grpc_filter.conn_budget(n) for n in (1000, 1004, 10, 10**6)] == [200, 200, 8, 4096]
    assert all(type(grpc_filter.conn_budget(n)) is int for n in (1000, 1004))
    monkeypatch.setattr(grpc_filter.resource, "getrlimit", lambda _: (1000, 50_000))
    assert grpc_filter.conn_budget() == 200
    inf = resource.RLIM_INFINITY
    monkeypatch.setattr(grpc_filter.resource, "getrlimit", lambda _: (inf, inf))
    assert grpc_filter.conn_budget() == 4096


def _why(frames: list[bytes]) -> str:
    """The reason the filter gives for refusing `frames` (it must refuse)."""
    f = H2RequestFilter(LIGHTHOUSE_METHODS)
    try:
        for fr in frames:
            f.feed(fr)
    except Refused as e:
        return str(e)
    raise AssertionError("the filter passed every frame")


def test_header_blocks_are_read_to_the_byte_and_each_refusal_says_why() -> None:
    """kills: grpc_filter.py H2RequestFilter's padding, PRIORITY and CONTINUATION handling,
    the 64 KiB bound at its edge, the stream id's four bytes, trailers on the last stream,
    the held frames sent on as they came, and each refusal's reason (mutmut 2026-12-07:
    most of _frame's 43 and _check's 11 survivors; the tests before checked only that a
    refusal happened)."""
    enc = Encoder()
    block = enc.encode(_req(QUORUM))
    # HEADERS padded (3 bytes) with a PRIORITY field and no END_HEADERS; the block follows
    # in two CONTINUATION frames: passed on byte for byte
    head = _frame(0x1, 0x8 | 0x20, 1, bytes([3]) + b"\x00\x00\x00\x00\x10" + b"\x00" * 3)
    cont = [_frame(0x9, 0, 1, block[:7]), _frame(0x9, 0x4, 1, block[7:])]
    wire = head + b"".join(cont) + _data(1)
    f = H2RequestFilter(LIGHTHOUSE_METHODS)
    assert f.feed(wire) == wire and f.requests == 1
    # trailers on the stream just opened (sid == the highest) pass; a request after them
    # on a lower stream is trailers with pseudo-headers: refused
    trailers = _frame(0x1, 0x5, 1, enc.encode([("x-trailer", "1")]))
    assert f.feed(trailers) == trailers
    assert _why([_frame(0x1, 0x4, 7, Encoder().encode(_req(QUORUM))),
                 _frame(0x1, 0x4, 5, Encoder().encode(_req(QUORUM)))]) == \
        "pseudo-headers in trailers"
    # the stream id is all four bytes (less the reserved bit): 2^24 + 1 is above 3
    e2 = Encoder()
    assert _why([_frame(0x1, 0x4, (1 << 24) + 1, e2.encode(_req(QUORUM))),
                 _frame(0x1, 0x4, 3, e2.encode(_req(QUORUM)))]) == "pseudo-headers in trailers"
    # padding as long as the payload, a short PRIORITY field
    assert _why([_frame(0x1, 0x8 | 0x4, 1, bytes([4]) + b"abc")]) == "bad padding"
    assert _why([_frame(0x1, 0x20 | 0x4, 1, b"\x00\x00\x00\x00")]) == "a short PRIORITY field"
    # CONTINUATION: on another stream, with no block open
    assert _why([_frame(0x1, 0, 1, block[:7]), _frame(0x9, 0x4, 3, block[7:])]) == \
        "a CONTINUATION frame outside a header block"
    assert _why([_frame(0x9, 0x4, 1, block)]) == "a CONTINUATION frame outside a header block"
    assert _why([_frame(0x1, 0, 1, block[:7]), _data(1)]) == "a frame inside a header block"
    assert _why([_frame(0x1, 0, 1, block[:7]), _frame(0x1, 0x4, 1, block)]) == \
        "a HEADERS frame inside another header block"
    assert _why([_frame(0x5, 0x4, 1, b"\x00\x00\x00\x02")]) == "a PUSH_PROMISE from a client"
    assert _why([_frame(0x1, 0x4, 0, block)]) == "a header block on stream 0"
    assert _why([_frame(0x1, 0x4, 1, Encoder().encode(_req("/x")))]) == \
        "path b'/x' is not a method this filter passes"
    assert _why([_frame(0x1, 0x4, 1, Encoder().encode(_req(QUORUM, "GET")))]) == \
        "method b'GET' is not POST"
    assert re.fullmatch(r"an undecodable header block \(\w+\)",
                        _why([_frame(0x1, 0x4, 1, b"\xff\xff\xff\xff\xff")]))
    # a block of exactly 64 KiB gets past the size bound, in one frame or in two (hpack's
    # own bound on the decoded list then refuses it); one byte more is over the bound
    size = 64 * 1024
    pad = size

    def padded(n: int) -> bytes:
        return bytes(Encoder().encode(_req(QUORUM) + [("x-pad", "a" * n)], huffman=False))

    while len(big := padded(pad)) != size:
        pad -= len(big) - size
    hpack_says = "an undecodable header block (OversizedHeaderListError)"
    assert _why([_frame(0x1, 0x4, 1, big)]) == hpack_says
    assert _why([_frame(0x1, 0, 1, big[:40_000]), _frame(0x9, 0x4, 1, big[40_000:])]) == \
        hpack_says
    assert _why([_frame(0x1, 0x4, 1, big + b"\x00")]) == "a header block over 64 KiB"
    assert _why([_frame(0x1, 0, 1, big[:40_000]),
                 _frame(0x9, 0x4, 1, big[40_000:] + b"\x00")]) == "a header block over 64 KiB"


def test_a_header_block_seen_before_is_decoded_again_once_the_table_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The filter keeps the pseudo-headers of a header block whose decoding changed no HPACK
    state and uses them when the same bytes come again (gRPC clients resend one block per
    call): here the same 3 bytes name the Quorum path through dynamic entry 62. After a
    block that changes the dynamic table (trailers that put another entry at 62, or a table
    size update that empties it) the same bytes mean other headers, and the filter decodes
    them again: refused as the Lighthouse's decoder would read them (a kept block that
    outlived the table would pass them as Quorum)."""
    path = QUORUM.encode()
    indexing = b"\x83\x86\x44" + bytes([len(path)]) + path  # POST, http, :path into entry 62
    again = b"\x83\x86\xbe"  # POST, http, entry 62
    opened = [_frame(0x1, 0x4, 1, indexing), _frame(0x1, 0x4, 3, again), _data(3),
              _frame(0x1, 0x4, 5, again), _frame(0x1, 0x4, 7, again)]

    def fed() -> tuple[H2RequestFilter, list[bytes]]:
        f = H2RequestFilter(LIGHTHOUSE_METHODS)
        decoded: list[bytes] = []
        decode = f._decoder.decode

        def counted(block: bytes, raw: bool = False) -> object:
            decoded.append(bytes(block))
            return decode(block, raw=raw)

        monkeypatch.setattr(f._decoder, "decode", counted)
        for fr in opened:
            assert f.feed(fr) == fr
        return f, decoded

    f, decoded = fed()
    assert f.requests == 4 and decoded == [indexing, again]  # the last two: the kept block
    # trailers of stream 7 that put x-a: b at entry 62 (the path moves to 63)
    shift = _frame(0x1, 0x5, 7, b"\x40\x03x-a\x01b")
    assert f.feed(shift) == shift
    with pytest.raises(Refused, match=re.escape("path b'' is not a method this filter passes")):
        f.feed(_frame(0x1, 0x4, 9, again))
    f, decoded = fed()
    f.feed(shift)
    moved = _frame(0x1, 0x4, 9, b"\x83\x86\xbf")  # entry 63: the path
    assert f.feed(moved) == moved and f.requests == 5
    # a request whose block sets the table's size to 0 and back to 4,096 (emptied, same size)
    f, decoded = fed()
    emptied = _frame(0x1, 0x4, 9, b"\x20\x3f\xe1\x1f\x83\x86\x04" + bytes([len(path)]) + path)
    assert f.feed(emptied) == emptied
    with pytest.raises(Refused, match=re.escape("an undecodable header block (InvalidTableIndex)")):
        f.feed(_frame(0x1, 0x4, 11, again))


def test_header_blocks_kept_per_connection_are_bounded() -> None:
    """At most SEEN_BLOCKS blocks of at most SEEN_BLOCK_MAX bytes each are kept per connection
    (a member sending ever-new trailers holds no more)."""
    from spotctl.head.grpc_filter import SEEN_BLOCK_MAX, SEEN_BLOCKS

    f = H2RequestFilter(LIGHTHOUSE_METHODS)
    f.feed(_frame(0x1, 0x4, 1, Encoder().encode(_req(QUORUM))))
    sizes = []
    for i in range(3 * SEEN_BLOCKS):
        f.feed(_frame(0x1, 0x5, 1, b"\x00\x03x-n" + bytes([len(str(i))]) + str(i).encode()))
        sizes.append(len(f._seen))
    assert max(sizes) == SEEN_BLOCKS and sizes[:SEEN_BLOCKS] == list(range(1, SEEN_BLOCKS + 1))
    value = b"v" * SEEN_BLOCK_MAX
    long = b"\x00\x03x-n\x7f" + bytes([(len(value) - 127) & 0x7F | 0x80, (len(value) - 127) >> 7]) \
        + value
    f.feed(_frame(0x1, 0x5, 1, long))
    assert len(long) > SEEN_BLOCK_MAX and long not in f._seen


def test_the_servers_bytes_wait_while_the_client_reads_none() -> None:
    """The server's side of a passed connection (grpc_filter._Back) writes what the server
    sends straight to the client; while the client reads nothing the filter stops reading
    the server once the client's send buffer is over BACK_HIGH (a member that never reads
    its answers holds no more of the filter's memory), and reads it again, every byte in
    order, when the client reads. The other way, the client's bytes wait (`full`) while
    the server reads none."""
    import asyncio

    from spotctl.head.grpc_filter import BACK_HIGH, _Back, _Conn

    sent = bytes(range(256)) * (4 * 4096)  # 4 MiB

    async def until(cond: object) -> None:
        for _ in range(3000):  # a deadline for the condition (30 s), not a timing check
            if cond():  # type: ignore[operator]
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached in 30 s")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
            loop.create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)),
                                            "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        mine, theirs = socket.socketpair()  # the filter's end and the client's
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        theirs.setblocking(False)
        _, client = await asyncio.open_connection(sock=mine)
        up, back = await loop.create_connection(lambda: _Back(client, _Conn("c", client)),
                                                "127.0.0.1", port)
        srv_r, srv_w = await accepted
        srv_w.write(sent)
        await until(lambda: not up.is_reading())
        assert client.transport.get_write_buffer_size() <= BACK_HIGH + 256 * 1024
        got = bytearray()
        while len(got) < len(sent):
            got += await loop.sock_recv(theirs, 65536)
        assert bytes(got) == sent and up.is_reading()
        # the client's way: the server reads nothing, the filter's writes to it wait
        while back.full is None:
            up.write(b"\0" * 65536)
            await asyncio.sleep(0)
        waiting = back.full
        assert not waiting.done()
        await srv_r.readexactly(1 << 20)
        await until(waiting.done)
        assert back.full is None
        srv_w.close()  # the server goes: the client's connection goes with it
        await until(lambda: client.transport.is_closing())
        theirs.close()
        server.close()

    asyncio.run(main())
