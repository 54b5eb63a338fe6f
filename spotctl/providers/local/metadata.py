"""A local instance-metadata emulator speaking AWS IMDSv2 and the GCE metadata protocol.

Local nodes get one each, so the agent runs the same monitors as on a cloud VM, and
tests drive preemptions and faults through it over real HTTP. Everything is in memory;
control methods are thread-safe. `spotctl preempt` and chaos scripts reach it through
token-protected control endpoints: POST /_spotctl/preempt {"style", "in_s", "action"},
POST /_spotctl/inject {"kind", "count"}, POST /_spotctl/clear, GET /_spotctl/state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spotctl.agent.monitors import (
    AWS_INSTANCE_ACTION,
    AWS_REBALANCE,
    AWS_TOKEN_HEADER,
    AWS_TOKEN_TTL_HEADER,
    GCP_MAINTENANCE_VALUES,
    GCP_PREEMPT_GRACE_S,
    format_iso_utc,
)
from spotctl.head.admission import AdmittingHTTPServer

log = logging.getLogger(__name__)

FAULT_KINDS = ("5xx", "garbage", "timeout", "401")
AWS_ACTIONS = ("terminate", "stop", "hibernate")
DEFAULT_AWS_NOTICE_S = 120.0  # EC2's two-minute warning
GCP_DEFAULT_WAIT_S = 30.0
GCP_MAX_WAIT_S = 3600.0  # a longer (or nan, inf, negative) timeout_sec is a 400
MAX_CONNECTIONS = 64  # concurrent (a node's agent holds 1-3); more are closed at once


class _CappedHTTPServer(AdmittingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once (more are closed)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        # the slot each open connection holds, released once into the semaphore it came
        # from (even when `slots` was replaced meanwhile, as a test does)
        self._held: dict[Any, threading.BoundedSemaphore] = {}
        super().__init__(*a, **kw)

    def _release(self, request: Any) -> None:
        slots = self._held.pop(request, None)  # atomic: only one caller gets it
        if slots is not None:
            slots.release()

    def _admit(self, request: Any, client_address: Any) -> bool:
        slots = self.slots
        if not slots.acquire(blocking=False):
            return False
        self._held[request] = slots
        return True


class MetadataServer:
    """Threaded HTTP server in a daemon thread. `start()`, `stop()`, `.url`, `.port`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        control_token: str | None = None,
        on_deadline: Callable[[float], None] | None = None,
        on_soft_off: Callable[[], None] | None = None,
        instance_id: str = "i-0local000000000001",
        zone: str = "local-1a",
        instance_type: str = "local.cpu",
        gcp_project_number: str = "000000000000",
        timeout_sleep_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.control_token = control_token
        self.on_deadline = on_deadline
        # a GCP preemption's ACPI soft-off: the guest OS starts shutting down at the
        # notice (systemd stops the node agent's unit: SIGTERM)
        self.on_soft_off = on_soft_off
        self.instance_id = instance_id
        self.zone = zone
        self.instance_type = instance_type
        self.gcp_project_number = gcp_project_number
        self.timeout_sleep_s = timeout_sleep_s  # how long an injected "timeout" stalls
        self.clock = clock  # token expiry and default notice times

        self._cond = threading.Condition()
        self._tokens: dict[str, float] = {}  # token -> expiry (clock time)
        self._aws_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        # GCP keys: value and a version bumped on every change (the ETag derives from both).
        self._gcp: dict[str, list[Any]] = {
            "preempted": ["FALSE", 0],
            "maintenance-event": ["NONE", 0],
        }
        self._upcoming: dict[str, Any] | None = None  # instance/upcoming-maintenance
        self._faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self._deadline: float | None = None
        self._deadline_timer: threading.Timer | None = None
        self._stopping = threading.Event()
        self.requests: dict[str, int] = {}  # path -> count, for tests and debugging
        self.token_puts = 0
        self.waiters = 0  # GCP requests parked in wait_for_change right now
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        # the instance profile's role (iam/security-credentials/): its name and what hands
        # out its temporary credentials (AccessKeyId, SecretAccessKey, Token, Expiration)
        self._iam_role: tuple[str, Callable[[], dict[str, str]]] | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> MetadataServer:
        if self._httpd is not None:
            return self
        handler = type("_Handler", (_Handler,), {"meta": self})
        self._httpd = _CappedHTTPServer((self.host, self._requested_port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            # A short poll interval keeps stop() quick (shutdown waits for one tick).
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="metadata-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()  # release long-polls
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("metadata server not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- control (thread-safe) ------------------------------------------------------------

    def set_aws_notice(self, action: str = "terminate", at: float | None = None) -> None:
        if action not in AWS_ACTIONS:
            raise ValueError(f"action must be one of {AWS_ACTIONS}, got {action!r}")
        when = self.clock() + DEFAULT_AWS_NOTICE_S if at is None else at
        with self._cond:
            self._aws_action = {"action": action, "time": format_iso_utc(when)}

    def set_iam_role(self, role: str, credentials: Callable[[], dict[str, str]]) -> None:
        """Serve `role` as the instance profile's: `credentials()` is called on each read
        of iam/security-credentials/<role> (as EC2 does, from STS)."""
        with self._cond:
            self._iam_role = (role, credentials)

    def set_rebalance(self, at: float | None = None) -> None:
        when = self.clock() if at is None else at
        with self._cond:
            self._rebalance = {"noticeTime": format_iso_utc(when)}

    def set_gcp_preempted(self, value: bool = True) -> None:
        self._set_gcp("preempted", "TRUE" if value else "FALSE")

    def set_maintenance(self, value: str, window_start: float | None = None) -> None:
        """`window_start` (unix time) also publishes `instance/upcoming-maintenance` with
        that window, as GCP does for GPU VMs (announced up to an hour ahead)."""
        if value not in GCP_MAINTENANCE_VALUES:
            raise ValueError(f"maintenance value must be one of {GCP_MAINTENANCE_VALUES}")
        with self._cond:
            self._upcoming = None
            if window_start is not None and value != "NONE":
                self._upcoming = {
                    "type": "SCHEDULED",
                    "can_reschedule": False,
                    "window_start_time": format_iso_utc(window_start),
                    "window_end_time": format_iso_utc(window_start + 3600),
                    "maintenance_status": "PENDING",
                }
        self._set_gcp("maintenance-event", value)

    def _set_gcp(self, key: str, value: str) -> None:
        with self._cond:
            entry = self._gcp[key]
            if entry[0] != value:
                entry[0] = value
                entry[1] += 1
                self._cond.notify_all()

    def clear(self) -> None:
        """Back to a healthy, un-noticed instance (tokens and faults too)."""
        self.set_gcp_preempted(False)
        self._set_gcp("maintenance-event", "NONE")
        with self._cond:
            self._upcoming = None
            self._aws_action = None
            self._rebalance = None
            self._faults = dict.fromkeys(FAULT_KINDS, 0)
            self._deadline = None
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
                self._deadline_timer = None

    def inject(self, kind: str, count: int = 1) -> None:
        """The next `count` notice reads misbehave.

        5xx: 500 on AWS reads, 503 on GCP reads. garbage: 200 with a non-JSON body on AWS,
        "MAYBE" on GCP. timeout: stall `timeout_sleep_s` before answering. 401: the
        next `count` AWS reads are refused with 401 and every token is forgotten (as after
        an IMDS restart), so a client must fetch a new one.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._cond:
            self._faults[kind] += count

    def faults_pending(self) -> dict[str, int]:
        with self._cond:
            return dict(self._faults)

    def preempt(
        self, style: str = "aws", in_s: float | None = None, action: str = "terminate"
    ) -> float:
        """Announce a preemption the way `style`'s cloud would; returns the deadline.

        aws: instance-action `action` at now+in_s (default 120 s). gcp: `preempted`
        turns TRUE now, the guest gets its ACPI soft-off now (`on_soft_off`), and the node
        goes in_s (default GCP's 30 s) later; GCP's metadata carries no deadline, so the
        node's agent still counts 30 s. The earliest stands;
        `on_deadline(deadline)` runs from a timer thread when it passes.
        """
        now = self.clock()
        if style not in ("aws", "gcp"):
            raise ValueError(f"style must be 'aws' or 'gcp', got {style!r}")
        default = DEFAULT_AWS_NOTICE_S if style == "aws" else GCP_PREEMPT_GRACE_S
        wait = default if in_s is None else float(in_s)
        if wait < 0:
            raise ValueError("in_s must be >= 0")
        deadline = now + wait
        if style == "aws":
            self.set_aws_notice(action, deadline)
        else:
            self.set_gcp_preempted(True)
            if self.on_soft_off is not None:
                try:
                    self.on_soft_off()
                except Exception:
                    log.exception("on_soft_off callback failed")
        with self._cond:
            if self._deadline is not None and self._deadline <= deadline:
                return self._deadline
            self._deadline = deadline
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            timer = threading.Timer(max(0.0, deadline - now), self._fire_deadline, (deadline,))
            timer.daemon = True
            self._deadline_timer = timer
            timer.start()
        return deadline

    def _fire_deadline(self, deadline: float) -> None:
        with self._cond:
            if self._deadline != deadline or self._stopping.is_set():
                return
        if self.on_deadline is not None:
            try:
                self.on_deadline(deadline)
            except Exception:
                log.exception("on_deadline callback failed")

    @property
    def deadline(self) -> float | None:
        with self._cond:
            return self._deadline

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {
                "deadline": self._deadline,
                "aws": {
                    "instance_action": self._aws_action,
                    "rebalance": self._rebalance,
                },
                "gcp": {
                    "preempted": self._gcp["preempted"][0] == "TRUE",
                    "maintenance_event": self._gcp["maintenance-event"][0],
                },
            }

    # --- used by the handler --------------------------------------------------------------

    def _take_fault(self, *kinds: str) -> str | None:
        with self._cond:
            for kind in kinds:
                if self._faults[kind] > 0:
                    self._faults[kind] -= 1
                    return kind
        return None

    def _new_token(self, ttl: int) -> str:
        token = secrets.token_urlsafe(32)
        with self._cond:
            now = self.clock()
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            self._tokens[token] = now + ttl
            self.token_puts += 1
        return token

    def _token_valid(self, token: str | None) -> bool:
        if not token:
            return False
        with self._cond:
            expiry = self._tokens.get(token)
            return expiry is not None and expiry > self.clock()

    def _gcp_etag(self, key: str) -> str:
        value, version = self._gcp[key]
        return hashlib.sha256(f"{key}:{version}:{value}".encode()).hexdigest()[:16]

    def _gcp_read(
        self, key: str, wait: bool, last_etag: str | None, timeout_s: float
    ) -> tuple[str, str]:
        """Current (value, etag); with wait, first block until the ETag differs from
        last_etag (or, without one, until the next change) or timeout_s passes."""
        with self._cond:
            if wait:
                target = last_etag if last_etag is not None else self._gcp_etag(key)
                end = time.monotonic() + timeout_s
                self.waiters += 1
                try:
                    while self._gcp_etag(key) == target and not self._stopping.is_set():
                        left = end - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    self.waiters -= 1
            return str(self._gcp[key][0]), self._gcp_etag(key)

    def _count(self, path: str) -> None:
        with self._cond:
            self.requests[path] = self.requests.get(path, 0) + 1


class _Handler(BaseHTTPRequestHandler):
    meta: MetadataServer
    server_version = "spotctl-metadata/1"
    timeout = 30.0  # a client silent this long mid-request gives its slot back

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        log.debug("metadata %s: " + format, self.address_string(), *args)

    # --- plumbing -------------------------------------------------------------------------

    def _send(
        self,
        status: int,
        body: bytes | str = b"",
        content_type: str = "text/plain",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (an injected timeout does exactly that)

    def _stall(self) -> None:
        self.meta._stopping.wait(self.meta.timeout_sleep_s)

    # --- verbs ----------------------------------------------------------------------------

    def do_PUT(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        self.meta._count(path)
        if path != "/latest/api/token":
            self._send(404, "Not Found")
            return
        # IMDSv2 refuses token requests that went through a proxy.
        if self.headers.get("X-Forwarded-For"):
            self._send(403, "Forbidden")
            return
        raw = self.headers.get(AWS_TOKEN_TTL_HEADER, "")
        try:
            ttl = int(raw)
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= 21600:
            self._send(400, "Bad Request")
            return
        token = self.meta._new_token(ttl)
        self._send(200, token, headers={AWS_TOKEN_TTL_HEADER: str(ttl)})

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        self.meta._count(parts.path)
        if parts.path.startswith("/latest/"):
            self._aws_get(parts.path)
        elif parts.path.startswith("/computeMetadata/"):
            self._gcp_get(parts.path, urllib.parse.parse_qs(parts.query))
        elif parts.path == "/_spotctl/state":
            if self._control_auth():
                self._send(200, json.dumps(self.meta.state()), "application/json")
        else:
            self._send(404, "Not Found")

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        self.meta._count(path)
        if path not in ("/_spotctl/preempt", "/_spotctl/inject", "/_spotctl/clear"):
            self._send(404, "Not Found")
            return
        if not self._control_auth():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            result: dict[str, Any]
            if path == "/_spotctl/preempt":
                style = str(body.get("style", "aws"))
                in_s = body.get("in_s")
                action = str(body.get("action", "terminate"))
                deadline = self.meta.preempt(style, None if in_s is None else float(in_s), action)
                result = {"deadline": deadline, "style": style}
            elif path == "/_spotctl/inject":
                self.meta.inject(str(body.get("kind", "")), int(body.get("count", 1)))
                result = {"faults": self.meta.faults_pending()}
            else:
                self.meta.clear()
                result = self.meta.state()
        except (ValueError, TypeError) as exc:
            self._send(400, json.dumps({"error": str(exc)}), "application/json")
            return
        self._send(200, json.dumps(result), "application/json")

    # --- AWS ------------------------------------------------------------------------------

    def _aws_get(self, path: str) -> None:
        meta = self.meta
        if not meta._token_valid(self.headers.get(AWS_TOKEN_HEADER)):
            self._send(401, "Unauthorized")
            return
        if meta._take_fault("401"):
            with meta._cond:
                meta._tokens.clear()
            self._send(401, "Unauthorized")
            return
        md = path[len("/latest/meta-data/") :] if path.startswith("/latest/meta-data/") else None
        if path in (AWS_INSTANCE_ACTION, AWS_REBALANCE):
            fault = meta._take_fault("5xx", "garbage", "timeout")
            if fault == "5xx":
                self._send(500, "Internal Server Error")
                return
            if fault == "garbage":
                self._send(200, "<html>not json", "text/plain")
                return
            if fault == "timeout":
                self._stall()
            with meta._cond:
                doc = meta._aws_action if path == AWS_INSTANCE_ACTION else meta._rebalance
                body = json.dumps(doc) if doc is not None else None
            if body is None:
                self._send(404, "Not Found")
            else:
                self._send(200, body, "text/plain")
            return
        static = {
            "instance-id": meta.instance_id,
            "instance-type": meta.instance_type,
            "placement/availability-zone": meta.zone,
        }
        if md is not None and md in static:
            self._send(200, static[md])
            return
        creds = "iam/security-credentials/"
        if md is not None and md.startswith(creds) and meta._iam_role is not None:
            role, fetch = meta._iam_role
            rest = md[len(creds):]
            if not rest:
                self._send(200, role)
                return
            if rest == role:
                try:
                    c = fetch()
                except Exception as e:  # noqa: BLE001 (the emulator answers as EC2 would)
                    log.warning("credentials for %s: %s", role, e)
                    self._send(500, "Internal Server Error")
                    return
                doc = {"Code": "Success", "Type": "AWS-HMAC",
                       "LastUpdated": format_iso_utc(self.meta.clock()), **c}
                self._send(200, json.dumps(doc), "text/plain")
                return
        self._send(404, "Not Found")

    # --- GCP ------------------------------------------------------------------------------

    def _gcp_get(self, path: str, query: dict[str, list[str]]) -> None:
        meta = self.meta
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(
                403, "Missing Metadata-Flavor:Google header.", headers={"Metadata-Flavor": "Google"}
            )
            return
        flavor = {"Metadata-Flavor": "Google"}
        prefix = "/computeMetadata/v1/instance/"
        key = path[len(prefix) :] if path.startswith(prefix) else ""
        if key in ("preempted", "maintenance-event"):
            fault = meta._take_fault("5xx", "garbage", "timeout")
            if fault == "5xx":
                self._send(503, "Service Unavailable", headers=flavor)
                return
            if fault == "garbage":
                self._send(200, "MAYBE", headers={**flavor, "ETag": "garbage"})
                return
            if fault == "timeout":
                self._stall()
            wait = query.get("wait_for_change", ["false"])[0].lower() == "true"
            last_etag = query.get("last_etag", [None])[0]
            try:
                timeout_s = float(query.get("timeout_sec", [GCP_DEFAULT_WAIT_S])[0])
            except ValueError:
                timeout_s = math.nan
            # nan made the wait loop spin (no comparison with it is ever true)
            if not 0 <= timeout_s <= GCP_MAX_WAIT_S:
                self._send(400, "Bad timeout_sec", headers=flavor)
                return
            value, etag = meta._gcp_read(key, wait, last_etag, timeout_s)
            self._send(200, value, headers={**flavor, "ETag": etag})
            return
        if key == "upcoming-maintenance":
            with meta._cond:
                upcoming = meta._upcoming
            if upcoming is None:
                self._send(404, "Not Found", headers=flavor)
            else:
                self._send(200, json.dumps(upcoming), headers=flavor)
            return
        static = {
            "id": str(int(hashlib.sha256(meta.instance_id.encode()).hexdigest()[:12], 16)),
            "zone": f"projects/{meta.gcp_project_number}/zones/{meta.zone}",
        }
        if key in static:
            etag = hashlib.sha256(static[key].encode()).hexdigest()[:16]
            self._send(200, static[key], headers={**flavor, "ETag": etag})
            return
        self._send(404, "Not Found", headers=flavor)

    # --- control --------------------------------------------------------------------------

    def _control_auth(self) -> bool:
        token = self.meta.control_token
        if not token:
            self._send(404, "Not Found")  # no control token configured: no control endpoint
            return False
        given = self.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            self._send(401, json.dumps({"error": "unauthorized"}), "application/json")
            return False
        return True


# --- client side of the control endpoint (for `spotctl preempt`) -----------------------------


def _control_request(
    url: str, token: str, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
) -> dict[str, Any]:
    from spotctl.agent.monitors import FetchError, http_request
    from spotctl.errors import AuthError, SpotctlError, TransientError

    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        reply = http_request(method, url.rstrip("/") + path, headers, timeout_s, data=data)
    except FetchError as exc:
        raise TransientError(f"metadata endpoint unreachable: {exc}") from exc
    if reply.status == 401:
        raise AuthError(f"metadata endpoint {url} refused the node token")
    if reply.status != 200:
        text = reply.body.decode("utf-8", "replace")[:200]
        raise SpotctlError(f"metadata endpoint {url}{path}: HTTP {reply.status}: {text}")
    try:
        result = json.loads(reply.body)
    except ValueError as exc:
        raise SpotctlError(f"metadata endpoint {url}{path} sent non-JSON") from exc
    if not isinstance(result, dict):
        raise SpotctlError(f"metadata endpoint {url}{path} sent {result!r}")
    return result


def request_preempt(
    url: str,
    token: str,
    style: str = "aws",
    in_s: float | None = None,
    action: str = "terminate",
    timeout_s: float = 5.0,
) -> float:
    """POST /_spotctl/preempt on a node's emulator; returns the deadline (unix time).
    Raises AuthError (bad token), TransientError (unreachable), SpotctlError (other)."""
    body: dict[str, Any] = {"style": style, "action": action}
    if in_s is not None:
        body["in_s"] = in_s
    result = _control_request(url, token, "POST", "/_spotctl/preempt", body, timeout_s)
    return float(result["deadline"])


def request_state(url: str, token: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET /_spotctl/state: {"deadline": ts|None, "aws": {...}, "gcp": {...}}."""
    return _control_request(url, token, "GET", "/_spotctl/state", None, timeout_s)
