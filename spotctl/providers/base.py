"""The provider protocol every cloud (and the local emulation) implements.

Assumptions, stated once (after Ray's ICloudInstanceProvider):
- `list` is eventually consistent; the reconciler tolerates a just-launched instance
  missing from it for a while, and the request id makes a retried launch harmless.
- `launch` is idempotent by `request_id`: calling it again with the same id returns the
  instances of the first call instead of creating more.
- Every instance is tagged/labelled with cluster, role and request id at creation, so a
  crash between launch and journaling leaks nothing that `list` cannot find.
- `terminate` of a gone instance is a no-op.
- Providers never print or exit: they return data or raise spotctl.errors.ProviderError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from spotctl.spec import ClusterSpec
    from spotctl.state import ClusterDir


@dataclass(frozen=True)
class Offer:
    """One way to buy capacity: an instance type in a zone at a price."""

    provider: str  # "local" | "aws" | "gcp" | "ssh"
    region: str  # e.g. "us-east-1"; "local" for the local provider
    zone: str  # e.g. "us-east-1a"
    instance_type: str  # e.g. "g5.xlarge", "a2-highgpu-1g", "local"
    gpus: int  # GPUs per instance
    gpu_name: str  # e.g. "A10G", "A100", "cpu"
    spot_price: float  # USD per instance-hour, spot
    on_demand_price: float | None = None  # USD per instance-hour, None when unknown
    interruption_band: int | None = None  # Spot Advisor bucket 0 (<5%) .. 4 (>20%)
    gpu_memory_gib: float = 0.0  # per GPU
    # Instances purchasable now (e.g. a local capacity schedule); None when unknown.
    available: int | None = None
    # Where in the zone a launch goes, for providers that place nodes in groups (AWS EFA
    # types: "group-1" the cluster's placement group, "group-2" a second one, "none");
    # "" where the provider does not say. `placements` lists the choices in order of
    # preference on an offer as the provider lists it; the planner turns it into one
    # offer per choice (planner.with_placements) and falls back along it after capacity
    # errors, as it backs off from a zone (`slot` is what the back-off is keyed by).
    placement: str = ""
    placements: tuple[str, ...] = ()

    @property
    def price_per_gpu_hour(self) -> float:
        return self.spot_price / self.gpus if self.gpus else float("inf")

    @property
    def slot(self) -> str:
        """The zone, or zone/placement: what capacity errors and back-offs are kept by."""
        return f"{self.zone}/{self.placement}" if self.placement else self.zone

    @property
    def savings_pct(self) -> float | None:
        if not self.on_demand_price:
            return None
        return 100.0 * (1.0 - self.spot_price / self.on_demand_price)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.placements and not self.placement:  # a provider without placements
            del d["placement"], d["placements"]
        d["price_per_gpu_hour"] = round(self.price_per_gpu_hour, 6)
        d["savings_pct"] = None if self.savings_pct is None else round(self.savings_pct, 2)
        return d


@dataclass
class Instance:
    """One VM (or local process tree) that belongs to a cluster."""

    id: str  # provider's id, e.g. "i-0abc", "spotctl-demo-w-1a2b", "local-3"
    cluster: str  # cluster name (from the tag/label)
    role: str  # "worker" or "head"
    zone: str
    instance_type: str
    gpus: int
    state: str  # "pending" | "running" | "stopping" | "gone"
    request_id: str  # the launch request that created it (idempotency key)
    price: float = 0.0  # USD/h it was launched at
    on_demand_price: float = 0.0  # USD/h the same capacity costs on demand
    launched_at: float = 0.0  # unix time
    address: str = ""  # address the head and peers reach it at
    public_address: str = ""  # address the controller reaches it at over SSH
    spot: bool = True
    ssh_port: int = 22
    ssh_user: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # provider-specific extras


@dataclass
class HeadInfo:
    """Where the head listens. `url` is the coordinator API, the store hosts rendezvous."""

    url: str  # e.g. "http://127.0.0.1:40123"
    store_host: str
    store_port: int
    instance_id: str = ""  # cloud instance id of the head VM, "" for a local process
    public_url: str = ""  # URL the controller uses when it can reach the head directly
    # SSH forward the controller opens to reach the API when the port is closed to the
    # outside (clouds): address, port, user, key_file, remote_port. Empty: use the URLs.
    tunnel: dict[str, Any] = field(default_factory=dict)
    # torchft's Lighthouse on the head, as the nodes reach it (e.g. http://10.0.0.5:29510);
    # "" when the cluster's engine is torchrun (no Lighthouse runs).
    lighthouse: str = ""


@dataclass
class ProviderContext:
    """Everything a provider needs about the cluster it works for."""

    cluster: str
    spec: ClusterSpec
    cluster_dir: ClusterDir
    # Extra knobs for tests (endpoint URLs, ssh seams); never set by users.
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.cluster_dir.path


@runtime_checkable
class Provider(Protocol):
    name: str

    def offers(self) -> list[Offer]:
        """Purchasable capacity now, cheapest first is not required."""

    def launch(self, offer: Offer, count: int, request_id: str) -> list[Instance]:
        """Start `count` worker instances of `offer`, tagged with the request id."""

    def list(self, cluster: str) -> list[Instance]:
        """Every live instance (any role) tagged with this cluster."""

    def terminate(self, ids: Sequence[str]) -> None:
        """Terminate these instances; ids already gone are ignored."""


class ClusterResources(Protocol):
    """Optional provider extras: per-cluster resources and the head.

    A provider that owns resources besides instances (security group, key pair, head VM)
    implements these; the reconciler calls them when present.
    """

    def prepare(self) -> None:
        """Create what the cluster needs before its first launch (idempotent)."""

    def ensure_head(self) -> HeadInfo:
        """Start the head if it is not running (idempotent) and say where it is."""

    def cleanup(self) -> list[str]:
        """Remove everything the cluster created; return descriptions of what leaked.

        Checkpoints stay. A provider that owns the cluster's checkpoint storage (a bucket
        prefix) also has `purge_checkpoints() -> int` (delete the objects under the prefix,
        return how many), which `down --purge` calls after `cleanup`."""


class ClusterCheckpoints:
    """`prepare_storage` for cloud providers whose nodes checkpoint to a per-cluster
    object-store prefix: the bucket and the nodes' identity first (idempotent), then that
    prefix becomes the default train.checkpoint_dir. Under the loopback test seam the
    "VMs" are local processes with no cloud identity to reach the store with: they keep
    the cluster dir's default."""

    ctx: ProviderContext
    _nodes: Any
    _storage_ready = False

    def _ensure_bucket(self) -> None:
        raise NotImplementedError

    def _ensure_node_identity(self) -> None:
        raise NotImplementedError

    def checkpoint_uri(self) -> str:
        raise NotImplementedError

    def prepare_storage(self) -> None:
        if self._storage_ready:
            return
        self._ensure_bucket()
        self._ensure_node_identity()
        if not self.ctx.spec.train.checkpoint_dir and self._nodes.override is None:
            self.ctx.spec.train.checkpoint_dir = self.checkpoint_uri()
        self._storage_ready = True


class Teardown:
    """What a provider's cleanup could not remove, one line each. Every step runs even
    when one before it failed (an unexpected error deleting the VMs must not leave the
    firewall, keys and identity behind): a step's error becomes a line, and the step's
    `default` stands in for its result."""

    def __init__(self) -> None:
        self.leaks: list[str] = []

    def step(self, what: str, fn: Any, default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported as a leak; the later steps still run
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.leaks.append(f"{what}: {first[:300]}")
            return default


def start_new_head(start: Any, head_id: str, terminate: Any, created: bool) -> HeadInfo:
    """`start()` makes the head VM a head (over SSH). A VM this `up` just created whose
    start fails is terminated at once, so a failed `up` leaves no head billing until
    `down`; a head that was already running is left as it is (the cluster may still use
    it). The error names what became of the VM."""
    from spotctl.errors import BootstrapError

    try:
        info: HeadInfo = start()
        return info
    except BootstrapError as e:
        if not created:
            raise
        td = Teardown()
        td.step(f"terminate head {head_id}", lambda: terminate([head_id]))
        fate = (f"the head VM {head_id} was terminated" if not td.leaks else
                f"{td.leaks[0]}; `spotctl down` removes it")
        raise BootstrapError(f"{e}; {fate}") from e
