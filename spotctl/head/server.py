"""The head process: torchrun's c10d rendezvous store and the coordinator API.

`spotctl head --dir DIR` (local mode: a detached process; cloud: a systemd unit on a
small on-demand VM). The token is read from a file, never from the command line. Every
API request needs `Authorization: Bearer <token>`: the cluster secret (the controller)
or a node's own token (spotctl.head.auth), which may only call the node routes and speak
for that node. Every field is validated (spotctl.head.validate); sizes, connections and
the in-memory event list are capped; a failing tick is logged, never fatal. Before the
token is read a request has a deadline (the whole request, not each read) and capped
request-line and header sizes, and unauthenticated connections make room for newcomers
(_BoundedHTTPServer): hostile clients without a token cannot lock the controller out.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from spotctl.head import validate
from spotctl.head.admission import AdmittingHTTPServer
from spotctl.head.auth import Principal, identify
from spotctl.head.coordinator import Coordinator
from spotctl.head.rebalancer import Rebalancer
from spotctl.sockets import listening_store
from spotctl.spec import MAX_GPUS
from spotctl.state import write_json_atomic

log = logging.getLogger("spotctl.head")
MAX_BODY = 1 << 20
MAX_CONNECTIONS = 256  # concurrent (a thread each)
PER_ADDRESS = 64  # unauthenticated connections one address may hold at once
PER_NODE_TRUSTED = 8  # authenticated connections one node credential may hold
EVICTING_MAX = 32  # connections closed for newcomers whose threads have not ended yet
# read before the token is checked: a request's line, its header block and header count
MAX_REQUEST_LINE = 4096
MAX_HEADER_BYTES = 8192
MAX_HEADERS = 64
REQUEST_DEADLINE_S = 10.0  # the whole request (line, headers, body) arrives within this
MAX_NODES = 1024
MAX_EVENTS = 10_000  # kept in memory (all are journaled to events.jsonl)
MAX_EVENTS_REPLY = MAX_EVENTS
# what one node's requests may hold of that window (its oldest beyond go, still journaled)
MAX_EVENTS_PER_NODE = MAX_EVENTS // 10
# a step reported above what the node (or the cluster) last reported plus this rate times
# the seconds since, plus the slack, is refused (400): no node trains faster than that
MAX_STEP_RATE = 10_000.0
STEP_SLACK = 10_000
BOUNDS_FILE = "bounds.json"  # the highest step believed, kept across head restarts
HANDLER_TIMEOUT_S = 10.0  # a write to a client that does not read
NODE_RATE = 50.0  # requests a second per node credential (an agent sends ~4)
NODE_BURST = 100.0
# what a node's own credential may call (everything else is the controller's)
NODE_ROUTES = {("GET", "/api/health"), ("POST", "/api/heartbeat"), ("POST", "/api/notice"),
               ("POST", "/api/event")}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class RateLimit:
    """A token bucket per node: `rate` requests a second, bursts of `burst`. An agent
    sends about 4 a second; a node flooding the head is answered 429 and slows nobody
    else down (the controller is not limited)."""

    def __init__(self, rate: float = NODE_RATE, burst: float = NODE_BURST,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # node -> (tokens, at)
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            ok = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
            if len(self._buckets) > 4 * MAX_NODES:  # ids are MAC-checked: this is a bound
                self._buckets.clear()
            return ok


class StepBounds:
    """What steps the head believes. A report's steps (step, resume_step, last_ckpt,
    drain_step) may exceed neither the highest its node reported nor the cluster's highest
    by more than MAX_STEP_RATE a second since (plus STEP_SLACK): a node's own credential
    can no longer make the head record 2^62 steps. Steps may go down (a restore).

    The cluster's highest is kept in BOUNDS_FILE, so a restarted head keeps bounding; a
    head with no history at all (a new head directory) believes its first report up to
    validate.MAX_STEP."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.time):
        self.path, self.clock = path, clock
        self.nodes: dict[str, tuple[int, float]] = {}  # node -> (its last highest, at)
        self.cluster: tuple[int, float] | None = None  # (the highest believed, at)
        self._saved: tuple[int, float] | None = None
        if path is not None and path.exists():
            try:
                got = json.loads(path.read_text(), parse_constant=_no_constant)
                step, at = got["step"], got["at"]
                if (isinstance(step, int) and not isinstance(step, bool)
                        and 0 <= step <= validate.MAX_STEP
                        and isinstance(at, (int, float)) and not isinstance(at, bool)
                        and math.isfinite(at)):
                    self.cluster = self._saved = (step, min(float(at), self.clock()))
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                pass  # a damaged file: no history (as a new head)

    @staticmethod
    def highest(hb: dict[str, Any]) -> int:
        return max((max(w["step"], w["resume_step"], w["last_ckpt"], w["drain_step"] or 0)
                    for w in hb["workers"]), default=0)

    def limit(self, node: str) -> int | None:
        now = self.clock()
        refs = [r for r in (self.nodes.get(node), self.cluster) if r is not None]
        if not refs:
            return None
        return max(int(step + MAX_STEP_RATE * max(0.0, now - at)) for step, at in refs) \
            + STEP_SLACK

    def check(self, node: str, hb: dict[str, Any]) -> None:
        """Raises BadInput when the report's steps are beyond belief; else remembers them
        (a lower one too: after a restore the node counts on from there)."""
        top = self.highest(hb)
        lim = self.limit(node)
        if lim is not None and top > lim:
            raise validate.BadInput(
                f"step {top} is beyond what this node could have reached (at most {lim}: "
                f"{MAX_STEP_RATE:g} steps a second since the last report)")
        now = self.clock()
        self.nodes[node] = (top, now)
        if self.cluster is None or top > self.cluster[0]:
            self.cluster = (top, now)

    def forget(self, node: str) -> None:
        self.nodes.pop(node, None)

    def save(self) -> None:
        """Keep the cluster's highest for a restarted head."""
        if self.path is None or self.cluster is None or self.cluster == self._saved:
            return
        write_json_atomic(self.path, {"step": self.cluster[0], "at": self.cluster[1]})
        self._saved = self.cluster


