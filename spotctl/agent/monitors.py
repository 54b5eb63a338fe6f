"""Preemption-notice monitors: each does one poll of one source and returns `Notice`s.

Monitors take no action and never raise for what a metadata service sends back: an odd
reply (garbage, missing keys, 5xx, timeout, refused connection) is counted in `errors`,
described in `last_error`, logged, and yields no notice. `MonitorLoop` is the only part
that acts: it runs every monitor in its own thread, dedupes notices by their stable id and
calls `on_notice` once per id.

Sources:
- AWS IMDSv2: `spot/instance-action` (spot interruption, 2 min ahead) and
  `events/recommendations/rebalance` (elevated risk, no deadline).
- GCP metadata server: `instance/preempted` (30 s ahead) and `instance/maintenance-event`,
  long-polled with `wait_for_change` and the last ETag.
- A notice file (ssh hosts whose owner has their own eviction signal).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

SOURCES = ("aws", "gcp", "file", "local")
KINDS = ("spot-interruption", "rebalance", "preempted", "maintenance")

# GCP gives 30 s between `preempted` turning TRUE and the ACPI shutdown; the same grace
# is assumed for a notice file that names no deadline.
GCP_PREEMPT_GRACE_S = 30.0
# TERMINATE_ON_HOST_MAINTENANCE is announced 60 s before the host goes for most VMs, but
# up to an hour before for GPU VMs; the window's own start (instance/upcoming-maintenance)
# is the deadline when the metadata server gives one, this grace only when it does not.
GCP_MAINTENANCE_GRACE_S = 60.0
FILE_NOTICE_GRACE_S = 30.0

AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREFIX = "/computeMetadata/v1/instance/"
GCP_MAINTENANCE_VALUES = (
    "NONE",
    "MIGRATE_ON_HOST_MAINTENANCE",
    "TERMINATE_ON_HOST_MAINTENANCE",
)


@dataclass(frozen=True)
class Notice:
    """One preemption-type event seen on a node."""

    # Stable hash of (source, kind, payload): the same notice polled twice has the same id.
    id: str
    source: str  # "aws" | "gcp" | "file" | "local"
    kind: str  # "spot-interruption" | "rebalance" | "preempted" | "maintenance"
    action: str  # what the provider will do: "terminate", "stop", "hibernate", "rebalance"
    # Unix time when the node will be taken; float("inf") when no deadline (rebalance).
    deadline: float
    received_at: float  # unix time the monitor saw it
    # The raw payload and anything else worth reporting; excluded from eq/hash.
    detail: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def seconds_left(self, now: float) -> float:
        return self.deadline - now

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form (an infinite deadline becomes null)."""
        return {
            "id": self.id,
            "source": self.source,
            "kind": self.kind,
            "action": self.action,
            "deadline": self.deadline if math.isfinite(self.deadline) else None,
            "received_at": self.received_at,
            "detail": self.detail,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Notice:
        deadline = data.get("deadline")
        return cls(
            id=str(data["id"]),
            source=str(data["source"]),
            kind=str(data["kind"]),
            action=str(data.get("action", "")),
            deadline=float("inf") if deadline is None else float(deadline),
            received_at=float(data.get("received_at", 0.0)),
            detail=dict(data.get("detail") or {}),
        )


def notice_id(source: str, kind: str, payload: Any) -> str:
    blob = json.dumps([source, kind, payload], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_notice(
    source: str,
    kind: str,
    action: str,
    deadline: float,
    received_at: float,
    payload: Any,
    detail: dict[str, Any] | None = None,
) -> Notice:
    return Notice(
        id=notice_id(source, kind, payload),
        source=source,
        kind=kind,
        action=action,
        deadline=deadline,
        received_at=received_at,
        detail={"payload": payload, **(detail or {})},
    )


def parse_iso_utc(value: str) -> float:
    """'2026-11-29T15:04:05Z' -> unix time. Raises ValueError on anything else."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"not a timestamp: {value!r}")
    text = value.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def format_iso_utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- HTTP ---------------------------------------------------------------------------------


class FetchError(Exception):
    """Transport-level failure (refused, timeout, reset): no HTTP status came back."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes


# Metadata endpoints are link-local: never send them through an environment proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_request(
    method: str,
    url: str,
    headers: Mapping[str, str] | None,
    timeout_s: float,
    data: bytes | None = None,
) -> Reply:
    """One request; any HTTP status is a Reply, only transport failures raise FetchError."""
    if data is None and method in ("PUT", "POST"):
        data = b""  # urllib sends Content-Length only with a body; IMDS wants it on PUT
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return Reply(resp.status, _lower_headers(resp.headers), resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read()
        except (OSError, http.client.HTTPException):
            body = b""
        return Reply(exc.code, _lower_headers(exc.headers), body)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # URLError, TimeoutError, ConnectionError are all OSError.
        reason = getattr(exc, "reason", None) or exc
        raise FetchError(f"{method} {url}: {type(exc).__name__}: {reason}") from exc


def _lower_headers(headers: Any) -> dict[str, str]:
    if headers is None:
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()}


# --- monitors -----------------------------------------------------------------------------


class Monitor(Protocol):
    name: str
    errors: int
    last_error: str

    def poll(self) -> list[Notice]: ...


class _ErrorCounter:
    """Shared bookkeeping: odd replies are counted, never raised."""

    name = "monitor"

    def __init__(self) -> None:
        self.errors = 0
        self.last_error = ""
        self.polls = 0

    def _odd(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        log.debug("%s: %s", self.name, message)


class AwsImdsMonitor(_ErrorCounter):
    """EC2 IMDSv2: spot interruption and rebalance recommendation.

    A session token is fetched with PUT /latest/api/token, kept, refreshed shortly before
    it expires, and sent on every read; a 401 re-fetches it once and retries the read.
    """

    blocking = False

    def __init__(
        self,
        base_url: str,
        token_ttl_s: int = 21600,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        interval_s: float = 2.0,
        source: str = "aws",
        rebalance: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= int(token_ttl_s) <= 21600:
            raise ValueError(f"token_ttl_s must be in 1..21600, got {token_ttl_s}")
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = int(token_ttl_s)
        self.timeout_s = timeout_s
        self.clock = clock
        self.interval_s = interval_s  # AWS checks instance-action every 5 s; we poll faster
        self.source = source
        self.rebalance = rebalance
        self.name = f"{source}-imds"
        self._token = ""
        self._token_expires = 0.0
        self.token_fetches = 0

    # Refresh with a margin so a read never goes out with a token about to lapse.
    def _refresh_margin(self) -> float:
        return min(60.0, self.token_ttl_s / 4.0)

    def _fetch_token(self) -> bool:
        now = self.clock()
        try:
            reply = http_request(
                "PUT",
                self.base_url + "/latest/api/token",
                {AWS_TOKEN_TTL_HEADER: str(self.token_ttl_s)},
                self.timeout_s,
            )
        except FetchError as exc:
            self._odd(f"token: {exc}")
            return False
        self.token_fetches += 1
        token = reply.body.decode("utf-8", "replace").strip()
        if reply.status != 200 or not token:
            self._odd(f"token: HTTP {reply.status}")
            return False
        self._token = token
        self._token_expires = now + self.token_ttl_s
        return True

    def _ensure_token(self) -> bool:
        if self._token and self.clock() < self._token_expires - self._refresh_margin():
            return True
        return self._fetch_token()

    def _get(self, path: str) -> Reply | None:
        """GET with the token; one re-token on 401. None (counted) on transport failure."""
        for attempt in (0, 1):
            if not self._ensure_token():
                return None
            try:
                reply = http_request(
                    "GET", self.base_url + path, {AWS_TOKEN_HEADER: self._token}, self.timeout_s
                )
            except FetchError as exc:
                self._odd(str(exc))
                return None
            if reply.status == 401 and attempt == 0:
                self._token = ""  # the service forgot it (restart, expiry): get a new one
                continue
            return reply
        return None  # unreachable: the loop returns on attempt 1

    def _read_json(self, path: str) -> dict[str, Any] | None:
        """404 -> None (no event); 200 JSON object -> dict; anything else counted -> None."""
        reply = self._get(path)
        if reply is None or reply.status == 404:
            return None
        if reply.status != 200:
            self._odd(f"GET {path}: HTTP {reply.status}")
            return None
        try:
            data = json.loads(reply.body)
        except ValueError:
            self._odd(f"GET {path}: body is not JSON: {reply.body[:60]!r}")
            return None
        if not isinstance(data, dict):
            self._odd(f"GET {path}: JSON is not an object: {reply.body[:60]!r}")
            return None
        return data

    def poll(self) -> list[Notice]:
        self.polls += 1
        notices: list[Notice] = []
        now = self.clock()
        if not self._ensure_token():
            return notices  # one counted error per poll while IMDS is unreachable
        action = self._read_json(AWS_INSTANCE_ACTION)
        if action is not None:
            notice = self._interruption(action, now)
            if notice is not None:
                notices.append(notice)
        if self.rebalance:
            rebalance = self._read_json(AWS_REBALANCE)
            if rebalance is not None:
                notice = self._rebalance(rebalance, now)
                if notice is not None:
                    notices.append(notice)
        return notices

    def _interruption(self, data: dict[str, Any], now: float) -> Notice | None:
        act, when = data.get("action"), data.get("time")
        if not isinstance(act, str) or not act or not isinstance(when, str):
            self._odd(f"instance-action: missing action/time in {data!r}")
            return None
        try:
            deadline = parse_iso_utc(when)
        except ValueError:
            self._odd(f"instance-action: bad time {when!r}")
            return None
        payload = {"action": act, "time": when}
        return make_notice(self.source, "spot-interruption", act, deadline, now, payload)

    def _rebalance(self, data: dict[str, Any], now: float) -> Notice | None:
        when = data.get("noticeTime")
        if not isinstance(when, str):
            self._odd(f"rebalance: missing noticeTime in {data!r}")
            return None
        try:
            noticed = parse_iso_utc(when)
        except ValueError:
            self._odd(f"rebalance: bad noticeTime {when!r}")
            return None
        return make_notice(
            self.source,
            "rebalance",
            "rebalance",
            float("inf"),
            now,
            {"noticeTime": when},
            {"notice_time": noticed},
        )


class GcpMetadataMonitor(_ErrorCounter):
    """GCE metadata server: one key (`preempted` or `maintenance-event`), long-polled.

    The first poll is a plain read (catches a value that is already set and learns the
    ETag); later `poll(wait=True)` calls block with `wait_for_change=true&last_etag=E`
    until the value changes or the server's `timeout_sec` passes. Run it in its own thread.
    After a 503 or a transport failure `retry_after_s` says how long to wait (1 s).
    """

    blocking = True

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 35.0,
        key: str = "preempted",
        clock: Callable[[], float] = time.time,
        source: str = "gcp",
    ) -> None:
        super().__init__()
        if key not in ("preempted", "maintenance-event"):
            raise ValueError(f"key must be 'preempted' or 'maintenance-event', got {key!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.key = key
        self.clock = clock
        self.source = source
        self.name = f"{source}-{key}"
        self.etag = ""
        self.value = ""
        self.retry_after_s = 0.0
        # Ask the server to answer a few seconds before our socket would give up.
        self.wait_timeout_sec = max(1, int(timeout_s) - 5)
        self.interval_s = 0.0

    def _url(self, wait: bool) -> str:
        url = self.base_url + GCP_PREFIX + self.key
        if not wait or not self.etag:
            return url
        query = {
            "wait_for_change": "true",
            "last_etag": self.etag,
            "timeout_sec": str(self.wait_timeout_sec),
        }
        return url + "?" + urllib.parse.urlencode(query)

    def poll(self, wait: bool = False) -> list[Notice]:
        self.polls += 1
        self.retry_after_s = 0.0
        try:
            reply = http_request(
                "GET", self._url(wait), {"Metadata-Flavor": "Google"}, self.timeout_s
            )
        except FetchError as exc:
            self.retry_after_s = 1.0
            self._odd(str(exc))
            return []
        if reply.status == 503:
            self.retry_after_s = 1.0
            self._odd(f"{self.key}: HTTP 503, retry in 1 s")
            return []
        if reply.status != 200:
            self.retry_after_s = 1.0
            self._odd(f"{self.key}: HTTP {reply.status}")
            return []
        if reply.headers.get("metadata-flavor") != "Google":
            # Something other than the metadata server answered (captive proxy, wrong host).
            self.retry_after_s = 1.0
            self._odd(f"{self.key}: reply lacks Metadata-Flavor: Google")
            return []
        value = reply.body.decode("utf-8", "replace").strip()
        etag = reply.headers.get("etag", "")
        if not etag:
            # Without an ETag a waiting call would return at once; fall back to pacing.
            self.retry_after_s = 1.0
        self.etag = etag
        notice = self._interpret(value)
        if notice is not None or self._valid(value):
            self.value = value
        return [notice] if notice is not None else []

    def _valid(self, value: str) -> bool:
        if self.key == "preempted":
            return value in ("TRUE", "FALSE")
        return value in GCP_MAINTENANCE_VALUES

    def _interpret(self, value: str) -> Notice | None:
        now = self.clock()
        if not self._valid(value):
            self._odd(f"{self.key}: unexpected value {value[:40]!r}")
            return None
        if self.key == "preempted":
            if value != "TRUE":
                return None
            return make_notice(
                self.source, "preempted", "terminate", now + GCP_PREEMPT_GRACE_S, now, value
            )
        if not value.startswith("TERMINATE"):
            return None  # NONE, or a live migration: the node stays
        start = self._maintenance_window_start()
        deadline = start if start is not None and start > now else now + GCP_MAINTENANCE_GRACE_S
        return make_notice(self.source, "maintenance", "terminate", deadline, now, value)

    def _maintenance_window_start(self) -> float | None:
        """Start of the announced maintenance window (unix time), or None when the
        metadata server has none or says something odd (then the short grace applies)."""
        url = self.base_url + GCP_PREFIX + "upcoming-maintenance"
        try:
            reply = http_request("GET", url, {"Metadata-Flavor": "Google"}, 5.0)
        except FetchError as exc:
            self._odd(f"upcoming-maintenance: {exc}")
            return None
        if reply.status != 200:
            return None
        try:
            doc = json.loads(reply.body)
            text = str(doc["window_start_time"])
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except (ValueError, KeyError, TypeError) as exc:
            self._odd(f"upcoming-maintenance: no usable window_start_time ({exc})")
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()


class FileNoticeMonitor(_ErrorCounter):
    """A notice is the file's existence. Content: empty, or JSON {"deadline": unix_ts}
    (optionally "action"). Unreadable content still gives a notice (the file's presence
    is the signal), with the default 30 s deadline, and is counted as odd."""

    blocking = False

    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.time,
        interval_s: float = 1.0,
        source: str = "file",
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.clock = clock
        self.interval_s = interval_s
        self.source = source
        self.name = f"{source}-notice"

    def poll(self) -> list[Notice]:
        self.polls += 1
        now = self.clock()
        try:
            text = self.path.read_text(errors="replace").strip()
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._odd(f"{self.path}: {exc}")
            return []
        deadline = now + FILE_NOTICE_GRACE_S
        action = "terminate"
        if text:
            try:
                data = json.loads(text)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                if "deadline" in data:
                    deadline = float(data["deadline"])
                action = str(data.get("action", action))
            except (ValueError, TypeError) as exc:
                self._odd(
                    f"{self.path}: bad content ({exc}); using a {FILE_NOTICE_GRACE_S:.0f} s deadline"
                )
        return [make_notice(self.source, "preempted", action, deadline, now, text)]


def build_monitors(
    style: str,
    url: str = "",
    notice_file: str = "",
    poll_interval_s: float = 2.0,
) -> list[Any]:
    """Monitors for an agent's `metadata` style (see AgentConfig.metadata).

    local: the emulator speaks both protocols, so both are watched (source "local").
    """
    monitors: list[Any] = []
    if style in ("aws", "local"):
        source = "local" if style == "local" else "aws"
        monitors.append(AwsImdsMonitor(url, interval_s=poll_interval_s, source=source))
    if style in ("gcp", "local"):
        source = "local" if style == "local" else "gcp"
        monitors.append(GcpMetadataMonitor(url, key="preempted", source=source))
        if style == "gcp":
            monitors.append(GcpMetadataMonitor(url, key="maintenance-event", source=source))
    if notice_file:
        monitors.append(FileNoticeMonitor(notice_file, interval_s=min(1.0, poll_interval_s)))
    if style not in ("aws", "gcp", "local", "file", "none"):
        raise ValueError(f"unknown metadata style {style!r}")
    return monitors


# --- the loop -----------------------------------------------------------------------------


class MonitorLoop:
    """Runs each monitor in its own daemon thread and delivers each notice id once.

    Plain monitors are polled every `interval_s`; long-polling ones (`blocking = True`)
    are called back to back with `poll(wait=True)`, pausing `retry_after_s` after errors.
    Repeated identical errors are logged at counts 1, 10, 100, ... so a dead metadata
    service cannot flood the log; `error_repeats` keeps the counts.
    """

    def __init__(
        self,
        monitors: Iterable[Any],
        on_notice: Callable[[Notice], None],
        interval_s: float | None = None,
        min_pause_s: float = 0.05,
    ) -> None:
        self.monitors = list(monitors)
        self.on_notice = on_notice
        self.interval_s = interval_s  # overrides each plain monitor's own interval
        self.min_pause_s = min_pause_s  # floor between long-polls if a server never blocks
        self.seen: dict[str, Notice] = {}
        self.error_repeats: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> MonitorLoop:
        if self._threads:
            return self
        for monitor in self.monitors:
            thread = threading.Thread(
                target=self._run, args=(monitor,), name=f"monitor-{monitor.name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join. A long-poll in flight cannot be interrupted; its daemon thread
        is abandoned after `timeout_s` and delivers nothing more."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads) and not self._stop.is_set()

    def _run(self, monitor: Any) -> None:
        blocking = bool(getattr(monitor, "blocking", False))
        first = True
        while not self._stop.is_set():
            before = monitor.errors
            try:
                notices = monitor.poll(wait=not first) if blocking else monitor.poll()
            except Exception:  # a monitor bug must not kill the watch
                log.exception("monitor %s crashed in poll", monitor.name)
                notices = []
                monitor.errors += 1
                monitor.last_error = "poll crashed (see the traceback logged first)"
            first = False
            if monitor.errors > before:
                self._note_error(monitor.name, monitor.last_error)
            if self._stop.is_set():
                return
            for notice in notices:
                self._deliver(notice)
            if blocking:
                pause = max(self.min_pause_s, float(getattr(monitor, "retry_after_s", 0.0)))
            else:
                pause = self.interval_s if self.interval_s is not None else monitor.interval_s
            self._stop.wait(pause)

    def _deliver(self, notice: Notice) -> None:
        with self._lock:
            if notice.id in self.seen:
                return
            self.seen[notice.id] = notice
        log.warning(
            "notice %s from %s: %s (%s), deadline %s",
            notice.id,
            notice.source,
            notice.kind,
            notice.action,
            "none" if not math.isfinite(notice.deadline) else format_iso_utc(notice.deadline),
        )
        try:
            self.on_notice(notice)
        except Exception:
            log.exception("on_notice failed for notice %s", notice.id)

    def _note_error(self, name: str, message: str) -> None:
        with self._lock:
            key = (name, message)
            count = self.error_repeats.get(key, 0) + 1
            self.error_repeats[key] = count
        # Log the 1st, 10th, 100th ... occurrence of the same error.
        if count == 1 or math.log10(count).is_integer():
            log.warning("%s: %s (seen %d times)", name, message, count)
