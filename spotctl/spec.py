"""The cluster spec: `spotctl.toml`, validated by pydantic, with CLI flags layered on top.

Every validation failure becomes one SpecError line that names the field, e.g.
`spotctl.toml: gpus: range 8..4 is inverted (MIN must be <= MAX)`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from spotctl.errors import SpecError
from spotctl.sockets import is_loopback

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (e.g. the AWS Deep Learning AMI's): the same parser, from PyPI
    import tomli as tomllib

PROVIDERS = ("local", "aws", "gcp", "ssh")
Engine = Literal["torchrun", "torchft"]  # [train] engine
ENGINES: tuple[str, ...] = get_args(Engine)
Sync = Literal["ddp", "diloco", "localsgd"]  # [train] sync
OnNotice = Literal["auto", "next_sync", "drop"]  # [train] on_notice
DEFAULT_ENGINE: Engine = "torchft"  # the spec's, `spotctl init`'s and `scripts/chaos`'s
SPEC_FILE = "spotctl.toml"
_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,38}[a-z0-9]|[a-z]")  # fullmatch: no trailing \n
_URI_RE = re.compile(r"[a-z][a-z0-9+.-]*://", re.ASCII)  # match: an object-store URI
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_WORKER_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # a portable user name (useradd's)
# a host name or an IP address; never starts with '-' (ssh would read it as an option)
_HOST_RE = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9._:\[\]-]{0,252}")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
MAX_GPUS = 10_000  # the most GPUs any spec may ask for (the head's bound on a world size)
MAX_STEPS = 10**12  # train.max_steps (a trillion steps: beyond any run, inside a float's ints)
MAX_TEXT = 4096  # any string in a spec (a path, an argument...); env values excepted
MAX_ZONE = 64  # a zone's name (clouds' are under 30 characters)
MAX_ZONES = 256


def _check_zones(v: list[str]) -> list[str]:
    if len(v) > MAX_ZONES:
        raise ValueError(f"at most {MAX_ZONES} zones (got {len(v)})")
    for i, z in enumerate(v):
        if not z or len(z) > MAX_ZONE:
            raise ValueError(f"zone {i}: a zone name is 1 to {MAX_ZONE} characters "
                             f"(got {len(z)})")
    return v


def _check_ssh_cidr(v: str, where: str) -> str:
    """An address or CIDR, never one that opens SSH to every address of the internet."""
    import ipaddress

    if not v:
        return v
    try:
        net = ipaddress.ip_network(v, strict=False)
    except ValueError:
        raise ValueError(f"{v[:60]!r} is not an IP address or CIDR") from None
    if net.prefixlen == 0:
        raise ValueError(
            f"{v!r} opens SSH to the whole internet; refused. Leave it empty (the address "
            f"spotctl runs from) or name your network, e.g. {where} = \"203.0.113.0/24\"")
    return v


def _no_control(v: Any, where: str) -> None:
    """Strings that reach shell scripts, systemd units or crontabs hold no control
    characters (a newline there starts a new line of the unit or the crontab)."""
    vals = v if isinstance(v, list) else [v]
    for x in vals:
        if isinstance(x, str) and any(ord(c) < 32 or ord(c) == 127 for c in x):
            raise ValueError(f"{where} must not contain control characters (newline, tab...)")


class GpuRange(BaseModel):
    """Total GPUs the job may use: start with at least `min`, grow toward `max`."""

    model_config = ConfigDict(frozen=True)
    min: int
    max: int

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}..{self.max}"


def parse_gpu_range(text: str | int) -> GpuRange:
    """Parse `MIN..MAX` or `N`. Raises ValueError with a sentence saying what is wrong."""
    if isinstance(text, bool):
        raise ValueError(f"expected MIN..MAX or N, got {text!r}")
    if isinstance(text, int):
        lo = hi = text
    else:
        s = str(text).strip()
        # ASCII digits only: int() would read other scripts' digits (e.g. '٣' as 3)
        m = re.fullmatch(r"([0-9]+)\s*\.\.\s*([0-9]+)", s, re.ASCII)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
        elif re.fullmatch(r"[0-9]+", s, re.ASCII):
            lo = hi = int(s)
        else:
            raise ValueError(f"expected MIN..MAX or N (e.g. 8..64), got {s!r}")
    if lo <= 0 or hi <= 0:
        raise ValueError(f"range {lo}..{hi} must be positive (at least 1 GPU)")
    if lo > hi:
        raise ValueError(f"range {lo}..{hi} is inverted (MIN must be <= MAX)")
    if hi > MAX_GPUS:
        raise ValueError(f"range {lo}..{hi} is larger than {MAX_GPUS} GPUs")
    return GpuRange(min=lo, max=hi)


class _Strict(BaseModel):
    # inf and nan are never a meaningful price, time or count
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _printable(cls, v: Any, info: Any) -> Any:
        if info.field_name != "env":
            _no_control(v, info.field_name)
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, str) and len(x) > MAX_TEXT:
                    raise ValueError(f"at most {MAX_TEXT} characters (got {len(x)})")
        return v


class _Zoned(_Strict):
    """A provider section with zones (and, on clouds, an SSH CIDR): checked alike."""

    @field_validator("zones", check_fields=False)
    @classmethod
    def _zones(cls, v: list[str]) -> list[str]:
        return _check_zones(v)

    @field_validator("ssh_cidr", check_fields=False)
    @classmethod
    def _ssh_cidr(cls, v: str) -> str:
        return _check_ssh_cidr(v, "ssh_cidr")


class TrainSpec(_Strict):
    # The training script (a .py file importing spotctl.elastic), relative to the spec's
    # folder; the local and ssh providers check it exists before anything starts.
    script: str = "train.py"
    args: list[str] = Field(default_factory=list)  # the script's command-line arguments
    # Where every node reads and writes checkpoints: a path (local: the cluster directory),
    # an object-store URI (s3://bucket/prefix, gs://bucket/prefix), or on clouds a path
    # under `shared_mount`, a filesystem the spec declares mounted on every node.
    checkpoint_dir: str = ""
    # A filesystem mounted at this path on every node (clouds, ssh hosts): checkpoint_dir
    # may then be a path under it.
    shared_mount: str = ""
    checkpoint_every: int = Field(default=20, ge=1, le=1_000_000)  # steps between saves
    # Seconds between saves as well (whichever comes first); 0 = by steps only. Every rank
    # saves at the same step: rank 0's clock decides, through the per-step agreement.
    checkpoint_every_s: float = Field(default=0.0, ge=0, le=604_800, allow_inf_nan=False)
    keep_last: int = Field(default=3, ge=1, le=1000)  # committed checkpoints kept
    # Threads that write each rank's share of a checkpoint, each to a file of its own (on
    # an object store, each its own upload). 0 = by size on an object store (one per
    # 256 MiB of the share, up to 4), 1 on a path.
    checkpoint_writers: int = Field(default=0, ge=0, le=64)
    # The job ends after this many steps (the script sees it as SPOTCTL_MAX_STEPS);
    # 0 = it runs until stopped.
    max_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    # Per-node interpreter; empty means the controller's own (local and ssh providers).
    python: str = ""
    # Where a node image keeps its own torch environment (AWS Deep Learning AMI, GCP Deep
    # Learning VM): when spotctl ships itself to a node, these interpreters are asked
    # first (then the base python, then the python3 a login shell finds, unless this list
    # is empty), and one with torch 2.9 or newer (and a Python the shipped wheels fit)
    # builds the venv.
    torch_envs: list[str] = Field(
        default_factory=lambda: ["/opt/pytorch/bin/python3", "/opt/conda/bin/python3"],
        max_length=16)
    env: dict[str, str] = Field(default_factory=dict)  # extra environment of the workers
    # The distributed engine. torchft (the default): each node (or nodes_per_replica
    # nodes) is a replica group under its own torchrun, joined by the head's torchft Lighthouse; notices are graceful leaves,
    # joiners recover from a live peer, survivors never restart (torchft is in the 'train'
    # and 'ft' extras). torchrun: every rescale restarts the workers from the last
    # committed checkpoint (one rendezvous on the head). The script is the same for both.
    engine: Engine = DEFAULT_ENGINE
    # On torchft, the nodes that make one replica group (one torchrun across them, DDP or
    # FSDP2 inside it), e.g. 4 for a model that needs 4 one-GPU nodes together. A notice
    # on any of them takes its whole group out of the quorum after the step in flight;
    # the others wait for a replacement, and the group then heals from a live one. Make
    # gpus.min and gpus.max whole groups: the nodes of a group not yet full wait.
    nodes_per_replica: int = Field(default=1, ge=1, le=64)
    # How replica groups combine their training (torchft engine only). "ddp": every step's
    # gradients are averaged across all groups (one model, one global batch). "diloco":
    # each group trains on its own for `sync_every` steps, then the groups average their
    # progress and an outer Nesterov SGD (`outer_lr`, `outer_momentum`) applies it;
    # "localsgd": the same with plain parameter averaging. For groups in different zones
    # or regions (docs/guides/diloco.md); the math differs from "ddp".
    sync: Sync = "ddp"
    # diloco/localsgd: local steps between two syncs of the replica groups (H).
    sync_every: int = Field(default=100, ge=1, le=1_000_000)
    # diloco: the outer optimizer's learning rate (1.0 with outer_momentum 0 is localsgd).
    outer_lr: float = Field(default=0.7, gt=0, le=100, allow_inf_nan=False)
    # diloco: the outer optimizer's Nesterov momentum (0 = none).
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)
    # diloco/localsgd: what a group with a notice does in the middle of a round.
    # "next_sync": trains to the round's end, syncs, then leaves (nothing lost, if the
    # notice's lead covers it); "drop": leaves now, its local steps since the last sync
    # dropped (the others' sync of that round fails and they train it again without it);
    # "auto": next_sync when the lead covers twice the time to the sync plus 5 s, else drop.
    on_notice: OnNotice = "auto"
    # On cloud nodes, where the bootstrap has root, training workers run as this
    # unprivileged user (created if missing) and cannot read the node's credential;
    # "" = they run as the agent's user. Local nodes always run as you.
    run_as: str = "spotctl-train"
    # On a GPU instance type, how long a node's agent waits for the NVIDIA driver to answer
    # and torch to see the type's GPUs before it gives up and the node is replaced.
    gpu_wait_s: float = Field(default=300.0, ge=0, le=3600)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, x in v.items():
            if not _ENV_KEY_RE.fullmatch(k):
                raise ValueError(f"{k!r} is not an environment variable name "
                                 "(letters, digits and '_', not starting with a digit)")
            if "\0" in x:
                raise ValueError(f"{k}: a value must not contain NUL")
        grace = v.get("SPOTCTL_NOTICE_GRACE_S")
        if grace is not None:
            # a plain torchrun script's time between its notice file and SIGTERM (the
            # agent's MAX_NOTICE_GRACE_S is the bound)
            try:
                ok = 0 <= float(grace) <= 120
            except ValueError:
                ok = False
            if not ok:
                raise ValueError("SPOTCTL_NOTICE_GRACE_S must be a number of seconds within "
                                 f"0..120, not {grace[:20]!r}")
        return v

    def worker_env(self) -> dict[str, str]:
        """The workers' environment from this section: `env`, and the sync settings
        spotctl.elastic reads (SPOTCTL_SYNC...) when they are not the default."""
        out = dict(self.env)
        if self.sync != "ddp":
            out.update(SPOTCTL_SYNC=self.sync, SPOTCTL_SYNC_EVERY=str(self.sync_every))
            if self.sync == "diloco":
                out.update(SPOTCTL_OUTER_LR=repr(self.outer_lr),
                           SPOTCTL_OUTER_MOMENTUM=repr(self.outer_momentum))
            if self.on_notice != "auto":
                out.update(SPOTCTL_ON_NOTICE=self.on_notice)
        return out

    @field_validator("run_as")
    @classmethod
    def _run_as(cls, v: str) -> str:
        if v and not _WORKER_USER_RE.fullmatch(v):
            raise ValueError(f"{v[:40]!r} is not a user name (lowercase letters, digits, '_' "
                             "and '-', starting with a letter or '_', at most 32 characters)")
        if v == "root":
            # refused here, not first by the agent on every node (it refuses any uid 0)
            raise ValueError("'root' would let the workers read the node's credential; name "
                             "an unprivileged user, or \"\" to run them as the agent's user")
        return v


class BudgetSpec(_Strict):
    # USD per hour for the whole cluster; 0 means no cap.
    max_usd_per_hour: float = Field(default=0.0, ge=0, le=1e7)


class CapacityStep(_Strict):
    """From `at_s` seconds after the cluster was created, at most `nodes` local nodes exist."""

    at_s: float = Field(ge=0, le=1e9)  # seconds after the cluster was created
    nodes: int = Field(ge=0, le=10_000)  # the most local nodes that may exist from then on


class LocalSpec(_Zoned):
    # "GPU slots" per local node: its number of training processes (they run on CPU).
    gpus_per_node: int = Field(default=1, ge=1, le=64)
    # The emulated zones (a cluster stays in one unless [placement] spread_zones is true).
    zones: list[str] = Field(default_factory=lambda: ["local-a", "local-b"])
    # Emulated spot and on-demand $/h of a node, for the cost figures and the planner.
    price_per_node: float = Field(default=0.0, ge=0, le=1e6)
    on_demand_price_per_node: float = Field(default=0.0, ge=0, le=1e6)  # 0 = unknown
    # Emulated capacity over time, e.g. [{ at_s = 0, nodes = 3 }, { at_s = 60, nodes = 2 }]:
    # from at_s seconds after the cluster was created, at most that many nodes exist.
    capacity: list[CapacityStep] = Field(default_factory=list)
    # Seconds from the notice of a node the capacity reclaims to its hard stop (GCP: 30).
    reclaim_notice_s: float = Field(default=30.0, ge=1, le=3600)
    # each node in its own network namespace on a bridge (root + iproute2): real links,
    # which a test can cut to partition a node
    netns: bool = False
    # The link model in netns mode: a rate, and a one-way delay where wanted, on each
    # node's link to nodes of its zone (e.g. "1gbit 1ms"); delays need the kernel's
    # `tc netem` (`up` says when it is missing). "" = that link unshaped.
    link_in_zone: str = ""
    # The same to other zones and to the head (outside every zone), e.g. "100mbit 40ms".
    link_between_zones: str = ""
    # The whole cluster in a network namespace of its own: its listeners (all on
    # loopback) cannot be reached by other users of this machine (Linux user namespaces).
    # Unset: so where this machine allows it (else `up` says why not); false: loopback.
    private_network: bool | None = None

    @model_validator(mode="after")
    def _one_network(self) -> LocalSpec:
        if self.netns and self.private_network:
            raise ValueError("netns and private_network cannot both be true: netns puts each "
                             "node in a namespace of its own on a bridge of this machine")
        return self

    @field_validator("link_in_zone", "link_between_zones")
    @classmethod
    def _link(cls, v: str) -> str:
        if v:
            from spotctl.providers.local.net import Link

            Link.parse(v)
        return v

    @model_validator(mode="after")
    def _links_need_netns(self) -> LocalSpec:
        if (self.link_in_zone or self.link_between_zones) and not self.netns:
            raise ValueError("link_in_zone and link_between_zones shape the nodes' own links: "
                             "they need netns = true")
        return self

    @field_validator("capacity")
    @classmethod
    def _sorted(cls, v: list[CapacityStep]) -> list[CapacityStep]:
        times = [s.at_s for s in v]
        if times != sorted(times):
            raise ValueError("capacity steps must be in increasing at_s order")
        return v


class AwsSpec(_Zoned):
    region: str = "us-east-1"  # the region the cluster lives in
    zones: list[str] = Field(default_factory=list)  # zones to consider; empty = all of the region's
    # Instance types to consider; empty = the GPU types the Deep Learning AMI runs on.
    instance_types: list[str] = Field(default_factory=list)
    gpu: str = ""  # only instance types with this GPU model (e.g. "A10G"); empty = any
    # Workers' image: aws.ami, else the AMI that this public SSM parameter names (AWS's
    # Deep Learning AMI: NVIDIA driver, CUDA PyTorch). A pinned aws.ami is the head's too.
    ami: str = ""
    # The public SSM parameter naming the workers' AMI when aws.ami is empty.
    ami_ssm_parameter: str = (
        "/aws/service/deeplearning/ami/x86_64/"
        "oss-nvidia-driver-gpu-pytorch-2.9-ubuntu-24.04/latest/ami-id"
    )
    # The head's small CPU image: head_ami, else this SSM parameter (Canonical's Ubuntu
    # 24.04, Python 3.12: its python3 takes this controller's pinned packages as they are).
    head_ami: str = ""
    # The public SSM parameter naming the head's AMI when head_ami is empty.
    head_ami_ssm_parameter: str = (
        "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
    )
    # Workers' root volume GB; 0 = 100. Never below the image's own snapshot.
    root_volume_gb: int = Field(default=0, ge=0, le=16384)
    # Network: empty = the region's default VPC, else the VPC tagged spotctl:vpc=true.
    vpc_id: str = ""
    # Subnets to launch into (one per zone is enough); empty = every subnet of the VPC.
    subnet_ids: list[str] = Field(default_factory=list)
    # Checkpoints: s3://<bucket>/<cluster>/checkpoints is the default train.checkpoint_dir;
    # empty = spotctl-<account>-<region>, created private on first `up`.
    bucket: str = ""
    head_instance_type: str = "t3.small"  # the head's on-demand CPU instance type
    ssh_user: str = "ubuntu"  # the images' login user that bootstrap connects as
    # CIDR allowed to reach SSH; empty means the caller's own address. Never 0.0.0.0/0.
    ssh_cidr: str = ""


class GcpSpec(_Zoned):
    project: str = ""  # the GCP project; empty = GOOGLE_CLOUD_PROJECT, else the credentials'
    region: str = "us-central1"  # the region the cluster lives in
    zones: list[str] = Field(default_factory=list)  # zones to consider; empty = all of the region's
    # Machine types to consider; empty = every GPU machine type of the catalog.
    machine_types: list[str] = Field(default_factory=list)
    # Only machine types with this GPU model: "L4", "A100-80GB", "H100" (or GCP's
    # accelerator name, "nvidia-l4"); empty = any.
    gpu: str = ""
    # Workers: a Deep Learning VM image family (NVIDIA driver and CUDA PyTorch in the
    # image; older families install the driver at first boot, asked by metadata). The
    # head is a small CPU image.
    image: str = (
        "projects/deeplearning-platform-release/global/images/family/"
        "pytorch-2-9-cu129-ubuntu-2404-nvidia-580"
    )
    head_image: str = "projects/debian-cloud/global/images/family/debian-12"  # the head's
    head_machine_type: str = "e2-small"  # the head's on-demand CPU machine type
    # Boot disk GB of workers; 0 = 100, and never below the image's own minimum.
    disk_gb: int = Field(default=0, ge=0, le=65536)
    # Boot disk type of workers; empty = the one the machine family takes (pd-balanced,
    # or hyperdisk-balanced on families without persistent disks).
    disk_type: str = ""
    ssh_user: str = "spotctl"  # the user bootstrap connects as (its key in the metadata)
    # CIDR allowed to reach SSH; empty means the caller's own address. Never 0.0.0.0/0.
    ssh_cidr: str = ""
    # Checkpoints: gs://<bucket>/<cluster>/checkpoints is the default train.checkpoint_dir;
    # empty = spotctl-<project>-<region>, created with uniform bucket-level access and
    # public access prevention on first `up`. A bucket named here must exist already.
    bucket: str = ""


    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        if v and (
            not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]", v)
            or v.startswith("goog")
            or "google" in v
        ):
            raise ValueError(
                f"{v!r} is not a GCS bucket name (3-63 characters of a-z, 0-9, '-', '_', "
                "'.'; not starting with 'goog')"
            )
        return v


class SshHost(_Strict):
    """One host of your own, reached over SSH."""

    address: str  # a host name or IP address
    port: int = Field(default=22, ge=1, le=65535)  # its SSH port
    user: str = "root"  # the user to log in as
    # A private key file (relative to the spec's folder); empty = your SSH agent's keys
    # and the default ones in ~/.ssh.
    key: str = ""
    gpus: int = Field(default=1, ge=1, le=64)  # training processes on this host
    # A file whose appearance means the host is about to be taken away.
    notice_file: str = ""

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if not _HOST_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a host name or IP address")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a user name (letters, digits, '_', '.', '-')")
        return v


class SshSpec(_Strict):
    hosts: list[SshHost] = Field(default_factory=list)  # the hosts (provider "ssh" needs one)
    # The hosts' interpreter that each node's venv is made from (its torch is reused);
    # used when [train] python is empty, which makes spotctl ship itself to the hosts.
    base_python: str = "python3"
    # The training processes' listeners (torch's stores and gloo; on torchft each replica's
    # Manager and store) accept anyone who reaches a host's address, and torch loads what
    # its stores are sent. With one host they listen on its loopback. With several they
    # listen on the hosts' addresses: set true once only this cluster's hosts can reach
    # those (a network of their own, or a firewall). Hosts on loopback need nothing.
    trusted_network: StrictBool = False
    # The head's store and Lighthouse sit on this controller's loopback and, through a
    # reverse SSH forward, on each host's; a host's training listeners (torch's stores,
    # gloo, torchft's Manager) on its loopback too. None authenticates, and every user
    # of a machine reaches its loopback (a store pickle runs as the training user on
    # every host). `up` refuses an ssh cluster until this says that no one else (no other
    # user, no service you do not trust) uses this controller or any of the hosts.
    dedicated_hosts: StrictBool = False


class RebalanceSpec(_Strict):
    # A zone that preempted a node or refused a launch is tried last for this long.
    cooldown_s: float = Field(default=900.0, ge=0, le=1e7)
    # A running node is replaced by cheaper capacity only for at least this $/h saving.
    replace_saving_pct: float = Field(default=30.0, ge=0, le=100)
    # A node is lost after this many observations in a row without a heartbeat...
    lost_after_observations: int = Field(default=3, ge=1, le=1_000_000)
    # ...spanning at least this many seconds (or at once when the provider says it is gone).
    lost_after_s: float = Field(default=60.0, ge=0, le=1e7)
    # true: the head runs the reconcile loop itself (`rebalance --watch`), so lost nodes are
    # replaced with nothing running on this machine (local, aws and gcp clusters; not on ssh
    # hosts, where cron or `rebalance --watch` on this machine does it)
    on_head: StrictBool = True
    # the head's loop: seconds between runs when no notice, leave or loss triggers one
    on_head_interval_s: float = Field(default=60.0, ge=5, le=86400)


class PlacementSpec(_Strict):
    """Where a cluster's nodes go. One zone and one GPU model by default: all-reduce
    between zones is slow and billed, and a mixed-GPU job runs at its slowest GPU's pace.
    On ssh hosts there are no zones (each host is its own) and this section is unused."""

    # true: nodes may go to every zone of the region (more capacity, slower all-reduce);
    # on the torchft engine the plan launches whole replica groups in each zone
    spread_zones: StrictBool = False
    # Traffic one replica group sends across zones per hour (its sync volume: parameter
    # bytes x syncs per hour); the plan prices it at the provider's inter-zone rate.
    # 0 = unknown: the plan names the rate only.
    cross_zone_gb_per_hour: float = Field(default=0.0, ge=0, le=1e7, allow_inf_nan=False)
    # Several regions or providers for one job: refused in this build (their traffic would
    # cross the internet, and it has no encrypted, authenticated channel for it yet).
    # One entry, the cluster's own region or provider, is what runs anyway.
    regions: list[str] = Field(default_factory=list, max_length=64)
    providers: list[str] = Field(default_factory=list, max_length=8)  # the same, for clouds
    # true: nodes of different GPU models may join one cluster
    mix_gpus: StrictBool = False
    # false: a plain network interface on every node, even where the instance family
    # offers a fast one (EFA and a cluster placement group on AWS, gVNIC and compact
    # placement on GCP)
    fast_network: StrictBool = True


class ClusterSpec(_Strict):
    # The cluster's name: lowercase letters, digits and single '-' (never `--`, never
    # last), starting with a letter, at most 40 characters (`--name` picks a cluster by it).
    name: str = "spotctl"
    provider: Literal["local", "aws", "gcp", "ssh"] = "local"  # where the nodes come from
    # Total GPUs: "MIN..MAX" starts with at least MIN and grows toward MAX; N = exactly N.
    gpus: GpuRange = Field(default_factory=lambda: GpuRange(min=1, max=1))
    train: TrainSpec = Field(default_factory=TrainSpec)
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    local: LocalSpec = Field(default_factory=LocalSpec)
    aws: AwsSpec = Field(default_factory=AwsSpec)
    gcp: GcpSpec = Field(default_factory=GcpSpec)
    ssh: SshSpec = Field(default_factory=SshSpec)
    rebalance: RebalanceSpec = Field(default_factory=RebalanceSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, GpuRange | dict):
            return v
        return parse_gpu_range(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not valid_cluster_name(v):
            raise ValueError(
                f"{v!r} is not a valid cluster name (lowercase letters, digits and single "
                "'-', starting with a letter, at most 40 characters)"
            )
        return v

    @model_validator(mode="after")
    def _provider_fields(self) -> ClusterSpec:
        if self.provider == "ssh" and not self.ssh.hosts:
            raise ValueError("provider 'ssh' needs at least one [[ssh.hosts]] entry")
        exposed = [h.address for h in self.ssh.hosts if not is_loopback(h.address)]
        if (self.provider == "ssh" and len(self.ssh.hosts) > 1 and exposed
                and not self.ssh.trusted_network):
            raise ValueError(
                f"{len(self.ssh.hosts)} ssh hosts: their training processes listen on "
                f"{', '.join(sorted(set(exposed))[:3])} with no authentication (torch's "
                "stores run what they are sent); set [ssh] trusted_network = true once only "
                "these hosts can reach those addresses (a network of their own or a "
                "firewall; see docs/security.md)"
            )
        if self.train.nodes_per_replica > 1 and self.train.engine != "torchft":
            raise ValueError(
                f"[train] nodes_per_replica = {self.train.nodes_per_replica} needs engine "
                "'torchft' (on torchrun every node is already in one group)")
        if self.train.sync != "ddp" and self.train.engine != "torchft":
            raise ValueError(
                f"[train] sync = {self.train.sync!r} runs on engine \"torchft\" only (replica "
                f"groups synced through its Manager); this spec has engine = "
                f"{self.train.engine!r}")
        k = self.train.nodes_per_replica
        # a node has at least one GPU: whole groups are multiples of k GPUs (of k x the
        # node's GPUs where the spec says how many)
        gpn = self.local.gpus_per_node if self.provider == "local" else 1
        per = k * gpn
        if k > 1 and (self.gpus.min % per or self.gpus.max % per):
            raise ValueError(
                f"gpus {self.gpus} is not whole replica groups: each is {k} nodes x "
                + (f"{gpn} gpus = {per} (nodes_per_replica x [local] gpus_per_node)"
                   if self.provider == "local" else "at least 1 gpu (nodes_per_replica)"))
        self._one_region()
        sizes = sorted({h.gpus for h in self.ssh.hosts}) if self.provider == "ssh" else []
        if self.train.engine == "torchft" and len(sizes) > 1:
            # each node is one replica group, and the global batch is split by replica
            # rank times the group's size: groups of unequal size would train wrong data
            raise ValueError(
                "engine 'torchft' needs the same gpus on every ssh host (each node is one "
                f"replica group; these hosts have {', '.join(map(str, sizes))}): make them "
                "equal, or set [train] engine = \"torchrun\""
            )
        return self

    def _one_region(self) -> None:
        """[placement] regions / providers: only the cluster's own. Between regions or clouds
        the groups' syncs would cross the internet in plain gloo (no encryption, no
        authentication), which this build has no channel to replace."""
        pl = self.placement
        why = ("traffic between regions or clouds must be encrypted and authenticated, and "
               "this build has no such channel (torch's gloo is plain text)")
        if len(set(pl.providers)) > 1 or (pl.providers and pl.providers[0] != self.provider):
            raise ValueError(f"placement.providers {pl.providers}: one job on several "
                             f"providers is refused: {why}; keep provider "
                             f"{self.provider!r} only")
        own = {"aws": self.aws.region, "gcp": self.gcp.region}.get(self.provider, "local")
        if len(set(pl.regions)) > 1 or (pl.regions and pl.regions[0] != own):
            raise ValueError(f"placement.regions {pl.regions}: one job across regions is "
                             f"refused: {why}; keep region {own!r} only (zones of one region "
                             "may be spread: [placement] spread_zones = true)")

    @property
    def head_rebalances(self) -> bool:
        """Whether the head runs this cluster's reconcile loop ([rebalance] on_head, where
        the provider supports it: not ssh hosts)."""
        return self.rebalance.on_head and self.provider in ("local", "aws", "gcp")

    @property
    def gpus_per_node(self) -> int:
        if self.provider == "local":
            return self.local.gpus_per_node
        if self.provider == "ssh" and self.ssh.hosts:
            return min(h.gpus for h in self.ssh.hosts)
        return 1

    def resolved_script(self, base: Path) -> Path:
        p = Path(self.train.script).expanduser()
        return p if p.is_absolute() else (base / p)


def valid_cluster_name(v: str) -> bool:
    """Lowercase letters, digits and single '-', starting with a letter, at most 40."""
    return bool(_NAME_RE.fullmatch(v)) and "--" not in v


# the `spotctl up` flag each override key comes from: an error in one names the flag
FLAG_OF = {"name": "--name", "provider": "--provider", "gpus": "--gpus",
           "train.script": "--script", "train.max_steps": "--max-steps",
           "train.checkpoint_every": "--checkpoint-every",
           "budget.max_usd_per_hour": "--budget"}


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the spec allows in the table at `loc` (the unknown key's parent)."""
    model: Any = ClusterSpec
    for part in loc[:-1]:
        if isinstance(part, int):  # an index into a list: its items' model is the table
            continue
        f = getattr(model, "model_fields", {}).get(part)
        if f is None:
            return []
        model = f.annotation
        args = getattr(model, "__args__", ())  # list[SshHost], X | None: the model in it
        model = next((a for a in args if hasattr(a, "model_fields")), model)
    return list(getattr(model, "model_fields", {}))