class _HeadTooLarge(Exception):
    """A request line or header block over its cap (answered 431, connection closed)."""


class _DeadlineIO(io.RawIOBase):
    """The socket as read by one connection's handler: every recv waits at most until the
    current request's deadline, so a request that trickles in (a slowloris: one byte every
    few seconds) is cut off when its deadline passes, however often its bytes come."""

    def __init__(self, sock: socket.socket, reader: _RequestReader):
        super().__init__()
        self.sock, self.reader = sock, reader

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.reader.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


class _RequestReader:
    """The handler's rfile: a deadline per request (the request line, the headers and the
    body all arrive within REQUEST_DEADLINE_S, counted from the moment the head waits for
    the request) and a cap on the request line and on the header block's size and line
    count, enforced while reading, before the token is looked at."""

    def __init__(self, sock: socket.socket):
        self.deadline = time.monotonic() + REQUEST_DEADLINE_S
        self._f = io.BufferedReader(_DeadlineIO(sock, self), 8192)
        self._line_left = self._head_left = 0
        self._lines_left = 0

    def start(self) -> None:
        """A new request: its deadline and its head's budget start now."""
        self.deadline = time.monotonic() + REQUEST_DEADLINE_S
        self._line_left = MAX_REQUEST_LINE
        self._head_left = MAX_HEADER_BYTES
        self._lines_left = MAX_HEADERS + 1  # the empty line that ends the headers

    def readline(self, limit: int = -1) -> bytes:
        if self._line_left:  # the request line
            cap, self._line_left = self._line_left, 0
            line = self._f.readline(cap + 1)
            if len(line) > cap:
                raise _HeadTooLarge(f"request line over {cap} bytes")
            return line
        if self._lines_left <= 0:
            raise _HeadTooLarge(f"over {MAX_HEADERS} headers")
        cap = self._head_left + 1
        line = self._f.readline(cap if limit < 0 else min(limit, cap))
        self._head_left -= len(line)
        self._lines_left -= 1
        if self._head_left < 0:
            raise _HeadTooLarge(f"headers over {MAX_HEADER_BYTES} bytes")
        return line

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def close(self) -> None:
        self._f.close()


@dataclass
class _Conn:
    sock: Any
    host: str
    opened: float
    trusted: str = ""  # who it proved to be ("" until a request carried a valid token)
    evicted: bool = False


