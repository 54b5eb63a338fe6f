"""A local fake of the Service Quotas JSON API (GetServiceQuota only), which moto does not
implement for EC2. It answers the quota codes it was given and refuses any other with the
real NoSuchResourceException body, as the service does for an unknown code."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeQuotas:
    def __init__(self, values: dict[str, float]):
        self.values = dict(values)  # quota code -> value (vCPUs)
        self.seen: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                target = self.headers.get("X-Amz-Target", "")
                fake.seen.append({"target": target, **body})
                code = body.get("QuotaCode", "")
                if (
                    target.endswith(".GetServiceQuota")
                    and body.get("ServiceCode") == "ec2"
                    and (code in fake.values)
                ):
                    status, out = 200, {"Quota": {
                        "ServiceCode": "ec2", "QuotaCode": code, "Value": fake.values[code],
                        "Unit": "None", "Adjustable": True,
                    }}  # fmt: skip
                else:
                    status, out = (
                        400,
                        {
                            "__type": "NoSuchResourceException",
                            "message": f"The request failed because the specified quota {code} "
                            "does not exist.",
                        },
                    )
                raw = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         kwargs={"poll_interval": 0.05}).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
