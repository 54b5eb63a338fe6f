"""The head process: torchrun's c10d rendezvous store and the coordinator API.

`spotctl head --dir DIR` (local mode: a detached process; cloud: a systemd unit on a
small on-demand VM). The token is read from a file, never from the command line. Every
API request needs `Authorization: Bearer <token>` (compared in constant time).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from spotctl.head.coordinator import Coordinator
from spotctl.state import write_json_atomic

log = logging.getLogger("spotctl.head")
MAX_BODY = 1 << 20


def _listen(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    # a restarted head takes its old port back at once (ports.json)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(512)
    return s


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
    ):
        self.dir = Path(dir)
        # Called about once a second; returns the nodes it reclaimed. The local provider
        # hands one in (its capacity schedule plays the cloud); cloud heads have none.
        self.reclaim = reclaim
        self.token = token
        self.host = host
        self.coord = Coordinator(clock=time.time)
        self.lock = threading.Lock()
        self.events_path = self.dir / "events.jsonl"
        self._events_written = 0
        self.store = None
        self.store_port = store_port
        if with_store:
            from torch.distributed import TCPStore

            # TCPStore's own listener binds every interface whatever `host` says, and the
            # store has no auth: hand it a socket bound to `host` only.
            sock = _listen(host, store_port)
            port = sock.getsockname()[1]
            # multi_tenant: several torchrun agents share this one store as clients;
            # the store owns (and closes) the listening fd from here on
            self.store = TCPStore(
                host, port, world_size=None, is_master=True, wait_for_workers=False,
                multi_tenant=True, master_listen_fd=sock.detach(), use_libuv=True,
            )
            self.store_port = self.store.port
        self.httpd = ThreadingHTTPServer((host, http_port), self._handler())
        self.httpd.daemon_threads = True
        self.http_port = self.httpd.server_address[1]
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                got = self.headers.get("Authorization", "")
                want = f"Bearer {server.token}"
                return hmac.compare_digest(got.encode(), want.encode())

            def _body(self) -> dict[str, Any] | None:
                n = int(self.headers.get("Content-Length") or 0)
                if n > MAX_BODY:
                    return None
                raw = self.rfile.read(n) if n else b"{}"
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return None
                return obj if isinstance(obj, dict) else None

            def do_GET(self) -> None:
                if not self._authorized():
                    return self._send(401, {"error": "missing or wrong token"})
                u = urlparse(self.path)
                with server.lock:
                    server.coord.tick()
                    if u.path == "/api/status":
                        out = server.coord.status()
                        out["store_port"] = server.store_port
                        return self._send(200, out)
                    if u.path == "/api/events":
                        since = int(parse_qs(u.query).get("since", ["0"])[0])
                        return self._send(
                            200, {"events": [e for e in server.coord.events if e["seq"] > since]}
                        )
                    if u.path == "/api/health":
                        return self._send(200, {"ok": True, "pid": os.getpid()})
                self._send(404, {"error": "no such endpoint"})

            def do_POST(self) -> None:
                if not self._authorized():
                    self.rfile.read(min(int(self.headers.get("Content-Length") or 0), MAX_BODY))
                    return self._send(401, {"error": "missing or wrong token"})
                body = self._body()
                if body is None:
                    return self._send(400, {"error": "body must be a JSON object"})
                path = urlparse(self.path).path
                try:
                    with server.lock:
                        if path == "/api/heartbeat":
                            if "node_id" not in body:
                                return self._send(400, {"error": "node_id missing"})
                            return self._send(200, server.coord.heartbeat(body))
                        if path == "/api/notice":
                            server.coord.notice(str(body["node_id"]), body.get("notice", {}))
                            return self._send(200, {"ok": True})
                        if path == "/api/drain":
                            gen = server.coord.request_drain(
                                body.get("reason", "rebalance"), list(body.get("leavers", []))
                            )
                            return self._send(200, {"gen": gen})
                        if path == "/api/forget":
                            for nid in body.get("nodes", []):
                                server.coord.forget(str(nid))
                            return self._send(200, {"ok": True})
                        if path == "/api/event":
                            ev = server.coord.record(str(body.pop("type", "note")), **body)
                            return self._send(200, {"seq": ev["seq"]})
                except (KeyError, TypeError, ValueError) as e:
                    return self._send(400, {"error": f"bad request: {e}"})
                self._send(404, {"error": "no such endpoint"})

        return Handler

    def _flush_events(self) -> None:
        evs = self.coord.events[self._events_written :]
        if evs:
            with open(self.events_path, "a") as f:
                for e in evs:
                    f.write(json.dumps(e) + "\n")
            self._events_written += len(evs)

    def _load_events(self) -> None:
        """After a head restart keep numbering events after the ones already journaled."""
        if not self.events_path.exists():
            return
        last = 0
        for line in self.events_path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["seq"]))
            except (ValueError, KeyError):
                continue
        import itertools

        self.coord.seq = itertools.count(last + 1)
        self.coord.record("head-restart", previous_seq=last)

    def serve(self) -> None:
        self._load_events()
        t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        t.start()
        write_json_atomic(
            self.dir / "head.json",
            {"pid": os.getpid(), "url": self.url, "store_host": self.host,
             "store_port": self.store_port, "started_at": time.time()},
        )
        last_capacity = 0.0
        while not self._stop.is_set():
            with self.lock:
                self.coord.tick()
                self._flush_events()
            if time.time() - last_capacity >= 1.0:
                last_capacity = time.time()
                self._local_capacity()
            self._stop.wait(0.2)
        self.httpd.shutdown()
        with self.lock:
            self._flush_events()

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


def run_head(
    dir: Path, token_file: Path, host: str, http_port: int, store_port: int,
    reclaim: Callable[[], list[str]] | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s head %(message)s")
    dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = token_file.read_text().strip()
    srv = HeadServer(dir, token, host=host, http_port=http_port, store_port=store_port,
                     reclaim=reclaim)
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
