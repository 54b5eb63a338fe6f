"""GCP provider, the Compute API layer: clients, typed errors, retries, operation waits.

This module owns how spotctl talks to the Compute API: building the REST clients (real
credentials, or an anonymous client pointed at a test endpoint), the project, `_call`
(every API call goes through it: 429/5xx retried with bounded backoff), the mapping of
HTTP errors and operation errors to CapacityError / QuotaError / AuthError /
TransientError (`classify`, `classify_operation`), waiting on operations with our own
operations clients, and the label, name and tag conventions. `GcpApi` is the base class
the offers, network and launch parts build on (spotctl/providers/gcp/provider.py
assembles them into GcpProvider).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from spotctl.errors import (
    AuthError,
    CapacityError,
    ProviderError,
    QuotaError,
    SpecError,
    TransientError,
)
from spotctl.providers.base import HeadInfo, ProviderContext
from spotctl.remote.bootstrap import CloudNodes

ENV_ENDPOINT = "SPOTCTL_GCP_ENDPOINT"
LABEL_CLUSTER = "spotctl-cluster"
LABEL_ROLE = "spotctl-role"
LABEL_REQUEST = "spotctl-request-id"
HEAD_REQUEST_ID = "head"
METADATA_URL = "http://metadata.google.internal"  # what the agents poll for notices
# Same ports as the AWS head (spotctl/providers/aws/).
COORDINATOR_PORT = 7470  # head HTTP coordinator API
STORE_PORT = 29400  # head TCPStore for the c10d rendezvous
COMPUTE_SCOPE = "https://www.googleapis.com/auth/compute"

# Error codes (operation errors) and reasons (HTTP error bodies) by what they mean to us.
CAPACITY_CODES = frozenset(
    {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"}
)
# The zone cannot run this shape now (e.g. a GPU type not offered there this hour): as
# good as no capacity, so the request moves to the next zone.
UNSUPPORTED_CODES = frozenset({"UNSUPPORTED_OPERATION"})
# Too many operations on one resource / project per second: back off and retry.
RATE_CODES = frozenset({"RESOURCE_OPERATION_RATE_EXCEEDED", "RATE_LIMIT_EXCEEDED"})
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "quotaExceeded"})
THROTTLE_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
# 403 reasons of a project whose Compute Engine API is not enabled (a new project)
API_DISABLED_REASONS = frozenset({"accessNotConfigured", "SERVICE_DISABLED"})
GONE_CODES = frozenset({"RESOURCE_NOT_FOUND", "notFound"})
EXISTS_CODES = frozenset({"RESOURCE_ALREADY_EXISTS", "alreadyExists"})

_STATES = {
    "PROVISIONING": "pending",
    "STAGING": "pending",
    "RUNNING": "running",
    "REPAIRING": "pending",
    "STOPPING": "stopping",
    "SUSPENDING": "stopping",
    "SUSPENDED": "gone",
    "TERMINATED": "gone",
}

T = TypeVar("T")


def label_value(text: str) -> str:
    """GCP label values: lowercase letters, digits, '-' and '_', at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def instance_name(cluster: str, request_id: str, index: int) -> str:
    """Deterministic worker name: the same request and index always name the same VM.
    `<cluster>--<8 hex>-<n>`: cluster names never hold `--` nor end in `-`, so the prefix
    `<cluster>--` is this cluster's workers' and no other cluster's (the head's IAM
    condition scopes its instance-admin role by it: IAM conditions offer no regex)."""
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:8]
    return f"{cluster}--{digest}-{index}"


def worker_prefix(cluster: str) -> str:
    """What every worker name of `cluster` starts with, and no other cluster's does."""
    return f"{cluster}--"


def head_name(cluster: str) -> str:
    return f"{cluster}-head"


def subnetwork_name(region: str) -> str:
    """The cluster's subnetwork: the default network's in its region (an auto-mode VPC
    network has one subnetwork per region, named after the network). Its VMs name it in
    their NIC, and the head's account may use it and no other (storage.py)."""
    return f"regions/{region}/subnetworks/default"


def firewall_names(cluster: str) -> tuple[str, str, str]:
    """(ssh from the controller, everything between cluster members, deny the rest)."""
    return (f"spotctl-{cluster}-ssh", f"spotctl-{cluster}-internal", f"spotctl-{cluster}-deny")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass(frozen=True)
