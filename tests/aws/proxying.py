"""What the test proxies in front of moto share (tests/aws/conftest.py's FaultProxy and
tests/aws/iam_ec2.py's IamEc2Proxy): passing a request on to moto, and serving on
loopback."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def forward(handler: BaseHTTPRequestHandler, upstream: str, raw: bytes) -> None:
    """POST `raw` to moto at `upstream` (http://host:port) and answer with its reply."""
    host, port = upstream.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {k: v for k, v in handler.headers.items() if k.lower() != "host"}
    conn.request("POST", handler.path, body=raw, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    handler.send_response(resp.status)
    for k, v in resp.getheaders():
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    conn.close()


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """A threaded server for `handler` on a free loopback port, and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True,
                     kwargs={"poll_interval": 0.05}).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
