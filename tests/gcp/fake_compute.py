"""A local fake of the Compute Engine v1 REST API, for the real google-cloud-compute client.

It implements exactly the calls spotctl uses: instances insert / get / list / delete /
aggregatedList, zone and global operations get / wait, firewalls insert / list / delete,
images get / getFromFamily (a small table of public images with their minimum disk size),
regions get (quotas from `region_quotas`), projects get (`project_quotas`; usage of
either from `quota_usage`), networks get (`networks`), subnetworks get / getIamPolicy /
setIamPolicy (the default network's "default" in every region, and `subnetworks`); and on
the same
endpoint Cloud Storage (JSON API) and IAM service accounts (fake_storage.py, `.storage`).
Inserts are refused as GCP refuses them: an unknown image, a boot disk smaller than the
image, pd-standard (GCP's default disk type) or a non-Hyperdisk disk on families that do
not take it, a missing gVNIC on families that require it (g2, a3, ...), and more external
addresses in a region than `address_quota[region]` (QUOTA_EXCEEDED IN_USE_ADDRESSES), a
service account (serviceAccounts[].email) that does not exist.
Error bodies have the real shape {"error": {"code", "message", "errors": [{"reason", ...}]}},
operation errors the real {"error": {"errors": [{"code", "message"}]}} with
httpErrorStatusCode. Every request is recorded (method, call key, path, query, JSON body)
so tests can assert what the provider sent.

Fault injection:
- `exhaust(zone, style)`: inserts in `zone` fail with ZONE_RESOURCE_POOL_EXHAUSTED*, as an
  operation error ("operation"), an HTTP 503 body ("http503") or HTTP 400 ("http400").
- `quota(style)`: every insert fails with QUOTA_EXCEEDED ("http403" or "operation").
- `fail(key, status, reason, times)`: the next `times` calls of `key` (e.g.
  "instances.insert") answer `status` with `reason` (5xx once, 429, 401, 403 ...).
- `op_fail(code, status, zone, times)`: the next `times` inserts (in `zone`, or any zone
  when empty) finish with an operation error `code` (UNSUPPORTED_OPERATION,
  RESOURCE_OPERATION_RATE_EXCEEDED, ...) and create nothing.
- `pending_polls = N`: new operations come back PENDING and turn DONE on the N-th poll.
- `compute_api_disabled = True`: every Compute call answers 403 SERVICE_DISABLED, as in
  a new project whose Compute Engine API is not enabled.

Who calls: a request with a service account's bearer token is authorized as IAM would
(fake_iam.py: project, subnetwork, resource policy and service account IAM policies,
predefined and custom roles, conditions on names); refusals are Compute's 403 (400 for a
service account the caller may not act as) and are kept in `refused`. Anonymous requests
act as the project's owner. A firewall rule with both service accounts and tags is a 400.

Filters supported: `labels.K = "V"`, `(labels.K = "V") AND (labels.K2 = "V2")`,
`name eq "REGEX"` (full match). Anything else is a 400, as the real API would do for
a filter it cannot parse, so a provider typo shows up in tests.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .fake_iam import ComputeIam, ConditionError, Refused
from .fake_storage import SA_DOMAIN, FakeStorage

P = r"/compute/v1/projects/(?P<project>[^/]+)"
ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    (m, key, re.compile(rx + "$"))
    for m, key, rx in [
        ("POST", "instances.insert", P + r"/zones/(?P<zone>[^/]+)/instances"),
        ("GET", "instances.list", P + r"/zones/(?P<zone>[^/]+)/instances"),
        ("GET", "instances.get", P + r"/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)"),
        (
            "GET",
            "instances.getGuestAttributes",
            P + r"/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)/getGuestAttributes",
        ),
        ("DELETE", "instances.delete", P + r"/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)"),
        ("GET", "instances.aggregatedList", P + r"/aggregated/instances"),
        ("GET", "zoneOperations.get", P + r"/zones/(?P<zone>[^/]+)/operations/(?P<op>[^/]+)"),
        (
            "POST",
            "zoneOperations.wait",
            P + r"/zones/(?P<zone>[^/]+)/operations/(?P<op>[^/]+)/wait",
        ),
        ("GET", "globalOperations.get", P + r"/global/operations/(?P<op>[^/]+)"),
        ("POST", "globalOperations.wait", P + r"/global/operations/(?P<op>[^/]+)/wait"),
        ("GET", "images.getFromFamily", P + r"/global/images/family/(?P<name>[^/]+)"),
        ("GET", "images.get", P + r"/global/images/(?P<name>[^/]+)"),
        ("GET", "projects.get", P),
        ("GET", "regions.get", P + r"/regions/(?P<region>[^/]+)"),
        ("GET", "networks.get", P + r"/global/networks/(?P<name>[^/]+)"),
        ("GET", "subnetworks.get", P + r"/regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)"),
        ("GET", "subnetworks.getIamPolicy",
         P + r"/regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)/getIamPolicy"),
        ("POST", "subnetworks.setIamPolicy",
         P + r"/regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)/setIamPolicy"),
        ("POST", "firewalls.insert", P + r"/global/firewalls"),
        ("GET", "firewalls.list", P + r"/global/firewalls"),
        ("DELETE", "firewalls.delete", P + r"/global/firewalls/(?P<name>[^/]+)"),
        ("POST", "resourcePolicies.insert", P + r"/regions/(?P<region>[^/]+)/resourcePolicies"),
        ("GET", "resourcePolicies.list", P + r"/regions/(?P<region>[^/]+)/resourcePolicies"),
        ("GET", "resourcePolicies.get",
         P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)"),
        ("GET", "resourcePolicies.getIamPolicy",
         P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)/getIamPolicy"),
        ("POST", "resourcePolicies.setIamPolicy",
         P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)/setIamPolicy"),
        ("DELETE", "resourcePolicies.delete",
         P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)"),
        ("GET", "regionOperations.get",
         P + r"/regions/(?P<region>[^/]+)/operations/(?P<op>[^/]+)"),
        ("POST", "regionOperations.wait",
         P + r"/regions/(?P<region>[^/]+)/operations/(?P<op>[^/]+)/wait"),
    ]
]

# Images the fake knows: (project, family) -> (image name, minimum disk GB, guestOsFeatures).
# The public ones name GVNIC, as GCP's do today.
GVNIC_READY = ("UEFI_COMPATIBLE", "VIRTIO_SCSI_MULTIQUEUE", "GVNIC")
IMAGES: dict[tuple[str, str], tuple[str, int, tuple[str, ...]]] = {
    ("debian-cloud", "debian-12"): ("debian-12-bookworm-v20241112", 10, GVNIC_READY),
    # Deep Learning VM: PyTorch 2.9 (supported to 2028). The Debian families (the 2.4 one
    # spotctl named before) are deprecated, past their end of availability: unknown here
    ("deeplearning-platform-release", "pytorch-2-9-cu129-ubuntu-2404-nvidia-580"): (
        "pytorch-2-9-cu129-ubuntu-2404-nvidia-580-v20251105",
        50,
        GVNIC_READY,
    ),
    # the PyTorch 2.7 Deep Learning VM, on NVIDIA driver 570
    ("deeplearning-platform-release", "pytorch-2-7-cu128-ubuntu-2204-nvidia-570"): (
        "pytorch-2-7-cu128-ubuntu-2204-nvidia-570-v20250601",
        50,
        GVNIC_READY,
    ),
    # an older image of the kind users bring, made before gVNIC: no GVNIC guest feature
    ("spotctl-test", "no-gvnic"): ("no-gvnic-v20190101", 10, ("VIRTIO_SCSI_MULTIQUEUE",)),
}
# What GCP refuses, by machine family (prefix of the machine type name).
NO_PD_STANDARD = ("g2-", "a3-", "a4-", "c3-", "c3d-", "c4-", "n4-", "h3-")
HYPERDISK_ONLY = ("a3-ultragpu", "a4-", "c4-", "n4-")
NO_HYPERDISK = ("e2-", "n1-")  # Compute Engine docs, Hyperdisk: machine type support
GVNIC_REQUIRED = ("g2-", "a3-", "a4-", "c3-", "c4-", "n4-", "h3-")
# Families a compact placement policy takes (Compute Engine: placement policies overview).
COMPACT_OK = ("a2-", "a3-", "a4-", "g2-", "c2-", "c2d-", "c3-", "c3d-", "h3-", "n2-", "n2d-")

# accelerator type -> its standard GPU quota metric (Compute Engine "GPU quotas")
GPU_METRICS = {"nvidia-tesla-t4": "NVIDIA_T4_GPUS", "nvidia-l4": "NVIDIA_L4_GPUS",
               "nvidia-tesla-a100": "NVIDIA_A100_GPUS", "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
               "nvidia-h100-80gb": "NVIDIA_H100_GPUS", "nvidia-tesla-v100": "NVIDIA_V100_GPUS"}

_LABEL_TERM = r'labels\.([a-z0-9_-]+)\s*=\s*"([^"]*)"'


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, domain: str = "global"):
        super().__init__(message)
        self.status, self.reason, self.message, self.domain = status, reason, message, domain

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.status,
                "message": self.message,
                "errors": [{"message": self.message, "domain": self.domain, "reason": self.reason}],
            }
        }


def _service_disabled(project: str) -> dict[str, Any]:
    """The body Compute answers with in a project where its API is not enabled."""
    msg = (f"Compute Engine API has not been used in project {project} before or it is "
           "disabled. Enable it by visiting https://console.developers.google.com/apis/api/"
           f"compute.googleapis.com/overview?project={project} then retry. If you enabled "
           "this API recently, wait a few minutes for the action to propagate to our "
           "systems and retry.")
    return {"error": {
        "code": 403, "message": msg, "status": "PERMISSION_DENIED",
        "errors": [{"message": msg, "domain": "usageLimits", "reason": "accessNotConfigured",
                    "extendedHelp": "https://console.developers.google.com"}],
        "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                     "reason": "SERVICE_DISABLED", "domain": "googleapis.com",
                     "metadata": {"service": "compute.googleapis.com",
                                  "consumer": f"projects/{project}"}}],
    }}  # fmt: skip


@dataclass
class Recorded:
    method: str
    key: str
    path: str
    query: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class Fault:
    key: str
    status: int
    reason: str
    times: int
    message: str


@dataclass
class _Op:
    resource: dict[str, Any]
    polls_left: int
    on_done: Callable[[], None] | None = None
    error: dict[str, Any] | None = field(default=None)


def parse_filter(text: str) -> Callable[[dict[str, Any]], bool]:
    """The filter subset spotctl uses; raises ApiError(400) on anything else."""
    text = text.strip()
    if not text:
        return lambda r: True
    m = re.fullmatch(r'name\s+eq\s+"([^"]*)"', text)
    if m:
        rx = re.compile(m.group(1))
        return lambda r: bool(rx.fullmatch(r.get("name", "")))
    m = re.fullmatch(_LABEL_TERM, text)
    terms: list[tuple[str, str]] = []
    if m:
        terms = [(m.group(1), m.group(2))]
    else:
        parts = re.split(r"\s+AND\s+", text)
        for part in parts:
            pm = re.fullmatch(r"\(\s*" + _LABEL_TERM + r"\s*\)", part.strip())
            if not pm:
                raise ApiError(400, "invalid", f"Invalid value for field 'filter': '{text}'.")
            terms.append((pm.group(1), pm.group(2)))
    return lambda r: all(r.get("labels", {}).get(k) == v for k, v in terms)


class FakeCompute:
    def __init__(self) -> None:
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.firewalls: dict[str, dict[str, Any]] = {}
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}  # (region, name) -> policy
        self.operations: dict[str, _Op] = {}
        self.requests: list[Recorded] = []
        self.exhausted: dict[str, str] = {}
        self.quota_style: str = ""
        self.faults: list[Fault] = []
        self.op_faults: list[list[Any]] = []  # [code, status, zone, times left]
        # regions.get: the project's quotas per region (metric -> limit), as a new project
        # has them (no GPU quota), and the networks that exist.
        self.region_quotas: dict[str, float] = {
            "CPUS": 24.0,
            "IN_USE_ADDRESSES": 8.0,
            "NVIDIA_T4_GPUS": 0.0,
            "PREEMPTIBLE_NVIDIA_T4_GPUS": 0.0,
            "NVIDIA_L4_GPUS": 0.0,
            "PREEMPTIBLE_NVIDIA_L4_GPUS": 0.0,
        }
        self.networks: set[str] = {"default"}
        # subnetworks beyond the default network's (auto mode: one named "default" in
        # every region): (region, name) -> its network
        self.subnetworks: dict[tuple[str, str], str] = {}
        # (region, subnetwork name) -> the subnetwork's own IAM policy
        self.subnet_iam: dict[tuple[str, str], dict[str, Any]] = {}
        # IAM on Compute calls made with a service account's token (fake_iam.py):
        # (route key, account) of each such call, and (route key, message) of each refusal
        self.iam = ComputeIam(self)
        self.callers: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        # projects.get: project-wide quotas, as a new project has them (GPUS_ALL_REGIONS 0)
        self.project_quotas: dict[str, float] = {"GPUS_ALL_REGIONS": 0.0,
                                                 "CPUS_ALL_REGIONS": 32.0}
        # usage of any quota metric (region or project), 0 when not listed
        self.quota_usage: dict[str, float] = {}
        # a new project before `gcloud services enable compute.googleapis.com`: every
        # Compute call is refused with the real SERVICE_DISABLED answer
        self.compute_api_disabled = False
        # (zone, name) -> {key type: base64}: what a VM's guest agent published in hostkeys/
        self.guest_host_keys: dict[tuple[str, str], dict[str, str]] = {}
        # External (in-use) addresses allowed per region; a region not listed is unlimited.
        self.address_quota: dict[str, int] = {}
        # Inserts count GPUs against the region's quota as Compute Engine does (off by
        # default: the new-project quotas above would refuse every GPU VM). A Spot VM
        # counts against PREEMPTIBLE_<metric> where the project was granted it (limit > 0),
        # else against the standard metric (Compute Engine docs, "Allocation quotas").
        self.gpu_quota = False
        # (region, policy name) -> the resource policy's own IAM policy (bindings, etag)
        self.policy_iam: dict[tuple[str, str], dict[str, Any]] = {}
        self.pending_polls = 0
        self._by_request_id: dict[str, str] = {}
        self._ids = itertools.count(1000)
        self._lock = threading.RLock()
        self.insert_latency_s = 0.0  # each instances.insert takes this long to answer
        self.max_parallel_inserts = 0  # most inserts seen in flight at once
        self._inserts_now = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.storage = FakeStorage(self)

    # -------------------------------------------------------------- lifecycle

    @contextmanager
    def _in_flight(self, holder: Any, now: str, most: str, delay_s: float) -> Iterator[None]:
        """One request counted in `holder.<now>` while it runs, the most at once kept in
        `holder.<most>`; it waits delay_s first, outside the lock, as a real API's latency."""
        with self._lock:
            setattr(holder, now, getattr(holder, now) + 1)
            setattr(holder, most, max(getattr(holder, most), getattr(holder, now)))
        try:
            time.sleep(delay_s)
            yield
        finally:
            with self._lock:
                setattr(holder, now, getattr(holder, now) - 1)

    def start(self) -> FakeCompute:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                if FakeStorage.serves(self.path):
                    st = fake.storage
                    blob = self.path.encode() + raw[:8192]
                    slow = (not st.slow_uploads or (st.slow_uploads(blob)
                            if callable(st.slow_uploads) else st.slow_uploads in blob))
                    with (fake._in_flight(st, "uploads_now", "max_parallel_uploads",
                                          st.upload_latency_s if slow else 0.0)
                          if self.path.startswith("/upload/") else nullcontext()):
                        code, headers, data = st.handle(self.command, self.path, self.headers, raw)
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    if "Content-Length" not in headers:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    try:
                        self.wfile.write(data)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # a reader that stopped early (range reads), as GCS allows
                    return
                insert = self.command == "POST" and self.path.split("?")[0].endswith("/instances")
                with (fake._in_flight(fake, "_inserts_now", "max_parallel_inserts",
                                      fake.insert_latency_s) if insert else nullcontext()):
                    status, payload = fake.handle(self.command, self.path, raw, self.headers)
                out = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> FakeCompute:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -------------------------------------------------------------- fault injection

    def exhaust(self, zone: str, style: str = "operation") -> None:
        assert style in ("operation", "http503", "http400")
        self.exhausted[zone] = style

    def quota(self, style: str = "http403") -> None:
        assert style in ("http403", "operation")
        self.quota_style = style

    def op_fail(self, code: str, status: int = 400, zone: str = "", times: int = 1) -> None:
        self.op_faults.append([code, status, zone, times])

    def fail(
        self, key: str, status: int, reason: str = "backendError", times: int = 1, message: str = ""
    ) -> None:
        self.faults.append(Fault(key, status, reason, times, message or f"injected {status}"))

    # -------------------------------------------------------------- queries for tests

    def calls(self, key: str) -> list[Recorded]:
        return [r for r in self.requests if r.key == key]

    # -------------------------------------------------------------- dispatch

    def handle(self, method: str, raw_path: str, raw_body: bytes,
               headers: Any = None) -> tuple[int, dict[str, Any]]:  # fmt: skip
        url = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        body = json.loads(raw_body) if raw_body else None
        found = next(
            ((key, mt) for m, key, rx in ROUTES if m == method and (mt := rx.match(url.path))),
            None,
        )
        if found is None:
            return 404, ApiError(404, "notFound", f"no route {method} {url.path}").body()
        key, match = found
        with self._lock:
            self.requests.append(Recorded(method, key, url.path, query, body))
            if self.compute_api_disabled:
                return 403, _service_disabled(match.group("project"))
            try:
                self._inject(key)
                caller = self._caller(headers)
                if caller is not None:
                    self.callers.append((key, caller))
                    try:
                        self.iam.check(caller, key, match.groupdict(), body)
                    except Refused as r:
                        self.refused.append((key, r.message))
                        raise ApiError(r.status, r.reason, r.message) from None
                    except ConditionError as c:
                        raise ApiError(500, "backendError", str(c)) from None
                handler = getattr(self, "_" + key.replace(".", "_"))
                return 200, handler(body=body, query=query, **match.groupdict())
            except ApiError as e:
                return e.status, e.body()

    def _caller(self, headers: Any) -> str | None:
        """The service account a bearer token was issued to; None (the project's owner)
        without one; a 401 for a token the fake did not issue, or whose account is gone."""
        auth = str((headers or {}).get("Authorization") or "")
        if not auth:
            return None
        kind, _, token = auth.partition(" ")
        email = self.storage.tokens.get(token) if kind.lower() == "bearer" else None
        if email is None or email not in self.storage.service_accounts:
            raise ApiError(401, "authError", "Request had invalid authentication credentials.")
        return email

    def project_of(self, email: str) -> str:
        """The project a service account belongs to."""
        return email.split("@", 1)[1].removesuffix(SA_DOMAIN) if "@" in email else ""

    def nic_subnetwork(self, region: str, nic: dict[str, Any], i: int) -> tuple[str, str]:
        """(region, name) of the subnetwork a NIC goes on: the one it names, or an
        auto-mode network's subnetwork in the VM's region; GCE's 400s for one that is
        not there, not in the VM's region, or not in the NIC's network."""
        network = str(nic.get("network") or "global/networks/default").rsplit("/", 1)[-1]
        url = str(nic.get("subnetwork") or "")
        field_ = f"resource.networkInterfaces[{i}].subnetwork"
        if not url:
            if network != "default":
                raise ApiError(400, "invalid", f"Invalid value for field '{field_}': ''. "
                               "A custom-mode network needs a subnetwork.")  # fmt: skip
            return region, "default"
        m = re.fullmatch(r"(?:.*/)?regions/([^/]+)/subnetworks/([^/]+)", url)
        if m is None or (m.group(2) != "default" and (m.group(1), m.group(2))
                         not in self.subnetworks):  # fmt: skip
            raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                           "The referenced subnetwork resource cannot be found.")
        if m.group(1) != region:
            raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                           f"Subnetwork must be in region {region}.")
        owner = self.subnetworks.get((m.group(1), m.group(2)), "default")
        if nic.get("network") and owner != network:
            raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                           f"The subnetwork is not in network {network}.")
        return m.group(1), m.group(2)

    def _inject(self, key: str) -> None:
        for f in self.faults:
            if f.key == key and f.times > 0:
                f.times -= 1
                raise ApiError(f.status, f.reason, f.message)

    # -------------------------------------------------------------- operations

    def _base(self, project: str) -> str:
        return f"{self.endpoint}/compute/v1/projects/{project}"

    def _new_op(
        self,
        project: str,
        zone: str | None,
        kind: str,
        target: str,
        on_done: Callable[[], None] | None = None,
        error: dict[str, Any] | None = None,
        http_status: int = 0,
    ) -> dict[str, Any]:
        n = next(self._ids)
        name = f"operation-{n}"
        region = kind.partition("@")[2]  # "insert@us-central1": a regional operation
        kind = kind.partition("@")[0]
        scope = f"zones/{zone}" if zone else f"regions/{region}" if region else "global"
        res: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(n),
            "name": name,
            "operationType": kind,
            "targetLink": target,
            "status": "PENDING",
            "progress": 0,
            "insertTime": time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime()),
            "selfLink": f"{self._base(project)}/{scope}/operations/{name}",
        }
        if zone:
            res["zone"] = f"{self._base(project)}/zones/{zone}"
        op = _Op(res, self.pending_polls, on_done)
        if error is not None:
            op.error = {"error": error, "httpErrorStatusCode": http_status}
        self.operations[name] = op
        if op.polls_left <= 0:
            self._finish(op)
        return dict(op.resource)

    def _finish(self, op: _Op) -> None:
        if op.resource["status"] == "DONE":
            return
        op.resource.update(status="DONE", progress=100)
        if op.error is not None:
            op.resource.update(op.error)
        elif op.on_done is not None:
            op.on_done()

    def _poll(self, name: str) -> dict[str, Any]:
        op = self.operations.get(name)
        if op is None:
            raise ApiError(404, "notFound", f"The resource 'operations/{name}' was not found")
        if op.resource["status"] != "DONE":
            op.polls_left -= 1
            op.resource["status"] = "RUNNING"
            if op.polls_left <= 0:
                self._finish(op)
        return dict(op.resource)

    def _zoneOperations_get(self, op: str, **_: Any) -> dict[str, Any]:
        return self._poll(op)

    _zoneOperations_wait = _zoneOperations_get

    def _globalOperations_get(self, op: str, **_: Any) -> dict[str, Any]:
        return self._poll(op)

    _globalOperations_wait = _globalOperations_get

    def _regionOperations_get(self, op: str, **_: Any) -> dict[str, Any]:
        return self._poll(op)

    _regionOperations_wait = _regionOperations_get

    # -------------------------------------------------------------- resource policies

    def _resourcePolicies_insert(
        self, project: str, region: str, body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        name = body["name"]
        target = f"{self._base(project)}/regions/{region}/resourcePolicies/{name}"
        if (region, name) in self.policies:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/regions/"
                           f"{region}/resourcePolicies/{name}' already exists")
        policy = dict(body, kind="compute#resourcePolicy", id=str(next(self._ids)),
                      region=f"{self._base(project)}/regions/{region}", selfLink=target,
                      status="READY")

        def create() -> None:
            self.policies[(region, name)] = policy

        return self._new_op(project, None, f"insert@{region}", target, create)

    def _resourcePolicies_get(self, project: str, region: str, name: str, **_: Any
                              ) -> dict[str, Any]:
        pol = self.policies.get((region, name))
        if pol is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}/regions/{region}/"
                           f"resourcePolicies/{name}' was not found")
        return pol

    def _resourcePolicies_getIamPolicy(self, project: str, region: str, name: str, **_: Any
                                       ) -> dict[str, Any]:
        self._resourcePolicies_get(project=project, region=region, name=name)
        return dict(self.policy_iam.get((region, name)) or {"etag": "BwX0", "version": 1})

    def _resourcePolicies_setIamPolicy(self, project: str, region: str, name: str,
                                       body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self._resourcePolicies_get(project=project, region=region, name=name)
        new = dict((body or {}).get("policy") or {})
        have = self.policy_iam.get((region, name)) or {"etag": "BwX0"}
        if new.get("etag") and new["etag"] != have.get("etag"):
            raise ApiError(412, "conditionNotMet", "etag mismatch")
        new["etag"] = f"BwX{int(have['etag'][3:] or 0) + 1}"
        self.policy_iam[(region, name)] = new
        return dict(new)

    def _resourcePolicies_list(self, project: str, region: str, **_: Any) -> dict[str, Any]:
        return {"kind": "compute#resourcePolicyList",
                "items": [p for (r, _n), p in sorted(self.policies.items()) if r == region]}

    def _resourcePolicies_delete(self, project: str, region: str, name: str, **_: Any
                                 ) -> dict[str, Any]:
        pol = self._resourcePolicies_get(project=project, region=region, name=name)
        users = [n for (_z, n), vm in self.instances.items()
                 if any(u.endswith(f"/regions/{region}/resourcePolicies/{name}")
                        for u in vm.get("resourcePolicies") or [])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource",
                           f"The resource_policy resource '{pol['selfLink']}' is already being "
                           f"used by '{users[0]}'")

        def gone() -> None:
            self.policies.pop((region, name), None)

        return self._new_op(project, None, f"delete@{region}", pol["selfLink"], gone)

    def _validate_policies(self, zone: str, machine: str, body: dict[str, Any]) -> None:
        """A VM's resource policies: they exist in its region; a compact one takes only
        its families, VMs that terminate on host maintenance, and one zone's VMs."""
        region = zone.rsplit("-", 1)[0]
        for i, url in enumerate(body.get("resourcePolicies") or []):
            m = re.fullmatch(r"(?:.*/)?projects/[^/]+/regions/([^/]+)/resourcePolicies/([^/]+)",
                             url)
            field_ = f"resource.resourcePolicies[{i}]"
            if m is None or (m.group(1), m.group(2)) not in self.policies:
                raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                               "The resource was not found.")
            if m.group(1) != region:
                raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                               f"Resource policy must be in the instance's region {region}.")
            pol = self.policies[(m.group(1), m.group(2))]
            if (pol.get("groupPlacementPolicy") or {}).get("collocation") != "COLLOCATED":
                continue
            if not machine.startswith(COMPACT_OK):
                raise ApiError(400, "invalid", f"Compact placement policies are not supported "
                               f"for machine type {machine}.")
            if (body.get("scheduling") or {}).get("onHostMaintenance") != "TERMINATE":
                raise ApiError(400, "invalid", "Compact placement policies require "
                               "scheduling.onHostMaintenance TERMINATE.")
            others = {z for (z, _n), vm in self.instances.items()
                      if any(u.endswith(f"/resourcePolicies/{m.group(2)}")
                             for u in vm.get("resourcePolicies") or [])}
            if others - {zone}:
                raise ApiError(400, "invalid", f"Invalid value for field '{field_}': '{url}'. "
                               f"The placement policy's instances are in zone "
                               f"{sorted(others)[0]}; an instance in {zone} cannot join it.")

    # -------------------------------------------------------------- instances

    def _instances_insert(
        self, project: str, zone: str, body: dict[str, Any], query: dict[str, str], **_: Any
    ) -> dict[str, Any]:
        rid = query.get("requestId", "")
        if rid and rid in self._by_request_id:
            return dict(self.operations[self._by_request_id[rid]].resource)
        name = body["name"]
        target = f"{self._base(project)}/zones/{zone}/instances/{name}"
        if (zone, name) in self.instances:
            raise ApiError(
                409,
                "alreadyExists",
                f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists",
            )
        self._validate_instance(project, zone, body)
        exhausted = self.exhausted.get(zone)
        pool_msg = (
            f"The zone 'projects/{project}/zones/{zone}' does not have enough resources "
            "available to fulfill the request.  Try a different zone, or try again later."
        )
        if exhausted == "http503":
            raise ApiError(503, "ZONE_RESOURCE_POOL_EXHAUSTED", pool_msg)
        if exhausted == "http400":
            raise ApiError(400, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", pool_msg)
        quota_msg = "Quota 'GPUS_ALL_REGIONS' exceeded.  Limit: 0.0 globally."
        if self.quota_style == "http403":
            raise ApiError(403, "quotaExceeded", quota_msg, domain="usageLimits")
        error: dict[str, Any] | None = None
        status = 0
        if exhausted == "operation":
            error = {
                "errors": [
                    {"code": "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "message": pool_msg}
                ]
            }
            status = 503
        elif self.quota_style == "operation":
            error = {"errors": [{"code": "QUOTA_EXCEEDED", "message": quota_msg}]}
            status = 403
        elif self._over_address_quota(zone, body):
            region = zone.rsplit("-", 1)[0]
            limit = self.address_quota[region]
            error = {
                "errors": [
                    {
                        "code": "QUOTA_EXCEEDED",
                        "message": f"Quota 'IN_USE_ADDRESSES' exceeded.  Limit: {limit:.1f} "
                        f"in region {region}.",
                    }
                ]
            }
            status = 403
        elif self.gpu_quota and (over := self._over_gpu_quota(zone, body)):
            error = {"errors": [{"code": "QUOTA_EXCEEDED", "message": over}]}
            status = 403
        else:
            for f in self.op_faults:
                if f[3] > 0 and f[2] in ("", zone):
                    f[3] -= 1
                    error = {"errors": [{"code": f[0], "message": f"injected {f[0]} in {zone}"}]}
                    status = f[1]
                    break
        n = next(self._ids)
        vm = dict(body)
        vm.update(
            kind="compute#instance",
            id=str(n),
            zone=f"{self._base(project)}/zones/{zone}",
            selfLink=target,
            status="PROVISIONING",
            creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%S.000-07:00", time.localtime()),
            machineType=f"{self._base(project)}/{body['machineType']}",
        )
        nics = [dict(nic) for nic in vm.get("networkInterfaces") or [{}]]
        nics[0]["networkIP"] = f"10.128.{n // 250 % 250}.{n % 250 + 2}"
        for ac in nics[0].get("accessConfigs") or []:
            ac["natIP"] = f"198.51.{n // 250 % 250}.{n % 250 + 2}"
        vm["networkInterfaces"] = nics

        def create() -> None:
            vm["status"] = "RUNNING"

        if error is None:
            # The VM is visible (PROVISIONING) while its insert operation runs, as in GCP.
            self.instances[(zone, name)] = vm
            if self.gpu_quota:
                for metric, count in self._gpu_metrics(body):
                    self.quota_usage[metric] = self.quota_usage.get(metric, 0.0) + count
        op = self._new_op(project, zone, "insert", target, create, error, status)
        if rid:
            self._by_request_id[rid] = op["name"]
        return op

    def _image(self, url: str) -> tuple[str, int, tuple[str, ...]]:
        """(self link, minimum disk GB, guestOsFeatures) of an image or family URL."""
        m = re.fullmatch(r"(?:.*/)?projects/([^/]+)/global/images/(family/)?([^/]+)", url or "")
        if m is None:
            raise ApiError(400, "invalid", f"Invalid value for field 'sourceImage': {url!r}")
        project, family, name = m.group(1), m.group(2), m.group(3)
        for (proj, fam), (image, size, features) in IMAGES.items():
            if proj == project and (fam == name if family else image == name):
                return f"{self._base(proj)}/global/images/{image}", size, features
        raise ApiError(404, "notFound", f"The resource '{url}' was not found")

    def _validate_instance(self, project: str, zone: str, body: dict[str, Any]) -> None:
        """Refuse, with GCP's 400s, what GCP refuses: boot disk smaller than the image,
        a disk type or NIC the machine family does not take."""
        machine = body["machineType"].rsplit("/", 1)[-1]
        boot_features: tuple[str, ...] = ()
        for i, disk in enumerate(body.get("disks") or []):
            params = disk.get("initializeParams") or {}
            if not params:
                continue
            _, minimum, features = self._image(params.get("sourceImage", ""))
            if disk.get("boot"):
                boot_features = features
            size = int(params.get("diskSizeGb") or minimum)
            if size < minimum:
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.disks[{i}].initializeParams.diskSizeGb':"
                    f" '{size}'. Requested disk size cannot be smaller than the image size "
                    f"({minimum} GB)",
                )
            kind = str(params.get("diskType") or "pd-standard").rsplit("/", 1)[-1]
            if (kind == "pd-standard" and machine.startswith(NO_PD_STANDARD)) or (
                not kind.startswith("hyperdisk") and machine.startswith(HYPERDISK_ONLY)
            ) or (kind.startswith("hyperdisk") and machine.startswith(NO_HYPERDISK)):
                raise ApiError(
                    400,
                    "invalid",
                    f"[{kind}] features are not compatible for creating instance "
                    f"of machine type {machine}.",
                )
        for i, sa in enumerate(body.get("serviceAccounts") or []):
            email = str(sa.get("email", ""))
            if email not in self.storage.service_accounts:
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.serviceAccounts[{i}].email': "
                    f"'{email}'. The user does not have access to service account '{email}'.",
                )
        self._validate_policies(zone, machine, body)
        for i, nic in enumerate(body.get("networkInterfaces") or []):
            if nic.get("nicType") == "GVNIC" and boot_features and "GVNIC" not in boot_features:
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.networkInterfaces[{i}].nicType': "
                    "'GVNIC'. The selected image does not support the gVNIC network interface.",
                )
            if machine.startswith(GVNIC_REQUIRED) and nic.get("nicType") != "GVNIC":
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.networkInterfaces[{i}].nicType': "
                    f"'{nic.get('nicType', '')}'. {machine} requires gVNIC.",
                )

    def _gpu_metrics(self, body: dict[str, Any]) -> list[tuple[str, float]]:
        """(quota metric, GPUs) the VM counts against: a Spot VM's preemptible metric
        where its limit is above 0, else the standard one."""
        spot = (body.get("scheduling") or {}).get("provisioningModel") == "SPOT"
        out = []
        for acc in body.get("guestAccelerators") or []:
            metric = GPU_METRICS.get(str(acc.get("acceleratorType", "")).rsplit("/", 1)[-1])
            if not metric:
                continue
            if spot and self.region_quotas.get(f"PREEMPTIBLE_{metric}", 0.0) > 0:
                metric = f"PREEMPTIBLE_{metric}"
            out.append((metric, float(acc.get("acceleratorCount", 0))))
        return out

    def _over_gpu_quota(self, zone: str, body: dict[str, Any]) -> str:
        region = zone.rsplit("-", 1)[0]
        for metric, count in self._gpu_metrics(body):
            limit = self.region_quotas.get(metric, 0.0)
            if self.quota_usage.get(metric, 0.0) + count > limit:
                return f"Quota '{metric}' exceeded.  Limit: {limit:.1f} in region {region}."
        return ""

    def _over_address_quota(self, zone: str, body: dict[str, Any]) -> bool:
        region = zone.rsplit("-", 1)[0]
        limit = self.address_quota.get(region)
        if limit is None:
            return False
        wants = sum(len(n.get("accessConfigs") or []) for n in body.get("networkInterfaces") or [])
        in_use = sum(
            len(n.get("accessConfigs") or [])
            for (z, _name), vm in self.instances.items()
            if z.rsplit("-", 1)[0] == region
            for n in vm.get("networkInterfaces") or []
        )
        return in_use + wants > limit

    def _instances_getGuestAttributes(
        self, project: str, zone: str, name: str, query: dict[str, str], **_: Any
    ) -> dict[str, Any]:
        vm = self.instances.get((zone, name))
        path = query.get("queryPath", "")
        keys = self.guest_host_keys.get((zone, name))
        meta = {i["key"]: i["value"] for i in (vm or {}).get("metadata", {}).get("items", [])}
        # GCP answers 404 until the agent published the path; and only with the metadata on.
        if (
            vm is None
            or not keys
            or path != "hostkeys/"
            or (meta.get("enable-guest-attributes") != "TRUE")
        ):
            raise ApiError(404, "notFound", f"The resource 'guestAttributes/{path}' was not found")
        items = [{"namespace": "hostkeys", "key": k, "value": v} for k, v in keys.items()]
        return {"kind": "compute#guestAttributes", "queryPath": path,
                "queryValue": {"items": items}}  # fmt: skip

    def _regions_get(self, project: str, region: str, **_: Any) -> dict[str, Any]:
        if not re.fullmatch(r"[a-z]+-[a-z]+\d", region):
            raise ApiError(404, "notFound", f"The resource 'projects/{project}/regions/{region}' "
                           "was not found")  # fmt: skip
        return {
            "kind": "compute#region",
            "name": region,
            "status": "UP",
            "zones": [f"{self._base(project)}/zones/{region}-{z}" for z in "abcf"],
            "quotas": [
                {"metric": m, "limit": v, "usage": self.quota_usage.get(m, 0.0)}
                for m, v in self.region_quotas.items()
            ],
        }

    def _projects_get(self, project: str, **_: Any) -> dict[str, Any]:
        return {
            "kind": "compute#project",
            "name": project,
            "quotas": [
                {"metric": m, "limit": v, "usage": self.quota_usage.get(m, 0.0)}
                for m, v in self.project_quotas.items()
            ],
        }

    def _networks_get(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        if name not in self.networks:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}/global/networks/"
                           f"{name}' was not found")  # fmt: skip
        return {"kind": "compute#network", "name": name,
                "selfLink": f"{self._base(project)}/global/networks/{name}"}  # fmt: skip

    def _subnetworks_get(self, project: str, region: str, name: str, **_: Any
                         ) -> dict[str, Any]:  # fmt: skip
        if name != "default" and (region, name) not in self.subnetworks:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}/regions/{region}/"
                           f"subnetworks/{name}' was not found")  # fmt: skip
        network = self.subnetworks.get((region, name), "default")
        return {"kind": "compute#subnetwork", "name": name,
                "network": f"{self._base(project)}/global/networks/{network}",
                "region": f"{self._base(project)}/regions/{region}",
                "selfLink": f"{self._base(project)}/regions/{region}/subnetworks/{name}"}

    def _subnetworks_getIamPolicy(self, project: str, region: str, name: str, **_: Any
                                  ) -> dict[str, Any]:  # fmt: skip
        self._subnetworks_get(project=project, region=region, name=name)
        return dict(self.subnet_iam.get((region, name)) or {"etag": "BwX0", "version": 1})

    def _subnetworks_setIamPolicy(self, project: str, region: str, name: str,
                                  body: dict[str, Any], **_: Any) -> dict[str, Any]:  # fmt: skip
        """setIamPolicy as IAM checks it: the etag, roles/..., accounts that exist."""
        self._subnetworks_get(project=project, region=region, name=name)
        new = dict((body or {}).get("policy") or {})
        have = self.subnet_iam.get((region, name)) or {"etag": "BwX0"}
        if new.get("etag") and new["etag"] != have.get("etag"):
            raise ApiError(412, "conditionNotMet", "etag mismatch")
        for b in new.get("bindings") or []:
            if not str(b.get("role", "")).startswith("roles/"):
                raise ApiError(400, "badRequest", f"Role {b.get('role')!r} is not a valid role.")
            for m in b.get("members") or []:
                who = str(m).partition(":")[2]
                if who.endswith(SA_DOMAIN) and who not in self.storage.service_accounts:
                    raise ApiError(400, "badRequest", f"Service account {who} does not exist.")
        new["etag"] = f"BwX{int(have['etag'][3:] or 0) + 1}"
        self.subnet_iam[(region, name)] = new
        return dict(new)

    def _images_getFromFamily(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        link, size, features = self._image(f"projects/{project}/global/images/family/{name}")
        return self._image_resource(link, size, name, features)

    def _images_get(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        link, size, features = self._image(f"projects/{project}/global/images/{name}")
        return self._image_resource(link, size, "", features)

    def _image_resource(self, link: str, size: int, family: str,
                        features: tuple[str, ...]) -> dict[str, Any]:
        return {
            "kind": "compute#image",
            "name": link.rsplit("/", 1)[-1],
            "selfLink": link,
            "diskSizeGb": str(size),
            "family": family,
            "status": "READY",
            "guestOsFeatures": [{"type": t} for t in features],
        }

    def _instances_get(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        vm = self.instances.get((zone, name))
        if vm is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found",
            )
        return vm

    def _instances_list(
        self, project: str, zone: str, query: dict[str, str], **_: Any
    ) -> dict[str, Any]:
        keep = parse_filter(query.get("filter", ""))
        items = [vm for (z, _n), vm in sorted(self.instances.items()) if z == zone and keep(vm)]
        out: dict[str, Any] = {
            "kind": "compute#instanceList",
            "id": f"projects/{project}/zones/{zone}/instances",
        }
        if items:
            out["items"] = items
        return out

    def _instances_aggregatedList(
        self, project: str, query: dict[str, str], **_: Any
    ) -> dict[str, Any]:
        keep = parse_filter(query.get("filter", ""))
        items: dict[str, Any] = {}
        for (zone, _name), vm in sorted(self.instances.items()):
            if keep(vm):
                items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(vm)
        # The real API lists every zone; empty ones carry a warning instead of instances.
        items.setdefault(
            "zones/us-east1-b",
            {
                "warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": "There are no results for scope 'zones/us-east1-b' on this page.",
                }
            },
        )
        return {
            "kind": "compute#instanceAggregatedList",
            "id": f"projects/{project}/aggregated/instances",
            "items": items,
        }

    def _instances_delete(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        vm = self._instances_get(project=project, zone=zone, name=name)
        vm["status"] = "STOPPING"

        def gone() -> None:
            self.instances.pop((zone, name), None)

        return self._new_op(project, zone, "delete", vm["selfLink"], gone)

    # -------------------------------------------------------------- firewalls

    def _firewalls_insert(self, project: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        name = body["name"]
        if name in self.firewalls:
            raise ApiError(
                409,
                "alreadyExists",
                f"The resource 'projects/{project}/global/firewalls/{name}' already exists",
            )
        # Firewall resource: targetServiceAccounts and sourceServiceAccounts cannot be
        # used with targetTags or sourceTags (Compute API reference, Firewall)
        if (body.get("targetServiceAccounts") or body.get("sourceServiceAccounts")) and (
                body.get("targetTags") or body.get("sourceTags")):  # fmt: skip
            raise ApiError(400, "invalid", "Invalid value for field 'resource': service "
                           "accounts and tags cannot be used in the same firewall rule.")
        target = f"{self._base(project)}/global/firewalls/{name}"
        rule = dict(body, kind="compute#firewall", id=str(next(self._ids)), selfLink=target)

        def create() -> None:
            self.firewalls[name] = rule

        return self._new_op(project, None, "insert", target, create)

    def _firewalls_list(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        keep = parse_filter(query.get("filter", ""))
        items = [fw for _n, fw in sorted(self.firewalls.items()) if keep(fw)]
        out: dict[str, Any] = {
            "kind": "compute#firewallList",
            "id": f"projects/{project}/global/firewalls",
        }
        if items:
            out["items"] = items
        return out

    def _firewalls_delete(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        if name not in self.firewalls:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{project}/global/firewalls/{name}' was not found",
            )
        target = self.firewalls[name]["selfLink"]
        return self._new_op(project, None, "delete", target, lambda: self.firewalls.pop(name, None))