class _BoundedHTTPServer(AdmittingHTTPServer):
    """A thread per connection, at most `max_connections` at once, and the newest comer
    always gets a chance: when the slots are full (or one address holds PER_ADDRESS of the
    connections that have not authenticated yet) the oldest unauthenticated connection of
    the address holding most of them is closed to make room. A connection counts as
    authenticated once one of its requests carried a valid token (at most PER_NODE_TRUSTED
    per node credential), and is never evicted for a newcomer: 300 stalled sockets from
    one address, or from loopback (which every local client shares), can no longer lock
    the controller out. Only when every slot is authenticated is a newcomer refused."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.max_connections = MAX_CONNECTIONS
        self.per_address = PER_ADDRESS
        self._conns: dict[Any, _Conn] = {}
        self._conns_lock = threading.Lock()
        self.evictions = 0  # for tests and the attack benchmark
        super().__init__(*a, **kw)

    def _release(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)

    def _victim(self, host: str) -> _Conn | None:
        """The connection to close for a newcomer from `host`, None when none is needed,
        or raises LookupError when every slot is authenticated (the newcomer is refused)."""
        live = [c for c in self._conns.values() if not c.evicted]
        untrusted = [c for c in live if not c.trusted]
        mine = [c for c in untrusted if c.host == host]
        if len(mine) >= self.per_address:
            return min(mine, key=lambda c: c.opened)
        if len(live) < self.max_connections:
            return None
        if not untrusted:
            raise LookupError("every connection is authenticated")
        per_host: dict[str, int] = {}
        for c in untrusted:
            per_host[c.host] = per_host.get(c.host, 0) + 1
        worst = max(per_host, key=lambda h: per_host[h])
        return min((c for c in untrusted if c.host == worst), key=lambda c: c.opened)

    def _admit(self, request: Any, client_address: Any) -> bool:
        host = str(client_address[0]) if isinstance(client_address, tuple) else ""
        with self._conns_lock:
            # closed-but-not-yet-gone connections still hold a thread: a bound on those too
            if len(self._conns) >= self.max_connections + EVICTING_MAX:
                return False
            try:
                victim = self._victim(host)
            except LookupError:
                return False
            if victim is not None:
                victim.evicted = True
                self.evictions += 1
                try:
                    victim.sock.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
                except OSError:
                    pass
            self._conns[request] = _Conn(request, host, time.monotonic())
            return True

    def trust(self, request: Any, who: Principal) -> None:
        """`request` carried a valid token: it is no longer evicted for newcomers."""
        key = "controller" if who.controller else f"node:{who.node_id}"
        with self._conns_lock:
            c = self._conns.get(request)
            if c is None or c.trusted:
                return
            if not who.controller and sum(
                    1 for x in self._conns.values() if x.trusted == key) >= PER_NODE_TRUSTED:
                return
            c.trusted = key

    def connections(self) -> dict[str, int]:
        """How many connections are open, authenticated, closing (for tests and benches)."""
        with self._conns_lock:
            cs = list(self._conns.values())
        return {"open": len(cs), "trusted": sum(1 for c in cs if c.trusted),
                "evicted": sum(1 for c in cs if c.evicted), "evictions": self.evictions}



class HeadServer:
    def __init__(
        self,
        dir: Path,
        token: str,
        host: str = "127.0.0.1",
        http_port: int = 0,
        store_port: int = 0,
        with_store: bool = True,
        reclaim: Callable[[], list[str]] | None = None,
        lighthouse_port: int = -1,
        max_world: int | None = None,
        rebalancer: Rebalancer | None = None,
    ):
        self.dir = Path(dir)
        # the cluster's reconcile loop ([rebalance] on_head): started once the API
        # answers (it asks the head for events), stopped with the head
        self.rebalancer = rebalancer
        # no worker may report a world size over this: the spec's maximum GPUs when the
        # head is told it (`max_world`), else the most any spec may ask for
        self.max_world = min(max_world or MAX_GPUS, MAX_GPUS)
        self.steps = StepBounds(self.dir / BOUNDS_FILE)
        # which node's request recorded an event that names no node (seq -> node id)
        self._event_node: dict[int, str] = {}
        # Called about once a second; returns the nodes it reclaimed. The local provider
        # hands one in (its capacity schedule plays the cloud); cloud heads have none.
        self.reclaim = reclaim
        self.token = token
        self.host = host
        # a head with a Lighthouse serves a torchft cluster (--lighthouse-port, given only
        # for `[train] engine = "torchft"`)
        self.coord = Coordinator(clock=time.time,
                                 engine="torchft" if lighthouse_port >= 0 else "torchrun")
        self.lock = threading.Lock()
        self.events_path = self.dir / "events.jsonl"
        self._events_written = 0
        self.store = None
        self.store_port = store_port
        if with_store:
            # TCPStore's own listener binds every interface whatever `host` says, and the
            # store has no auth: hand it a socket bound to `host` only.
            # a restarted head takes its old port back at once (ports.json): SO_REUSEADDR
            # multi_tenant: several torchrun agents share this one store as clients
            self.store = listening_store(host, store_port, world_size=None,
                                         wait_for_workers=False, multi_tenant=True)
            self.store_port = self.store.port
        # the torchft engine's quorum server, bound like the store (spotctl.head.lighthouse)
        from spotctl.head.lighthouse import start_lighthouse

        self.lighthouse = start_lighthouse(host, lighthouse_port)
        self.httpd = _BoundedHTTPServer((host, http_port), self._handler())
        self.http_port = self.httpd.server_address[1]
        self._stop = threading.Event()
        self.rate = RateLimit()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = HANDLER_TIMEOUT_S
            rfile: Any

            def setup(self) -> None:
                super().setup()
                # reads go through the request deadline and the head caps (see
                # _RequestReader), not through the per-recv timeout alone
                self.rfile.close()
                self.rfile = _RequestReader(self.connection)

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any, close: bool = False) -> None:
                body = json.dumps(obj).encode()
                # reads left the socket's timeout at what the request deadline had left
                self.connection.settimeout(HANDLER_TIMEOUT_S)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

            def send_error(self, code: int, message: str | None = None,
                           explain: str | None = None) -> None:
                # malformed requests: a JSON 4xx with a status line (never HTTP/0.9's
                # bare body), and the connection closed
                self.request_version = "HTTP/1.1"
                if code == 501:  # a method we do not serve: the client's fault
                    code, message = 405, "method not allowed"
                self._send(code, {"error": message or "bad request"}, close=True)

            def _who(self) -> Principal | None:
                return identify(server.token, self.headers.get("Authorization", ""))

            def _length(self) -> int | None:
                raw = self.headers.get("Content-Length")
                if raw is None:
                    return 0
                raw = raw.strip()
                if not raw.isascii() or not raw.isdigit():
                    return None
                return int(raw)

            def _body(self, n: int) -> dict[str, Any] | None:
                raw = self.rfile.read(n) if n else b"{}"
                if len(raw) != n:
                    return None
                try:
                    # NaN/Infinity parse (a diverging loss is reported as NaN) and
                    # validation keeps them out of every field but the metrics (-> None)
                    obj = json.loads(raw)
                except (ValueError, RecursionError):
                    return None
                return obj if isinstance(obj, dict) else None

            def _refuse(self, who: Principal | None, method: str, path: str) -> bool:
                """Answer 401/403 (and close) when `who` may not call this route."""
                if who is None:
                    self._send(401, {"error": "missing or wrong token"}, close=True)
                    return True
                self.server.trust(self.connection, who)  # type: ignore[attr-defined]
                if not who.controller and (method, path) not in NODE_ROUTES:
                    self._send(403, {"error": f"a node may not call {path}"}, close=True)
                    return True
                if not who.controller and not server.rate.allow(who.node_id):
                    self._send(429, {"error": "too many requests from this node"}, close=True)
                    return True
                return False

            def handle_one_request(self) -> None:
                self.rfile.start()
                try:
                    super().handle_one_request()
                except (TimeoutError, ConnectionError):
                    self.close_connection = True
                except _HeadTooLarge as e:
                    self.close_connection = True
                    self.request_version = "HTTP/1.1"
                    self.requestline = getattr(self, "requestline", "")
                    try:
                        self._send(431, {"error": str(e)}, close=True)
                    except OSError:
                        pass
                except Exception:  # never let one request take a thread's loop down
                    log.exception("request failed")
                    self.close_connection = True
                    try:
                        self._send(500, {"error": "internal error"}, close=True)
                    except OSError:
                        pass

            def do_GET(self) -> None:
                u = urlparse(self.path)
                if self._refuse(self._who(), "GET", u.path):
                    return
                if u.path == "/api/health":
                    return self._send(200, {"ok": True, "pid": os.getpid()})
                if u.path == "/api/samples":  # what `spotctl report` draws (bounded file)
                    from spotctl.head.samples import SAMPLES_FILE, read_samples

                    return self._send(200, {"samples": read_samples(server.dir / SAMPLES_FILE)})
                if u.path not in ("/api/status", "/api/events"):
                    return self._send(404, {"error": "no such endpoint"})
                since = 0
                if u.path == "/api/events":
                    q = parse_qs(u.query).get("since", ["0"])[0]
                    if not (q.isascii() and q.isdigit() and len(q) < 19):
                        return self._send(400, {"error": "since must be a non-negative integer"})
                    since = int(q)
                with server.lock:
                    server.safe_tick()
                    if u.path == "/api/status":
                        out = server.coord.status()
                        out["store_port"] = server.store_port
                        if server.rebalancer is not None:
                            out["rebalancer"] = server.rebalancer.status()
                        return self._send(200, out)
                    evs = [e for e in server.coord.events if e["seq"] > since][:MAX_EVENTS_REPLY]
                    return self._send(200, {"events": evs})

            def do_POST(self) -> None:
                path = urlparse(self.path).path
                if self._refuse(self._who(), "POST", path):
                    return
                who = self._who()
                assert who is not None
                n = self._length()
                if n is None:
                    return self._send(400, {"error": "bad Content-Length"}, close=True)
                if n > MAX_BODY:
                    return self._send(413, {"error": f"body over {MAX_BODY} bytes"}, close=True)
                body = self._body(n)
                if body is None:
                    return self._send(400, {"error": "body must be a JSON object"}, close=True)
                try:
                    return self._post(who, path, body)
                except validate.BadInput as e:
                    return self._send(400, {"error": f"bad request: {e}"})

            def _post(self, who: Principal, path: str, body: dict[str, Any]) -> None:
                coord = server.coord
                if path == "/api/heartbeat":
                    hb = validate.heartbeat(body, server.max_world)
                    nid = hb["node_id"]
                    if not who.may_speak_for(nid):
                        return self._send(403, {"error": "a node may only speak for itself"})
                    with server.lock:
                        if nid not in coord.nodes and len(coord.nodes) >= MAX_NODES:
                            return self._send(429, {"error": f"over {MAX_NODES} nodes"})
                        # a group is at most MAX_WORKERS GPUs per node the head knows
                        known = len(coord.nodes) + (nid not in coord.nodes)
                        world = max((w["world_size"] for w in hb["workers"]), default=0)
                        if world > validate.MAX_WORKERS * known:
                            raise validate.BadInput(
                                f"world_size {world} is more than {validate.MAX_WORKERS} "
                                f"GPUs for each of the {known} nodes this head knows")
                        server.steps.check(nid, hb)
                        with server.attributed(who):
                            return self._send(200, coord.heartbeat(hb))
                if path == "/api/notice":
                    validate.fields(body, ("node_id", "notice"), ("node_id", "notice"))
                    nid = validate.node_id(body.get("node_id"))
                    nt = validate.notice(body.get("notice", {}))
                    if not who.may_speak_for(nid):
                        return self._send(403, {"error": "a node may only speak for itself"})
                    with server.lock:
                        if nid not in coord.nodes and len(coord.nodes) >= MAX_NODES:
                            return self._send(429, {"error": f"over {MAX_NODES} nodes"})
                        with server.attributed(who):
                            coord.notice(nid, nt)
                        return self._send(200, {"ok": True})
                if path == "/api/drain":
                    reason, leavers = validate.drain(body)
                    with server.lock:
                        leavers = [x for x in leavers if x in coord.nodes]
                        return self._send(200, {"gen": coord.request_drain(reason, leavers)})
                if path == "/api/rebalance":  # the controller reconciles: pause the loop
                    validate.fields(body, ("action", "ttl_s", "by"), ("action",))
                    action, ttl, by = body["action"], body.get("ttl_s", 600), body.get("by", "")
                    if action != "resume" and (
                            action != "pause" or isinstance(ttl, bool)
                            or not isinstance(ttl, (int, float)) or not 0 < ttl < 1e6
                            or not isinstance(by, str)):
                        raise validate.BadInput(
                            "action must be pause (ttl_s: seconds, by: who) or resume")
                    loop = server.rebalancer
                    if loop is None:
                        return self._send(200, {"paused": False, "loop": False})
                    return self._send(200, loop.resume() if action == "resume"
                                      else loop.pause(float(ttl), by))
                if path == "/api/forget":
                    validate.fields(body, ("nodes",), ("nodes",))
                    nodes = validate.node_list(body["nodes"], "nodes")
                    with server.lock:
                        for nid in nodes:
                            coord.forget(nid)
                            server.steps.forget(nid)
                        return self._send(200, {"ok": True})
                if path == "/api/event":
                    type_, data = validate.event(body)
                    if not who.controller and (
                        type_ not in validate.NODE_EVENTS or data.get("node") != who.node_id
                    ):
                        return self._send(403, {"error": "a node may only report about itself"})
                    with server.lock:
                        return self._send(200, {"seq": coord.record(type_, **data)["seq"]})
                self._send(404, {"error": "no such endpoint"})

        return Handler

    def safe_tick(self) -> None:
        """One coordinator step; an error is logged, never fatal (the lock is held)."""
        try:
            self.coord.tick()
        except Exception:
            log.exception("coordinator tick failed")

    @contextmanager
    def attributed(self, who: Principal) -> Iterator[None]:
        """Events recorded inside count against `who`'s node (the lock is held)."""
        n = len(self.coord.events)
        try:
            yield
        finally:
            if not who.controller:
                for e in self.coord.events[n:]:
                    self._event_node[e["seq"]] = who.node_id

    def _owner(self, ev: dict[str, Any]) -> str:
        node = ev.get("node")
        return node if isinstance(node, str) else self._event_node.get(ev["seq"], "")

    def _flush_events(self) -> None:
        evs = self.coord.events[self._events_written :]
        if evs:
            with open(self.events_path, "a") as f:
                for e in evs:
                    f.write(json.dumps(e) + "\n")
            self._events_written += len(evs)
            self._cap_per_node()
        # memory stays bounded: journaled events beyond the last MAX_EVENTS are dropped
        # from the list (events.jsonl keeps them all)
        drop = min(len(self.coord.events) - MAX_EVENTS, self._events_written)
        if drop > 0:
            del self.coord.events[:drop]
            self._events_written -= drop
        if len(self._event_node) > 2 * MAX_EVENTS:
            first = self.coord.events[0]["seq"] if self.coord.events else 0
            self._event_node = {k: v for k, v in self._event_node.items() if k >= first}

    def _cap_per_node(self) -> None:
        """One node's events (naming it, or recorded by its requests) keep at most
        MAX_EVENTS_PER_NODE places in the in-memory window: a node flooding events pushes
        out its own oldest, never the others' (all are journaled already)."""
        events = self.coord.events
        counts: dict[str, int] = {}
        for e in events:
            o = self._owner(e)
            if o:
                counts[o] = counts.get(o, 0) + 1
        over = {o: c - MAX_EVENTS_PER_NODE for o, c in counts.items()
                if c > MAX_EVENTS_PER_NODE}
        if not over:
            return
        keep = []
        for e in events:  # all journaled (this runs right after the journal write)
            o = self._owner(e)
            if over.get(o, 0) > 0:
                over[o] -= 1
                continue
            keep.append(e)
        events[:] = keep
        self._events_written = len(keep)

    def _load_events(self) -> None:
        """After a head restart keep numbering events after the ones already journaled.
        A damaged journal (garbage lines, huge numbers, non-objects) never stops the head."""
        if not self.events_path.exists():
            return
        last = 0
        with open(self.events_path, "rb") as f:
            for raw in f:
                try:
                    seq = json.loads(raw, parse_constant=_no_constant)["seq"]
                except (ValueError, KeyError, TypeError, IndexError, RecursionError):
                    continue
                if isinstance(seq, int) and not isinstance(seq, bool) and 0 < seq < 1 << 53:
                    last = max(last, seq)
        import itertools

        self.coord.seq = itertools.count(last + 1)
        self.coord.record("head-restart", previous_seq=last)

    def serve(self) -> None:
        self._load_events()
        with self.lock:
            # A restarted head adopts the groups its nodes report for a few seconds after
            # it starts: counted from now, when nodes can reach it, not from its start
            # (starting the Lighthouse took over 4 s under load: the window had passed
            # before the first heartbeat, and every replica group was formed anew)
            self.coord.started_at = self.coord.clock()
        # a short poll keeps stop() quick: shutdown() waits for one poll
        t = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                             kwargs={"poll_interval": 0.05})
        t.start()
        write_json_atomic(
            self.dir / "head.json",
            {"pid": os.getpid(), "url": self.url, "store_host": self.host,
             "store_port": self.store_port, "started_at": time.time(),
             "lighthouse": self.lighthouse.address if self.lighthouse else ""},
        )
        if self.rebalancer is not None:
            self.rebalancer.start()
        last_capacity = last_bounds = 0.0
        while not self._stop.is_set():
            with self.lock:
                self.safe_tick()
                try:
                    self._flush_events()
                except OSError as e:
                    log.warning("could not journal events: %s", e)
                if time.time() - last_bounds >= 5.0:
                    last_bounds = time.time()
                    try:
                        self.steps.save()
                    except OSError as e:
                        log.warning("could not keep the step bound: %s", e)
            if time.time() - last_capacity >= 1.0:
                last_capacity = time.time()
                self._local_capacity()
                self._lighthouse_alive()
            self._stop.wait(0.2)
        if self.rebalancer is not None:
            self.rebalancer.stop()
        self.httpd.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.stop()
        with self.lock:
            self._flush_events()
            try:
                self.steps.save()
            except OSError:
                pass

    def _lighthouse_alive(self) -> None:
        """The Lighthouse runs in a process of its own: should it die, it starts again on
        its port (the Managers' next quorum requests find it there)."""
        lh = self.lighthouse
        if lh is None or lh.alive():
            return
        log.error("the Lighthouse process exited; starting it again on port %s", lh.port)
        try:
            lh.restart()
        except OSError as e:
            log.error("the Lighthouse did not start again: %s", e)
            return
        with self.lock:
            self.coord.record("lighthouse-restarted", port=lh.port, restarts=lh.restarts)

    def _local_capacity(self) -> None:
        if self.reclaim is None:
            return
        try:
            sent = self.reclaim()
        except (OSError, ValueError, KeyError) as e:
            log.warning("capacity enforcement failed: %s", e)
            return
        if sent:
            with self.lock:
                self.coord.record("capacity-reclaim", nodes=sent)

    def stop(self) -> None:
        self._stop.set()


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (systemd's and most
    shells' soft default is 1,024, which a flood of idle connections fills: issue 60).
    The Lighthouse filter sizes its connection caps from the result. Returns (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft, hard


def run_head(
    dir: Path, token_file: Path, host: str, http_port: int, store_port: int,
    reclaim: Callable[[], list[str]] | None = None, lighthouse_port: int = -1,
    max_world: int | None = None, rebalancer: Rebalancer | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s head %(message)s")
    dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = token_file.read_text().strip()
    soft, _ = raise_nofile()
    log.info("open-file limit %d", soft)
    srv = HeadServer(dir, token, host=host, http_port=http_port, store_port=store_port,
                     reclaim=reclaim, lighthouse_port=lighthouse_port, max_world=max_world,
                     rebalancer=rebalancer)
    signal.signal(signal.SIGTERM, lambda *_: srv.stop())
    log.info("head up: api %s store %s:%s", srv.url, host, srv.store_port)
    srv.serve()


def supervise_head(argv: list[str], dir: Path) -> int:
    """Keep the head running: restart it when it dies (the rendezvous store lives in it,
    and agents restart torchrun once it is back). SIGTERM stops both."""
    import subprocess
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s head-supervisor %(message)s")
    dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (dir / "supervisor.pid").write_text(str(os.getpid()))
    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def stop(*_: object) -> None:
        stopping.set()
        if child and child[0].poll() is None:
            child[0].terminate()

    signal.signal(signal.SIGTERM, stop)
    restarts = 0
    while not stopping.is_set():
        p = subprocess.Popen([sys.executable, "-m", "spotctl.cli.app", "head", *argv])
        child[:] = [p]
        code = p.wait()
        if stopping.is_set():
            break
        restarts += 1
        log.warning("head exited %s; restart %d in 1 s", code, restarts)
        stopping.wait(1.0)
    return 0