class Retry:
    """Bounded exponential backoff for 429/5xx: attempts in all, delays base*2^n capped."""

    attempts: int = 5
    base_s: float = 0.5
    max_s: float = 8.0


@dataclass
class _Clients:
    instances: Any
    zone_ops: Any
    global_ops: Any
    firewalls: Any
    images: Any = None
    regions: Any = None
    networks: Any = None
    projects: Any = None
    resource_policies: Any = None
    region_ops: Any = None
    subnetworks: Any = None


def _api_error_parts(exc: Exception) -> tuple[int | None, set[str], str]:
    """(HTTP status, reasons, message) of a google.api_core error from a REST response."""
    code = getattr(exc, "code", None)
    code = code if isinstance(code, int) else None
    reasons: set[str] = set()
    messages: list[str] = []
    for e in getattr(exc, "errors", None) or []:
        if isinstance(e, dict):
            if e.get("reason"):
                reasons.add(str(e["reason"]))
            if e.get("message"):
                messages.append(str(e["message"]))
    reason = getattr(exc, "reason", None)
    if reason:
        reasons.add(str(reason))
    msg = messages[0] if messages else str(getattr(exc, "message", "") or exc)
    # api_core prefixes "METHOD URL: "; the URL says nothing the user can act on.
    msg = re.sub(r"^[A-Z]+ \S+: ", "", _one_line(msg))
    return code, reasons, msg


