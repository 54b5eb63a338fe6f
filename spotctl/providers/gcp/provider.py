"""GCP provider: Spot VMs through google-cloud-compute (REST), labels as the source of truth.

What it assumes and guarantees (on top of providers/base.py):
- Every VM carries the labels spotctl-cluster / spotctl-role / spotctl-request-id and the
  network tag `spotctl-<cluster>` from its insert request, so `list` finds it even if the
  controller dies right after the insert.
- Worker names are derived from (cluster, request id, index): a retried launch finds the
  instances of the first try by label, and a re-sent insert is refused as alreadyExists
  instead of creating a twin (inserts also carry a deterministic requestId UUID).
- Zone exhaustion (ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS], arriving as an operation
  error or as an HTTP error body) moves the rest of the request to the next zone of the
  region that sells the same shape, without backoff. Quota and auth errors stop at once.
  429 / 5xx are retried with bounded exponential backoff, then raise TransientError.
- Operations are waited on with our own Zone/GlobalOperationsClient built with the same
  endpoint as the InstancesClient. We never call `.result()` on the SDK's extended
  operation: its poller builds a fresh client on the default endpoint and would ignore
  `client_options` (a test pointed at a fake would poll the real API).

The SDK is imported inside functions so `spotctl prices --provider gcp` and every other
provider work without google-cloud-compute installed.

Test seams (ctx.options, never set by users): gcp_endpoint (or env SPOTCTL_GCP_ENDPOINT),
gcp_backoff_base, gcp_backoff_max, gcp_attempts, gcp_poll_interval, gcp_op_timeout,
ssh_public_key, ssh_cidr, head_api_port, head_store_port, gcp_disk_gb, region,
head_process (default True: `ensure_head` also starts `spotctl head` on the head VM over
SSH; provider unit tests turn it off, their fake VMs have no SSH).

Bootstrap (head and workers) goes over SSH to each VM's external address as
`gcp.ssh_user` with the cluster's own key (spotctl.remote.bootstrap.CloudNodes). Test seam:
`SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT` (+ `SPOTCTL_SSH_OVERRIDE_KEY`, `SPOTCTL_HEAD_PORTS`,
`SPOTCTL_SSH_REMOTE_ROOT`) sends every VM's SSH to one loopback sshd and puts the head on
that address, so `up -> status -> down` runs on the fake Compute API with real SSH, head
and agents (tests/gcp/test_up_flow.py). Under the seam, `cleanup` also stops the
processes the "VMs" ran, as deleting a real VM would.
"""

from __future__ import annotations

import builtins
import hashlib
import ipaddress
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from spotctl.errors import (
    AuthError,
    CapacityError,
    ProviderError,
    QuotaError,
    SpecError,
    TransientError,
)
from spotctl.providers.base import HeadInfo, Instance, Offer, ProviderContext
from spotctl.providers.gcp import catalog as catalog_gcp
from spotctl.remote.bootstrap import CloudNodes, HostResult
from spotctl.state import write_private

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
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "quotaExceeded"})
THROTTLE_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
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
    """Deterministic worker name: the same request and index always name the same VM."""
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:8]
    return f"{cluster}-{digest}-{index}"


def head_name(cluster: str) -> str:
    return f"{cluster}-head"


def network_tag(cluster: str) -> str:
    return f"spotctl-{cluster}"


def firewall_names(cluster: str) -> tuple[str, str]:
    """(ssh from the controller, everything between cluster members)."""
    return (f"spotctl-{cluster}-ssh", f"spotctl-{cluster}-internal")


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


@dataclass
class _Failure:
    """Why some names could not be created in one zone."""

    names: list[str] = field(default_factory=list)
    error: ProviderError | None = None


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
    if reasons & QUOTA_CODES or "QUOTA_EXCEEDED" in text:
        return QuotaError(f"gcp: {what}: quota exceeded: {msg}")
    if code == 429 or reasons & THROTTLE_REASONS:
        return TransientError(f"gcp: {what}: throttled ({code}): {msg}")
    if code == 401:
        return AuthError(f"gcp: {what}: not authenticated: {msg}")
    if code == 403:
        return AuthError(
            f"gcp: {what}: permission denied: {msg} (roles spotctl needs: templates/gcp-roles.txt)"
        )
    if code is not None and code >= 500:
        return TransientError(f"gcp: {what}: server error {code}: {msg}")
    if name in ("DeadlineExceeded", "ServiceUnavailable", "RetryError"):
        return TransientError(f"gcp: {what}: {msg}")
    return ProviderError(f"gcp: {what}: {msg}")