def _format_validation(err: ValidationError, source: str,
                       flags: dict[str, Any] | None = None) -> str:
    import difflib

    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])  # list indexes too: ssh.hosts.0.key
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
        near = difflib.get_close_matches(str(first["loc"][-1]), _keys_at(first["loc"]), 1)
        if near:
            msg += f" (did you mean {near[0]!r}?)"
    msg = msg.removeprefix("Value error, ")
    more = len(err.errors()) - 1
    tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    if flags and loc in FLAG_OF and flags.get(loc) is not None:  # a flag's value
        return f"{FLAG_OF[loc]}: {msg}{tail}"
    where = f"{source}: " if source else ""
    return f"{where}{loc or 'spec'}: {msg}{tail}"


def load_spec(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    require_file: bool = False,
    check_script: bool = True,
) -> ClusterSpec:
    """Read `path` (or ./spotctl.toml when present), apply flag overrides, validate.

    `overrides` uses dotted keys: {"gpus": "2..4", "train.script": "x.py"}.
    The training script path is made absolute relative to the spec file's folder.
    """
    data: dict[str, Any] = {}
    source = ""
    base = Path.cwd()
    if path is None and (Path.cwd() / SPEC_FILE).exists():
        path = Path.cwd() / SPEC_FILE
    if path is not None:
        path = Path(path)
        source = str(path.name)
        if not path.exists():
            raise SpecError(f"config file {path} not found")
        if not path.is_file():
            raise SpecError(f"config file {path} is not a file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"{source}: not valid TOML: {e}") from None
        except UnicodeDecodeError:
            raise SpecError(f"{source}: not valid UTF-8 text") from None
        base = path.resolve().parent
    elif require_file:
        raise SpecError(f"no {SPEC_FILE} here; run `spotctl init` or pass --config")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SpecError(f"{key}: {p} must be a table")
        node[parts[-1]] = value
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_format_validation(e, source or "flags", overrides)) from None
    script = spec.resolved_script(base)
    if script.suffix != ".py":
        raise SpecError(f"train.script: {script} is not a Python file (.py); name the "
                        f"training script that spotctl.elastic runs")
    if check_script and spec.provider in ("local", "ssh") and not script.is_file():
        raise SpecError(f"train.script: training script {script} not found")
    spec.train.script = str(script)
    if spec.provider == "ssh" and check_script:
        for i, h in enumerate(spec.ssh.hosts):
            kf = Path(h.key).expanduser() if h.key else None
            if kf is not None and not kf.is_absolute():
                kf = base / kf
            if kf is not None and not kf.is_file():
                # fail before a head starts or a host is waited on for minutes
                raise SpecError(f"ssh.hosts.{i}.key: key file {kf} not found")
    cd = spec.train.checkpoint_dir
    if cd and not _URI_RE.match(cd):
        ck = Path(cd).expanduser()
        spec.train.checkpoint_dir = cd = str(ck if ck.is_absolute() else base / ck)
        if spec.provider in ("aws", "gcp"):
            mount = spec.train.shared_mount.rstrip("/")
            if not mount or not (cd.rstrip("/") + "/").startswith(mount + "/"):
                # checked before anything launches: a node-local path would lose every
                # checkpoint with the node that wrote it
                raise SpecError(
                    f"train.checkpoint_dir: on {spec.provider} every node must read the "
                    f"checkpoints; {cd!r} is a local path: use an object-store URI (s3://..., "
                    "gs://...) or a path under train.shared_mount (a mount on every node)")
    return spec