def classify(exc: Exception, what: str) -> ProviderError:
    """Map an SDK / transport exception to the ProviderError that says what to do next."""
    if isinstance(exc, ProviderError):
        return exc
    name = type(exc).__name__
    if name in ("DefaultCredentialsError", "RefreshError"):
        return AuthError(f"gcp: {what}: no usable credentials ({_one_line(str(exc))})")
    if name in ("ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "TransportError"):
        return TransientError(f"gcp: {what}: cannot reach the Compute API ({name})")
    if type(exc).__module__.startswith("google.auth"):
        # e.g. a 401 made the transport refresh credentials that cannot be refreshed.
        return AuthError(f"gcp: {what}: not authenticated: {_one_line(str(exc))}")
    code, reasons, msg = _api_error_parts(exc)
    text = msg + " " + " ".join(sorted(reasons))
    capacity = sorted(c for c in CAPACITY_CODES if c in text)
    if capacity:
        return CapacityError(f"gcp: {what}: {capacity[-1]}: {msg}")
    unsupported = sorted(c for c in UNSUPPORTED_CODES if c in text)
    if unsupported:
        return CapacityError(f"gcp: {what}: {unsupported[0]}: {msg}")
    rate = sorted(c for c in RATE_CODES if c in text)
    if rate:
        return TransientError(f"gcp: {what}: {rate[0]}: {msg}")
    if reasons & QUOTA_CODES or "QUOTA_EXCEEDED" in text:
        return QuotaError(f"gcp: {what}: quota exceeded: {msg}")
    if code == 429 or reasons & THROTTLE_REASONS:
        return TransientError(f"gcp: {what}: throttled ({code}): {msg}")
    if code == 401:
        return AuthError(f"gcp: {what}: not authenticated: {msg}")
    if code == 403 and (reasons & API_DISABLED_REASONS):
        # a new project: no role is missing, the Compute Engine API is not enabled yet
        return AuthError(f"gcp: {what}: the Compute Engine API is disabled in this project "
                         "(enable it: gcloud services enable compute.googleapis.com)")
    if code == 403:
        return AuthError(
            f"gcp: {what}: permission denied: {msg} (roles spotctl needs: templates/gcp-roles.txt)"
        )
    if code is not None and code >= 500:
        return TransientError(f"gcp: {what}: server error {code}: {msg}")
    if name in ("DeadlineExceeded", "ServiceUnavailable", "RetryError"):
        return TransientError(f"gcp: {what}: {msg}")
    if code == 412:  # a stale etag: the caller may read again and retry (IAM policies)
        return ProviderError(f"gcp: {what}: precondition failed (412): {msg}")
    return ProviderError(f"gcp: {what}: {msg}")


def classify_operation(op: Any, what: str) -> ProviderError | None:
    """The error a finished operation carries, or None if it succeeded."""
    errors = list(op.error.errors) if op.error else []
    if not errors:
        return None
    codes = [str(e.code) for e in errors]
    msg = _one_line(errors[0].message or codes[0])
    capacity = [c for c in codes if c in CAPACITY_CODES or c in UNSUPPORTED_CODES]
    if capacity:
        return CapacityError(f"gcp: {what}: {capacity[0]}: {msg}")
    if any(c in RATE_CODES for c in codes):
        return TransientError(f"gcp: {what}: {codes[0]}: {msg}")
    if any(c in QUOTA_CODES for c in codes):
        return QuotaError(f"gcp: {what}: quota exceeded: {msg}")
    status = int(op.http_error_status_code or 0)
    if status in (401, 403):
        return AuthError(f"gcp: {what}: permission denied: {msg}")
    if status == 429 or status >= 500:
        return TransientError(f"gcp: {what}: {codes[0]}: {msg}")
    return ProviderError(f"gcp: {what}: {codes[0]}: {msg}")


def _is_not_found(exc: Exception) -> bool:
    return getattr(exc, "code", None) == 404


def _is_exists(exc: Exception) -> bool:
    if getattr(exc, "code", None) != 409:
        return False
    _, reasons, _ = _api_error_parts(exc)
    return not reasons or bool(reasons & EXISTS_CODES)


def _short(url: str) -> str:
    """Last path segment of a Compute resource URL ("zones/us-central1-a" -> "us-central1-a")."""
    return url.rstrip("/").rsplit("/", 1)[-1] if url else ""


def _timestamp(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return 0.0


class GcpApi:
    """The Compute API clients of one cluster, project and region."""

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.cluster = ctx.cluster
        self.spec = ctx.spec.gcp
        # gVNIC and compact placement on GPU workers ([placement] fast_network)
        self.fast_network = ctx.spec.placement.fast_network
        self._policies: dict[str, str] = {}  # zone -> the cluster's placement policy there
        opts = ctx.options
        self.endpoint: str = str(opts.get("gcp_endpoint") or os.environ.get(ENV_ENDPOINT) or "")
        self.retry = Retry(
            attempts=int(opts.get("gcp_attempts", Retry.attempts)),
            base_s=float(opts.get("gcp_backoff_base", Retry.base_s)),
            max_s=float(opts.get("gcp_backoff_max", Retry.max_s)),
        )
        self.poll_s = float(opts.get("gcp_poll_interval", 1.0))
        self.op_timeout_s = float(opts.get("gcp_op_timeout", 900.0))
        self.region: str = str(opts.get("region") or self.spec.region)
        self._clients: _Clients | None = None
        self._project: str = self.spec.project
        self._zone_of: dict[str, str] = {}  # instance name -> zone, from the last listing
        # image URL -> (self link, min GB, whether its guestOsFeatures name GVNIC)
        self._images: dict[str, tuple[str, int, bool]] = {}
        self._nodes = CloudNodes(
            ctx, metadata="gcp", metadata_url=METADATA_URL,
            api_port=COORDINATOR_PORT, store_port=STORE_PORT,
        )  # fmt: skip
        self._head_process = bool(opts.get("head_process", True))
        # the head's own reconcile loop runs this provider on the head VM: its VM name
        self._on_head = str(opts.get("on_head") or "")
        self._head: HeadInfo | None = None  # set by ensure_head, used by bootstrap

    # ----------------------------------------------------------------- clients

    @property
    def project(self) -> str:
        if not self._project:
            self._project = os.environ.get("GOOGLE_CLOUD_PROJECT", "")
            if not self._project and not self.endpoint:
                self._clients_or_init()
            if not self._project:
                raise SpecError(
                    "gcp.project: no GCP project set (set gcp.project in spotctl.toml "
                    "or GOOGLE_CLOUD_PROJECT)"
                )
        return self._project

    def _clients_or_init(self) -> _Clients:
        if self._clients is None:
            self._clients = self._make_clients()
        return self._clients

    def _make_clients(self) -> _Clients:
        from google.cloud import compute_v1

        kw: dict[str, Any] = {"transport": "rest"}
        if self.endpoint:
            kw["credentials"] = self._test_credentials()
            kw["client_options"] = {"api_endpoint": self.endpoint}
        else:
            import google.auth

            try:
                creds, project = google.auth.default(scopes=[COMPUTE_SCOPE])
            except Exception as e:
                raise AuthError(
                    "gcp: no credentials found (run `gcloud auth application-default login` "
                    f"or set GOOGLE_APPLICATION_CREDENTIALS): {_one_line(str(e))}"
                ) from None
            kw["credentials"] = creds
            if not self._project and project:
                self._project = project
        return _Clients(
            instances=compute_v1.InstancesClient(**kw),
            # Same endpoint as the instances client: the SDK's own poller would not be.
            zone_ops=compute_v1.ZoneOperationsClient(**kw),
            global_ops=compute_v1.GlobalOperationsClient(**kw),
            firewalls=compute_v1.FirewallsClient(**kw),
            images=compute_v1.ImagesClient(**kw),
            regions=compute_v1.RegionsClient(**kw),
            networks=compute_v1.NetworksClient(**kw),
            projects=compute_v1.ProjectsClient(**kw),
            resource_policies=compute_v1.ResourcePoliciesClient(**kw),
            region_ops=compute_v1.RegionOperationsClient(**kw),
            subnetworks=compute_v1.SubnetworksClient(**kw),
        )

    def _test_credentials(self) -> Any:
        """Under a test endpoint: anonymous (the fake's project owner), or the
        credentials a test hands in (ctx.options["gcp_credentials"], e.g. a VM's
        compute-engine credentials from a fake metadata server, to act as its account)."""
        given = self.ctx.options.get("gcp_credentials")
        if given is not None:
            return given
        from google.auth.credentials import AnonymousCredentials

        return AnonymousCredentials()

    @property
    def clients(self) -> _Clients:
        return self._clients_or_init()

    # ----------------------------------------------------------------- calls, retries, waits

    def _call(self, what: str, fn: Callable[[], T], *, missing_ok: bool = False) -> T | None:
        """Run one API call; retry 429/5xx with backoff; None on 404 when `missing_ok`."""
        delay = self.retry.base_s
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - every SDK error is classified below
                if missing_ok and _is_not_found(exc):
                    return None
                err = classify(exc, what)
                if not err.retryable:
                    raise err from None
                if attempt == self.retry.attempts:
                    raise TransientError(
                        f"{err} (gave up after {self.retry.attempts} attempts)"
                    ) from None
                time.sleep(min(delay, self.retry.max_s) * random.uniform(0.5, 1.0))
                delay *= 2
        raise AssertionError("unreachable")

    def _get_vm(self, zone: str, name: str, *, missing_ok: bool = False) -> Any:
        """One VM's resource (None when gone and `missing_ok`); retries as `_call`."""
        return self._call(
            f"get {name}",
            partial(self.clients.instances.get, project=self.project, zone=zone,
                    instance=name, retry=None),
            missing_ok=missing_ok,
        )  # fmt: skip

    def _wait(
        self, op: Any, what: str, zone: str | None, region: str | None = None
    ) -> ProviderError | None:
        """Wait for an operation through our own operations client; return its error."""
        from google.cloud import compute_v1

        done = compute_v1.Operation.Status.DONE
        deadline = time.monotonic() + self.op_timeout_s
        while op.status != done:
            if time.monotonic() > deadline:
                return TransientError(
                    f"gcp: {what}: operation {op.name} not done after {self.op_timeout_s:.0f}s"
                )
            name = op.name
            if region:
                op = self._call(
                    f"{what} (wait)",
                    partial(self.clients.region_ops.wait, project=self.project, region=region,
                            operation=name, retry=None),
                )
            elif zone:
                op = self._call(
                    f"{what} (wait)",
                    partial(
                        self.clients.zone_ops.wait,
                        project=self.project,
                        zone=zone,
                        operation=name,
                        retry=None,
                    ),
                )
            else:
                op = self._call(
                    f"{what} (wait)",
                    partial(
                        self.clients.global_ops.wait,
                        project=self.project,
                        operation=name,
                        retry=None,
                    ),
                )
            if op.status != done:
                time.sleep(self.poll_s)
        return classify_operation(op, what)