def classify_operation(op: Any, what: str) -> ProviderError | None:
    """The error a finished operation carries, or None if it succeeded."""
    errors = list(op.error.errors) if op.error else []
    if not errors:
        return None
    codes = [str(e.code) for e in errors]
    msg = _one_line(errors[0].message or codes[0])
    capacity = [c for c in codes if c in CAPACITY_CODES]
    if capacity:
        return CapacityError(f"gcp: {what}: {capacity[0]}: {msg}")
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


class GcpProvider:
    """Spot workers and one standard head VM in one GCP project and region."""

    name = "gcp"

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.cluster = ctx.cluster
        self.spec = ctx.spec.gcp
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
        self._nodes = CloudNodes(
            ctx, metadata="gcp", metadata_url=METADATA_URL,
            api_port=COORDINATOR_PORT, store_port=STORE_PORT,
        )  # fmt: skip
        self._head_process = bool(opts.get("head_process", True))
        self._head: HeadInfo | None = None  # set by ensure_head, used by bootstrap

    # ----------------------------------------------------------------- offers (no API)

    def offers(self) -> builtins.list[Offer]:
        region = None if self.region in ("*", "all") else self.region
        gpu = self.spec.gpu.lower()
        out: builtins.list[Offer] = []
        for r in catalog_gcp.rows(region):
            if self.spec.zones and r.zone not in self.spec.zones:
                continue
            if self.spec.machine_types and r.machine_type not in self.spec.machine_types:
                continue
            if gpu and r.gpu_name.lower() != gpu:
                continue
            out.append(r.to_offer())
        return out

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
            from google.auth.credentials import AnonymousCredentials

            kw["credentials"] = AnonymousCredentials()
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
        )

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

    def _wait(self, op: Any, what: str, zone: str | None) -> ProviderError | None:
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
            if zone:
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

    # ----------------------------------------------------------------- listing

    def _filter(self, **labels: str) -> str:
        terms = [f'labels.{k} = "{v}"' for k, v in labels.items()]
        return terms[0] if len(terms) == 1 else " AND ".join(f"({t})" for t in terms)

    def _raw_list(self, **labels: str) -> builtins.list[Any]:
        """Every VM in the project with these labels, in any zone (aggregated list)."""
        from google.cloud import compute_v1

        req = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=self._filter(**labels)
        )

        def run() -> builtins.list[Any]:
            out = []
            for _scope, scoped in self.clients.instances.aggregated_list(request=req, retry=None):
                out.extend(scoped.instances)
            return out

        found = self._call("list instances", run) or []
        for vm in found:
            self._zone_of[vm.name] = _short(vm.zone)
        return found

    def list(self, cluster: str) -> builtins.list[Instance]:
        vms = self._raw_list(**{LABEL_CLUSTER: label_value(cluster)})
        out = [self._to_instance(vm) for vm in vms]
        return [i for i in out if i.state != "gone"]

    def _to_instance(self, vm: Any) -> Instance:
        zone = _short(vm.zone)
        machine = _short(vm.machine_type)
        accel = list(vm.guest_accelerators)
        gpus = sum(int(a.accelerator_count) for a in accel)
        gpu_name = ""
        if not accel and machine in catalog_gcp.BUNDLED:
            gpu_name, gpus = catalog_gcp.BUNDLED[machine]
        elif accel:
            kind = _short(accel[0].accelerator_type)
            gpu_name = next(
                (g for g, a in catalog_gcp.GUEST_ACCELERATORS.items() if a == kind), kind
            )
        row = next(
            (
                r
                for r in catalog_gcp.rows(None)
                if r.zone == zone
                and r.machine_type == machine
                and r.gpus == gpus
                and r.gpu_name == gpu_name
            ),
            None,
        )
        labels = dict(vm.labels)
        spot = str(vm.scheduling.provisioning_model) == "SPOT"
        nic = vm.network_interfaces[0] if vm.network_interfaces else None
        internal = nic.network_i_p if nic else ""
        external = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
        return Instance(
            id=vm.name,
            cluster=labels.get(LABEL_CLUSTER, ""),
            role=labels.get(LABEL_ROLE, "worker"),
            zone=zone,
            instance_type=machine,
            gpus=gpus,
            state=_STATES.get(str(vm.status), "pending"),
            request_id=labels.get(LABEL_REQUEST, ""),
            price=(row.spot_price if spot else row.on_demand_price) if row else 0.0,
            on_demand_price=row.on_demand_price if row else 0.0,
            launched_at=_timestamp(vm.creation_timestamp),
            address=internal,
            public_address=external or internal,
            spot=spot,
            ssh_user=self.spec.ssh_user,
            meta={
                "gcp_status": str(vm.status),
                "gpu_name": gpu_name,
                "key_file": str(self._key_path()),
                "project": self.project,
            },
        )

    # ----------------------------------------------------------------- launch

    def launch(self, offer: Offer, count: int, request_id: str) -> builtins.list[Instance]:
        if offer.provider != "gcp":
            raise SpecError(f"gcp: cannot launch a {offer.provider} offer")
        if count <= 0:
            return []
        rid = label_value(request_id)
        existing = [
            self._to_instance(vm)
            for vm in self._raw_list(
                **{LABEL_CLUSTER: label_value(self.cluster), LABEL_REQUEST: rid}
            )
        ]
        existing = [i for i in existing if i.role == "worker"]
        have = {i.id for i in existing}
        wanted = [
            n
            for n in (instance_name(self.cluster, request_id, i) for i in range(count))
            if n not in have
        ]
        launched = list(existing)
        exhausted: builtins.list[str] = []
        last: ProviderError | None = None
        for zone in self._failover_zones(offer):
            if not wanted:
                break
            created, failure = self._insert_in_zone(zone, offer, wanted, rid)
            launched.extend(created)
            wanted = failure.names
            if failure.error is None:
                continue
            if isinstance(failure.error, CapacityError):
                exhausted.append(zone)
                last = failure.error
                continue
            raise failure.error
        if wanted and not launched:
            raise CapacityError(
                f"gcp: no capacity for {offer.instance_type} ({offer.gpus} x {offer.gpu_name}) "
                f"in {', '.join(exhausted) or offer.zone}" + (f" ({last})" if last else "")
            )
        return launched

    def _failover_zones(self, offer: Offer) -> builtins.list[str]:
        """The offer's zone first, then other zones of its region selling the same shape."""
        same = [
            r
            for r in catalog_gcp.rows(offer.region)
            if r.machine_type == offer.instance_type
            and r.gpus == offer.gpus
            and r.gpu_name == offer.gpu_name
            and r.zone != offer.zone
            and (not self.spec.zones or r.zone in self.spec.zones)
        ]
        same.sort(key=lambda r: (r.spot_price, r.zone))
        return [offer.zone] + [r.zone for r in same]

    def _guest_accelerator(self, offer: Offer) -> str:
        if offer.instance_type in catalog_gcp.BUNDLED:
            return ""
        accel = catalog_gcp.GUEST_ACCELERATORS.get(offer.gpu_name, "")
        if offer.gpus and not accel:
            raise SpecError(
                f"gcp: {offer.instance_type} with {offer.gpu_name} is not a GPU shape spotctl "
                f"knows (use a2/a3/g2 or n1 with {', '.join(catalog_gcp.GUEST_ACCELERATORS)})"
            )
        return accel

    def _insert_in_zone(
        self, zone: str, offer: Offer, names: builtins.list[str], rid: str
    ) -> tuple[builtins.list[Instance], _Failure]:
        """Insert `names` in `zone`; wait for all; report what failed and why."""
        accel = self._guest_accelerator(offer)
        pending: builtins.list[tuple[str, Any]] = []
        failure = _Failure()
        for i, name in enumerate(names):
            resource = self._instance_resource(
                name=name,
                zone=zone,
                machine_type=offer.instance_type,
                role="worker",
                rid=rid,
                spot=True,
                accel=accel,
                gpus=offer.gpus,
            )
            try:
                op = self._insert(zone, resource, f"{name}/{rid}")
            except CapacityError as e:
                # The zone said no: the rest of the request goes to the next zone now.
                failure = _Failure(names=names[i:], error=e)
                break
            pending.append((name, op))
        created: builtins.list[Instance] = []
        for name, op in pending:
            err = self._wait(op, f"create {name} in {zone}", zone) if op is not None else None
            if err is not None:
                failure.names.append(name)
                # Capacity errors fail over; any other error wins, since it stops the launch.
                if failure.error is None or (
                    isinstance(failure.error, CapacityError) and not isinstance(err, CapacityError)
                ):
                    failure.error = err
                continue
            vm = self._call(
                f"get {name}",
                partial(
                    self.clients.instances.get,
                    project=self.project,
                    zone=zone,
                    instance=name,
                    retry=None,
                ),
                missing_ok=True,
            )
            if vm is not None:
                self._zone_of[name] = zone
                created.append(self._to_instance(vm))
        return created, failure

    def _insert(self, zone: str, resource: Any, key: str) -> Any:
        """Insert one VM. None when it already exists (a retry of an earlier insert)."""
        from google.cloud import compute_v1

        req = compute_v1.InsertInstanceRequest(
            project=self.project,
            zone=zone,
            instance_resource=resource,
            # Same (name, request) -> same UUID: GCP dedupes a re-sent insert server-side.
            request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"spotctl/{self.cluster}/{zone}/{key}")),
        )

        def run() -> Any:
            try:
                return self.clients.instances.insert_unary(request=req, retry=None)
            except Exception as exc:  # noqa: BLE001
                if _is_exists(exc):
                    return None
                raise

        return self._call(f"create {resource.name} in {zone}", run)

    def _instance_resource(
        self,
        *,
        name: str,
        zone: str,
        machine_type: str,
        role: str,
        rid: str,
        spot: bool,
        accel: str = "",
        gpus: int = 0,
    ) -> Any:
        from google.cloud import compute_v1

        if spot:
            scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT",
                # A reclaimed spot VM is deleted, not stopped: nothing to pay for or clean.
                instance_termination_action="DELETE",
                # GPU VMs cannot live-migrate; spot VMs never restart by themselves.
                on_host_maintenance="TERMINATE",
                automatic_restart=False,
            )
        else:
            scheduling = compute_v1.Scheduling(
                provisioning_model="STANDARD",
                on_host_maintenance="MIGRATE",
                automatic_restart=True,
            )
        accelerators = []
        if accel and gpus:
            accelerators.append(
                compute_v1.AcceleratorConfig(
                    accelerator_count=gpus,
                    accelerator_type=f"projects/{self.project}/zones/{zone}/acceleratorTypes/{accel}",
                )
            )
        disk_gb = int(self.ctx.options.get("gcp_disk_gb", 100 if role == "worker" else 20))
        return compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{machine_type}",
            labels={
                LABEL_CLUSTER: label_value(self.cluster),
                LABEL_ROLE: role,
                LABEL_REQUEST: rid,
            },
            tags=compute_v1.Tags(items=[network_tag(self.cluster)]),
            scheduling=scheduling,
            guest_accelerators=accelerators,
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=self.spec.image, disk_size_gb=disk_gb
                    ),
                )
            ],
            network_interfaces=[
                compute_v1.NetworkInterface(
                    network="global/networks/default",
                    access_configs=[
                        compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
                    ],
                )
            ],
            metadata=compute_v1.Metadata(
                items=[
                    compute_v1.Items(key="ssh-keys", value=self._ssh_keys_entry()),
                    # Only the cluster key logs in: no project-wide keys, no OS Login.
                    compute_v1.Items(key="block-project-ssh-keys", value="TRUE"),
                    compute_v1.Items(key="enable-oslogin", value="FALSE"),
                ]
            ),
        )

    # ----------------------------------------------------------------- terminate

    def terminate(self, ids: Sequence[str]) -> None:
        ids = [i for i in ids if i]
        if not ids:
            return
        if any(i not in self._zone_of for i in ids):
            self._raw_list(**{LABEL_CLUSTER: label_value(self.cluster)})
        self._delete([(self._zone_of[i], i) for i in ids if i in self._zone_of])

    def _delete(self, targets: Iterable[tuple[str, str]]) -> None:
        """Delete (zone, name) pairs; a VM that is already gone is not an error."""
        pending = []
        for zone, name in targets:
            op = self._call(
                f"delete {name}",
                partial(
                    self.clients.instances.delete_unary,
                    project=self.project,
                    zone=zone,
                    instance=name,
                    retry=None,
                ),
                missing_ok=True,
            )
            self._zone_of.pop(name, None)
            if op is not None:
                pending.append((zone, name, op))
        for zone, name, op in pending:
            err = self._wait(op, f"delete {name}", zone)
            if err is not None and "RESOURCE_NOT_FOUND" not in str(err):
                raise err

    # ----------------------------------------------------------------- cluster resources

    def prepare(self) -> None:
        """Firewall rules: SSH only from the controller's CIDR; all ports between members."""
        from google.cloud import compute_v1

        cidr = self._ssh_cidr()
        tag = network_tag(self.cluster)
        ssh_name, internal_name = firewall_names(self.cluster)
        wanted = {
            ssh_name: compute_v1.Firewall(
                name=ssh_name,
                network="global/networks/default",
                direction="INGRESS",
                priority=1000,
                description=f"spotctl cluster {self.cluster}: SSH from the controller",
                allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
                source_ranges=[cidr],
                target_tags=[tag],
            ),
            internal_name: compute_v1.Firewall(
                name=internal_name,
                network="global/networks/default",
                direction="INGRESS",
                priority=1000,
                description=f"spotctl cluster {self.cluster}: traffic between members",
                # Rendezvous, coordinator API and gloo/NCCL use dynamic ports.
                allowed=[
                    compute_v1.Allowed(I_p_protocol="tcp"),
                    compute_v1.Allowed(I_p_protocol="udp"),
                    compute_v1.Allowed(I_p_protocol="icmp"),
                ],
                source_tags=[tag],
                target_tags=[tag],
            ),
        }
        have = {fw.name: fw for fw in self._list_firewalls()}
        ops = []
        for name, rule in wanted.items():
            old = have.get(name)
            if old is not None and sorted(old.source_ranges) == sorted(rule.source_ranges):
                continue
            if old is not None:
                # The controller's address changed: replace the rule rather than widen it.
                self._delete_firewalls([name])
            ops.append((name, self._insert_firewall(rule)))
        for name, op in ops:
            if op is not None:
                err = self._wait(op, f"create firewall {name}", None)
                if err is not None:
                    raise err

    def _insert_firewall(self, rule: Any) -> Any:
        def run() -> Any:
            try:
                return self.clients.firewalls.insert_unary(
                    project=self.project, firewall_resource=rule, retry=None
                )
            except Exception as exc:  # noqa: BLE001
                if _is_exists(exc):
                    return None
                raise

        return self._call(f"create firewall {rule.name}", run)

    def _list_firewalls(self) -> builtins.list[Any]:
        from google.cloud import compute_v1

        names = "|".join(firewall_names(self.cluster))
        # Regex filter (eq), full match: a cluster named "demo" must not see "demo-2"'s rules.
        req = compute_v1.ListFirewallsRequest(project=self.project, filter=f'name eq "({names})"')
        return (
            self._call(
                "list firewalls", lambda: list(self.clients.firewalls.list(request=req, retry=None))
            )
            or []
        )

    def _delete_firewalls(self, names: Iterable[str]) -> None:
        pending = []
        for name in names:
            op = self._call(
                f"delete firewall {name}",
                partial(
                    self.clients.firewalls.delete_unary,
                    project=self.project,
                    firewall=name,
                    retry=None,
                ),
                missing_ok=True,
            )
            if op is not None:
                pending.append((name, op))
        for name, op in pending:
            err = self._wait(op, f"delete firewall {name}", None)
            if err is not None and "RESOURCE_NOT_FOUND" not in str(err):
                raise err

    def ensure_head(self) -> HeadInfo:
        """A small standard (non-spot) VM labelled role=head, created once, then reused,
        running `spotctl head` (started over SSH if not running; token uploaded 0600).
        Nodes use its internal address; the controller `public_url` (external address)."""
        name = head_name(self.cluster)
        heads = [
            vm
            for vm in self._raw_list(
                **{LABEL_CLUSTER: label_value(self.cluster), LABEL_ROLE: "head"}
            )
        ]
        live = [vm for vm in heads if _STATES.get(str(vm.status)) in ("running", "pending")]
        if not live:
            # A stopped head lost its in-memory store anyway: replace it.
            self._delete((_short(vm.zone), vm.name) for vm in heads)
            zone = self._head_zone()
            resource = self._instance_resource(
                name=name,
                zone=zone,
                machine_type=self.spec.head_machine_type,
                role="head",
                rid=HEAD_REQUEST_ID,
                spot=False,
            )
            op = self._insert(zone, resource, f"{name}/head")
            if op is not None:
                err = self._wait(op, f"create head {name} in {zone}", zone)
                if err is not None:
                    raise err
            vm = self._call(
                f"get {name}",
                partial(
                    self.clients.instances.get,
                    project=self.project,
                    zone=zone,
                    instance=name,
                    retry=None,
                ),
            )
        else:
            vm = live[0]
        head = self._to_instance(vm)
        self._head = self._nodes.head(head, self._head_process, "gcp")
        return self._head

    def bootstrap(self, instances: Sequence[Instance]) -> builtins.list[HostResult]:
        """Make launched workers nodes over SSH: wait until each runs with an address,
        start its agent (GCP metadata notices), confirm its first heartbeat at the head.
        Per-host results; one host failing never hides the others."""
        head = self._head or self.ensure_head()
        want = {i.id for i in instances}
        deadline = time.monotonic() + self.op_timeout_s
        while True:
            now = {i.id: i for i in self.list(self.cluster) if i.id in want}
            ready = [i for i in now.values() if i.state == "running" and i.address]
            if len(ready) == len(want) or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        missing = [
            HostResult(i, False, f"gcp: {i} not running with an address", False, 0.0)
            for i in sorted(want - {i.id for i in ready})
        ]
        return missing + self._nodes.bootstrap(ready, head)

    def _head_zone(self) -> str:
        if self.spec.zones:
            return self.spec.zones[0]
        zones = sorted({r.zone for r in catalog_gcp.rows(self.region)})
        if not zones:
            raise SpecError(f"gcp.region: no known zones in {self.region!r}; set gcp.zones")
        return zones[0]

    def cleanup(self) -> builtins.list[str]:
        """Delete every VM and firewall rule of the cluster; describe anything still there."""
        label = {LABEL_CLUSTER: label_value(self.cluster)}
        leaks: builtins.list[str] = []
        if self._nodes.override is not None:
            # Test seam: the "VMs" are processes behind one sshd; stop them as deleting
            # the VMs would.
            insts = self.list(self.cluster)
            leaks += [f"{r.node_id}: {r.reason}" for r in self._nodes.release(insts) if not r.ok]
        vms = self._raw_list(**label)
        self._delete((_short(vm.zone), vm.name) for vm in vms)
        self._delete_firewalls(firewall_names(self.cluster))
        leaks += [
            f"instance {_short(vm.zone)}/{vm.name} ({vm.status})" for vm in self._raw_list(**label)
        ]
        leaks += [f"firewall {fw.name}" for fw in self._list_firewalls()]
        return leaks

    # ----------------------------------------------------------------- ssh key

    def _key_path(self) -> Path:
        return self.ctx.path / "ssh" / "id_ed25519"

    def _ssh_keys_entry(self) -> str:
        """`user:key comment` for the ssh-keys metadata item."""
        pub = str(self.ctx.options.get("ssh_public_key") or "")
        if not pub:
            pub = self._ensure_key()
        return f"{self.spec.ssh_user}:{pub.strip()}"

    def _ssh_cidr(self) -> str:
        """gcp.ssh_cidr, else the caller's address the CLI passed; never SSH open to all."""
        raw = self.spec.ssh_cidr or str(self.ctx.options.get("ssh_cidr") or "")
        if not raw:
            raise SpecError(
                "gcp.ssh_cidr: not set and the caller's address is unknown; set it to the "
                'address spotctl runs from, e.g. ssh_cidr = "203.0.113.7/32"'
            )
        try:
            return str(ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise SpecError(f"gcp.ssh_cidr: {raw!r} is not an IP address or CIDR") from None

    def _ensure_key(self) -> str:
        """The cluster's own SSH key (created once, private part 0600)."""
        priv = self._key_path()
        pub = priv.with_suffix(".pub")
        if pub.exists() and priv.exists():
            return pub.read_text().strip()
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        private_text = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ).decode()
        public_text = (
            key.public_key()
            .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            .decode()
            + f" spotctl-{self.cluster}"
        )
        write_private(priv, private_text)
        pub.write_text(public_text + "\n")
        return public_text


def create(ctx: ProviderContext) -> GcpProvider:
    return GcpProvider(ctx)
