"""AWS provider: spot GPU instances through boto3 (the only module that imports it).

Everything the cluster owns is tagged at creation with `spotctl:cluster` (instances also
with `spotctl:role` and `spotctl:request-id`), and tags are the source of truth: `list`,
idempotent `launch` and `cleanup` all find resources by tag.

Endpoint and credentials come from the usual boto3 chain; `AWS_ENDPOINT_URL` (honoured by
boto3 itself) points it at moto in tests, and `ctx.options["endpoint_url"]` overrides it.

Test/ops knobs in `ctx.options` (never set by users): endpoint_url, ssh_cidr,
retry_attempts (default 5), retry_base_s (0.5), poll_s (5), wait_timeout_s (300),
head_process (default True: `ensure_head` also starts `spotctl head` on the head VM over
SSH; provider unit tests turn it off, their fake instances have no SSH).

Bootstrap (head and workers) goes over SSH to each instance's public address as
`aws.ssh_user` with the cluster's key pair (spotctl.remote.bootstrap.CloudNodes). Test seam:
`SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT` (+ `SPOTCTL_SSH_OVERRIDE_KEY`, `SPOTCTL_HEAD_PORTS`,
`SPOTCTL_SSH_REMOTE_ROOT`) sends every instance's SSH to one loopback sshd and puts the
head on that address, so `up -> status -> down` runs on moto with real SSH, head and agents
(tests/aws/test_up_flow.py). Under the seam, `cleanup` also stops the processes the
"instances" ran, as terminating a real VM would.
"""

from __future__ import annotations

import builtins
import hashlib
import ipaddress
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from spotctl.errors import (
    AuthError,
    CapacityError,
    ProviderError,
    QuotaError,
    SpecError,
    TransientError,
)
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.base import HeadInfo, Instance, Offer, ProviderContext
from spotctl.remote.bootstrap import CloudNodes, HostResult

COORDINATOR_PORT = 7470  # head's HTTP coordinator API
STORE_PORT = 29400  # head's TCPStore for torchrun's c10d rendezvous
METADATA_URL = "http://169.254.169.254"  # IMDSv2, what the agents poll for notices

TAG_CLUSTER = "spotctl:cluster"
TAG_ROLE = "spotctl:role"
TAG_REQUEST = "spotctl:request-id"
TAG_PRICE = "spotctl:price"
TAG_ON_DEMAND = "spotctl:on-demand-price"
TAG_GPUS = "spotctl:gpus"

KEY_FILE = "aws-key.pem"
HEAD_TOKEN_FILE = "aws-head-request"
LIVE_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")
# Default AMI when aws.ami is empty: AWS's Deep Learning Base AMI (NVIDIA driver, CUDA).
DEFAULT_AMI_NAME = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"

CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "MaxSpotInstanceCountExceeded",
        "SpotMaxPriceTooLow",
        "UnfulfillableCapacity",
        # The type is not offered in that zone: as good as no capacity there.
        "Unsupported",
    }
)
AUTH_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "RequestExpired",
        "OptInRequired",
        "Blocked",
    }
)
THROTTLE_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
    }
)
_ID_CHUNK = 100  # ids per filter / terminate call, well under EC2's limits
_ZONE_ID_RE = re.compile(r"[a-z]{2,4}\d+-az\d+")
_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

T = TypeVar("T")


def _classify(code: str, status: int) -> type[ProviderError] | None:
    """The typed error for an API error code, None for 'not one of ours'."""
    if code in CAPACITY_CODES:
        return CapacityError
    if code in AUTH_CODES:
        return AuthError
    if code in THROTTLE_CODES or status >= 500:
        return TransientError
    if code.endswith("LimitExceeded"):
        return QuotaError
    return None


def _coded(err: ProviderError, code: str) -> ProviderError:
    """Attach the AWS error code, so callers can branch on it without parsing text."""
    err.code = code  # type: ignore[attr-defined]
    return err


def error_code(err: BaseException) -> str:
    return str(getattr(err, "code", ""))


def _listed(message: str) -> str:
    """The bracketed list in an error message ("... do not exist: [a, b]"), or ""."""
    m = re.search(r"\[([^\]]*)\]", message)
    return m.group(1) if m else ""


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _tags(d: dict[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in d.items()]


def _tag_map(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def client_token(request_id: str, offer: Offer) -> str:
    """ClientToken for run_instances: the request id, plus the offer it was tried on.

    A failover walk tries several offers under one request id; the same token with other
    parameters would be refused (IdempotentParameterMismatch), so the offer goes into the
    token. Retrying the same offer under the same request id reuses the token, which lets
    EC2 itself return the first call's instances. At most 64 characters.
    """
    digest = hashlib.sha256(f"{offer.zone}/{offer.instance_type}".encode()).hexdigest()[:10]
    return f"{request_id[:53]}-{digest}"


@dataclass
class _Retry:
    attempts: int  # total tries for transient errors, >= 1
    base_s: float  # first backoff; doubles each try, full jitter, capped at 10 s


class AwsProvider:
    """Spot workers and an on-demand head in one region, tagged by cluster.

    Launch path: `run_instances` with `InstanceMarketOptions` spot, one offer (type and
    zone) per call, MinCount=MaxCount=count (all or nothing). Chosen over an instant EC2
    Fleet because the planner already picks the offer (type, zone) and
    `launch_with_failover` walks the alternatives, so the fleet's own allocation strategy
    would have one choice; run_instances raises the capacity error codes synchronously
    (a fleet reports them as per-override entries in a 200 response), needs no launch
    template to create, tag and clean up, and its ClientToken gives EC2-side idempotency.
    """

    name = "aws"

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.spec = ctx.spec.aws
        self.region = self.spec.region
        opts = ctx.options
        self._retry = _Retry(
            attempts=max(1, int(opts.get("retry_attempts", 5))),
            base_s=float(opts.get("retry_base_s", 0.5)),
        )
        self._poll_s = float(opts.get("poll_s", 5.0))
        self._wait_timeout_s = float(opts.get("wait_timeout_s", 300.0))
        # botocore's own retries are off: its standard mode also retries 500-class
        # capacity errors (InsufficientInstanceCapacity), which must fail over at once.
        # `_call` retries throttling and server errors only, with bounded backoff.
        config = Config(
            region_name=self.region,
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            user_agent_extra="spotctl",
        )
        kwargs: dict[str, Any] = {"config": config, "region_name": self.region}
        if opts.get("endpoint_url"):
            kwargs["endpoint_url"] = opts["endpoint_url"]
        try:
            self.ec2 = boto3.session.Session().client("ec2", **kwargs)
        except (NoRegionError, BotoCoreError) as e:
            raise SpecError(f"aws: cannot create an EC2 client: {_one_line(str(e))}") from None
        self._types: dict[str, dict[str, Any]] = {}
        self._prepared: tuple[str, str] | None = None  # (security group id, key name)
        self._default_ami = ""  # looked up once when aws.ami is empty
        self._nodes = CloudNodes(
            ctx, metadata="aws", metadata_url=METADATA_URL,
            api_port=COORDINATOR_PORT, store_port=STORE_PORT,
        )  # fmt: skip
        self._head_process = bool(opts.get("head_process", True))
        self._head: HeadInfo | None = None  # set by ensure_head, used by bootstrap

    # ---- API calls ------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """One API call with typed errors; throttling/5xx retried with backoff.

        `what` names the operation and its target for the one-line message, e.g.
        "launch g5.xlarge in us-east-1a".
        """
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(**kwargs)
            except ClientError as e:
                err = e.response.get("Error", {})
                code = str(err.get("Code", "Unknown"))
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                kind = _classify(code, status)
                msg = f"aws: {what}: {code}: {_one_line(err.get('Message', ''))}"
                if kind is TransientError and attempt < self._retry.attempts:
                    self._backoff(attempt)
                    continue
                if kind is TransientError:
                    msg += f" (gave up after {attempt} tries)"
                raise _coded((kind or ProviderError)(msg), code) from None
            except (NoCredentialsError, PartialCredentialsError) as e:
                raise AuthError(
                    f"aws: {what}: no usable credentials ({_one_line(str(e))}); set "
                    "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                ) from None
            except BotoConnectionError as e:
                if attempt < self._retry.attempts:
                    self._backoff(attempt)
                    continue
                raise TransientError(
                    f"aws: {what}: cannot reach EC2 after {attempt} tries: {_one_line(str(e))}"
                ) from None

    def _backoff(self, attempt: int) -> None:
        cap = min(10.0, self._retry.base_s * 2 ** (attempt - 1))
        time.sleep(random.uniform(cap / 2, cap))

    def _paged(self, op: str, what: str, key: str, **kwargs: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token = None
        while True:
            page = self._call(
                what, getattr(self.ec2, op), **kwargs, **({"NextToken": token} if token else {})
            )
            out.extend(page.get(key, []))
            token = page.get("NextToken")
            if not token:
                return out

    # ---- offers ---------------------------------------------------------------------

    def _wanted_types(self) -> list[str]:
        if self.spec.instance_types:
            return list(dict.fromkeys(self.spec.instance_types))
        types = catalog_aws.instance_types(self.region)
        if not types:
            raise SpecError(
                f"aws.region: the shipped catalog has no GPU types for {self.region!r} "
                f"(it covers {', '.join(catalog_aws.regions())}); set aws.instance_types"
            )
        return types

    def _describe_types(
        self, types: Sequence[str], strict: bool = True
    ) -> dict[str, dict[str, Any]]:
        """Type descriptions by name. `strict=False` drops types EC2 does not know.

        The catalog lists types that AWS has since retired (p3 at the time of writing),
        so its defaults are allowed to shrink; types the user named are not.
        """
        missing = [t for t in types if t not in self._types]
        for i in range(0, len(missing), 100):
            chunk = missing[i : i + 100]
            while chunk:
                try:
                    found = self._paged(
                        "describe_instance_types",
                        f"describe instance types in {self.region}",
                        "InstanceTypes",
                        InstanceTypes=chunk,
                    )
                    break
                except ProviderError as e:
                    if error_code(e) != "InvalidInstanceType":
                        raise
                    unknown = set(re.findall(r"[a-z0-9-]+\.[a-z0-9-]+", _listed(str(e))))
                    if strict or not unknown & set(chunk):
                        raise SpecError(
                            f"aws.instance_types: {str(e).split(': ', 3)[-1]} "
                            f"(region {self.region})"
                        ) from None
                    chunk = [t for t in chunk if t not in unknown]
            else:
                found = []
            for t in found:
                self._types[t["InstanceType"]] = t
        return {t: self._types[t] for t in types if t in self._types}

    def _latest_spot_prices(self, types: Sequence[str]) -> dict[tuple[str, str], float]:
        """Latest price per (type, zone name). StartTime=now returns the current price."""
        now = time.time()
        rows = self._paged(
            "describe_spot_price_history",
            f"read spot prices in {self.region}",
            "SpotPriceHistory",
            InstanceTypes=list(types),
            ProductDescriptions=["Linux/UNIX"],
            StartTime=now,
        )
        latest: dict[tuple[str, str], tuple[Any, float]] = {}
        for r in rows:
            key = (r["InstanceType"], r["AvailabilityZone"])
            ts = r.get("Timestamp")
            prev = latest.get(key)
            if prev is None or (ts is not None and prev[0] is not None and ts > prev[0]):
                latest[key] = (ts, float(r["SpotPrice"]))
        return {k: v[1] for k, v in latest.items()}

    def offers(self) -> list[Offer]:
        """Live spot offers per (type, zone) in the spec's region, filtered by gpu/zones."""
        explicit = bool(self.spec.instance_types)
        types = self._describe_types(self._wanted_types(), strict=explicit)
        gpu_types: dict[str, tuple[str, int, float]] = {}
        for name, info in types.items():
            gpus = (info.get("GpuInfo") or {}).get("Gpus") or []
            if not gpus:
                continue
            archs = info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
            if not explicit and "x86_64" not in archs:
                continue
            g = gpus[0]
            count = sum(int(x.get("Count", 0)) for x in gpus)
            mem = float(g.get("MemoryInfo", {}).get("SizeInMiB", 0)) / 1024
            gpu_types[name] = (str(g.get("Name", "")), count, round(mem, 3))
        if not gpu_types:
            return []
        prices = self._latest_spot_prices(sorted(gpu_types))
        want_gpu = self.spec.gpu.strip().lower()
        zones = set(self.spec.zones)
        out = []
        for (itype, zone), price in sorted(prices.items()):
            if itype not in gpu_types or (zones and zone not in zones):
                continue
            gpu_name, count, mem = gpu_types[itype]
            row = catalog_aws.catalog_row(itype, self.region)
            if want_gpu and want_gpu not in (
                gpu_name.lower(),
                (row.gpu_name.lower() if row else ""),
            ):
                continue
            out.append(
                Offer(
                    provider="aws",
                    region=self.region,
                    zone=zone,
                    instance_type=itype,
                    gpus=count,
                    gpu_name=gpu_name,
                    spot_price=price,
                    on_demand_price=catalog_aws.on_demand_price(itype, self.region),
                    interruption_band=catalog_aws.interruption_band(itype, self.region),
                    gpu_memory_gib=mem,
                )
            )
        return out

    # ---- cluster resources ----------------------------------------------------------

    @property
    def _group_name(self) -> str:
        return f"spotctl-{self.ctx.cluster}"

    @property
    def key_name(self) -> str:
        return f"spotctl-{self.ctx.cluster}"

    @property
    def key_path(self) -> Path:
        return self.ctx.path / KEY_FILE

    def _ssh_cidr(self) -> str:
        """Who may reach SSH: aws.ssh_cidr, else the caller's address from the CLI.

        spotctl never guesses the caller's public address itself (that would call a
        third-party service); without one of the two it refuses rather than open SSH to
        the world.
        """
        raw = self.spec.ssh_cidr or str(self.ctx.options.get("ssh_cidr") or "")
        if not raw:
            raise SpecError(
                "aws.ssh_cidr: not set and the caller's address is unknown; set it to the "
                'address spotctl runs from, e.g. ssh_cidr = "203.0.113.7/32"'
            )
        try:
            return str(ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise SpecError(f"aws.ssh_cidr: {raw!r} is not an IP address or CIDR") from None

    def _cluster_filter(self) -> list[dict[str, Any]]:
        return [{"Name": f"tag:{TAG_CLUSTER}", "Values": [self.ctx.cluster]}]

    def _default_vpc(self) -> str:
        vpcs = self._call(
            f"find the default VPC in {self.region}",
            self.ec2.describe_vpcs,
            Filters=[{"Name": "isDefault", "Values": ["true"]}],
        ).get("Vpcs", [])
        if not vpcs:
            raise SpecError(f"aws.region: {self.region} has no default VPC to launch into")
        return str(vpcs[0]["VpcId"])

    def _find_groups(self) -> list[dict[str, Any]]:
        return self._paged(
            "describe_security_groups",
            f"find security groups of cluster {self.ctx.cluster}",
            "SecurityGroups",
            Filters=self._cluster_filter(),
        )

    def _ensure_group(self) -> str:
        groups = self._find_groups()
        if groups:
            return str(groups[0]["GroupId"])
        cidr = self._ssh_cidr()
        vpc = self._default_vpc()
        gid = str(
            self._call(
                f"create security group {self._group_name}",
                self.ec2.create_security_group,
                GroupName=self._group_name,
                Description=f"spotctl cluster {self.ctx.cluster}",
                VpcId=vpc,
                TagSpecifications=[
                    {
                        "ResourceType": "security-group",
                        "Tags": _tags({TAG_CLUSTER: self.ctx.cluster, "Name": self._group_name}),
                    }
                ],
            )["GroupId"]
        )
        # SSH only from the user's address. Everything else (coordinator, rendezvous store,
        # and the ephemeral ports gloo/NCCL pick between workers) only from the group.
        self._call(
            f"open SSH from {cidr} on {self._group_name}",
            self.ec2.authorize_security_group_ingress,
            GroupId=gid,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 22,
                    "ToPort": 22,
                    "IpRanges": [{"CidrIp": cidr, "Description": "spotctl controller"}],
                },
                {
                    "IpProtocol": "-1",
                    "UserIdGroupPairs": [{"GroupId": gid, "Description": "cluster members"}],
                },
            ],
        )
        return gid

    def _ensure_key(self) -> str:
        pairs = self._call(
            f"find key pair {self.key_name}",
            self.ec2.describe_key_pairs,
            Filters=[{"Name": "key-name", "Values": [self.key_name]}],
        ).get("KeyPairs", [])
        if pairs:
            tags = _tag_map(pairs[0])
            if tags.get(TAG_CLUSTER) != self.ctx.cluster:
                raise SpecError(
                    f"aws: key pair {self.key_name} exists but is not tagged for cluster "
                    f"{self.ctx.cluster}; delete it or pick another cluster name"
                )
            if self.key_path.exists():
                return self.key_name
            # Our key, but its private half is lost: nothing can use it, so replace it.
            self._call(
                f"replace key pair {self.key_name}",
                self.ec2.delete_key_pair,
                KeyName=self.key_name,
            )
        resp = self._call(
            f"create key pair {self.key_name}",
            self.ec2.create_key_pair,
            KeyName=self.key_name,
            KeyType="ed25519",
            TagSpecifications=[
                {"ResourceType": "key-pair", "Tags": _tags({TAG_CLUSTER: self.ctx.cluster})}
            ],
        )
        from spotctl.state import write_private

        self.ctx.cluster_dir.ensure()
        material = str(resp["KeyMaterial"])
        write_private(self.key_path, material if material.endswith("\n") else material + "\n")
        return self.key_name

    def prepare(self) -> None:
        """Security group and key pair of the cluster (idempotent, found by tag/name)."""
        if self._prepared is None:
            self._prepared = (self._ensure_group(), self._ensure_key())

    def _ami(self) -> str:
        if self.spec.ami:
            return self.spec.ami
        if self._default_ami:
            return self._default_ami
        images = self._call(
            f"find a Deep Learning AMI in {self.region}",
            self.ec2.describe_images,
            Owners=["amazon"],
            Filters=[
                {"Name": "name", "Values": [DEFAULT_AMI_NAME]},
                {"Name": "state", "Values": ["available"]},
                {"Name": "architecture", "Values": ["x86_64"]},
            ],
        ).get("Images", [])
        if not images:
            raise SpecError(
                f"aws.ami: not set and no '{DEFAULT_AMI_NAME}' image found in "
                f"{self.region}; set aws.ami"
            )
        newest = max(images, key=lambda i: str(i.get("CreationDate", "")))
        self._default_ami = str(newest["ImageId"])
        return self._default_ami

    # ---- instances ------------------------------------------------------------------

    def _describe(self, filters: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
        reservations = self._paged("describe_instances", what, "Reservations", Filters=filters)
        return [i for r in reservations for i in r.get("Instances", [])]

    def _to_instance(self, raw: dict[str, Any]) -> Instance:
        tags = _tag_map(raw)
        state = raw.get("State", {}).get("Name", "")
        mapped = {"pending": "pending", "running": "running", "terminated": "gone"}.get(
            state, "stopping"
        )
        launched = raw.get("LaunchTime")
        itype = str(raw.get("InstanceType", ""))
        gpus = int(tags.get(TAG_GPUS, "0") or 0)
        return Instance(
            id=str(raw["InstanceId"]),
            cluster=tags.get(TAG_CLUSTER, ""),
            role=tags.get(TAG_ROLE, "worker"),
            zone=str(raw.get("Placement", {}).get("AvailabilityZone", "")),
            instance_type=itype,
            gpus=gpus,
            state=mapped,
            request_id=tags.get(TAG_REQUEST, ""),
            price=float(tags.get(TAG_PRICE, "0") or 0),
            on_demand_price=float(tags.get(TAG_ON_DEMAND, "0") or 0),
            launched_at=launched.timestamp() if launched is not None else 0.0,
            address=str(raw.get("PrivateIpAddress", "")),
            public_address=str(raw.get("PublicIpAddress", "")),
            spot=raw.get("InstanceLifecycle") == "spot",
            ssh_port=22,
            ssh_user=self.spec.ssh_user,
            meta={
                "key_file": str(self.key_path),
                "region": self.region,
                "aws_state": state,
                "spot_request_id": raw.get("SpotInstanceRequestId", ""),
            },
        )

    def _by_request(self, request_id: str) -> list[Instance]:
        raw = self._describe(
            self._cluster_filter()
            + [
                {"Name": f"tag:{TAG_REQUEST}", "Values": [request_id]},
                {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
            ],
            f"look up request {request_id}",
        )
        return [self._to_instance(i) for i in raw]

    def _run(
        self,
        what: str,
        *,
        instance_type: str,
        zone: str,
        count: int,
        request_id: str,
        token: str,
        role: str,
        tags: dict[str, str],
        spot: bool,
    ) -> list[Instance]:
        self.prepare()
        assert self._prepared is not None
        group, key = self._prepared
        all_tags = {
            TAG_CLUSTER: self.ctx.cluster,
            TAG_ROLE: role,
            TAG_REQUEST: request_id,
            "Name": f"spotctl-{self.ctx.cluster}-{role}",
            **tags,
        }
        kwargs: dict[str, Any] = dict(
            ImageId=self._ami(),
            InstanceType=instance_type,
            # All or nothing: a launch yields exactly what the plan counted, and a zone
            # that cannot fit the whole count fails over to the next offer.
            MinCount=count,
            MaxCount=count,
            KeyName=key,
            SecurityGroupIds=[group],
            ClientToken=token,
            MetadataOptions={
                "HttpTokens": "required",
                "HttpPutResponseHopLimit": 1,
                "HttpEndpoint": "enabled",
            },
            TagSpecifications=[
                {"ResourceType": "instance", "Tags": _tags(all_tags)},
                {"ResourceType": "volume", "Tags": _tags({TAG_CLUSTER: self.ctx.cluster})},
            ],
        )
        if zone:
            kwargs["Placement"] = {"AvailabilityZone": zone}
        if spot:
            kwargs["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        resp = self._call(what, self.ec2.run_instances, **kwargs)
        return [self._to_instance(i) for i in resp.get("Instances", [])]

    def launch(self, offer: Offer, count: int, request_id: str) -> list[Instance]:
        """Start `count` spot workers of `offer`; idempotent by `request_id`.

        Instances already tagged with this request id are returned instead of launching
        (covers a retried `up`); the ClientToken covers the window where a just-launched
        instance is not yet visible to describe_instances.
        """
        if count <= 0:
            return []
        if offer.region != self.region:
            raise SpecError(
                f"aws: offer {offer.instance_type} in {offer.zone} is in {offer.region}, "
                f"not the cluster's region {self.region}"
            )
        if _ZONE_ID_RE.fullmatch(offer.zone):
            raise SpecError(
                f"aws: offer {offer.instance_type} in {offer.zone} comes from the catalog "
                "(a zone ID); launches need a live offer with a zone name"
            )
        existing = self._by_request(request_id)
        if existing:
            return existing
        return self._run(
            f"launch {count} x {offer.instance_type} (spot) in {offer.zone}",
            instance_type=offer.instance_type,
            zone=offer.zone,
            count=count,
            request_id=request_id,
            token=client_token(request_id, offer),
            role="worker",
            tags={
                TAG_PRICE: f"{offer.spot_price:g}",
                TAG_ON_DEMAND: f"{offer.on_demand_price or 0:g}",
                TAG_GPUS: str(offer.gpus),
            },
            spot=True,
        )

    def list(self, cluster: str) -> list[Instance]:
        raw = self._describe(
            [
                {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
                {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
            ],
            f"list instances of cluster {cluster}",
        )
        return [self._to_instance(i) for i in raw]

    def terminate(self, ids: Sequence[str]) -> None:
        """Terminate instances of this cluster; gone, unknown or foreign ids are ignored.

        Only ids tagged with this cluster are touched, so a stale id can never take down
        someone else's machine.
        """
        ids = [i for i in dict.fromkeys(ids) if i]
        targets = self._live_ids(ids, f"look up {len(ids)} instance(s) to terminate")
        for i in range(0, len(targets), _ID_CHUNK):
            chunk = targets[i : i + _ID_CHUNK]
            try:
                self._call(
                    f"terminate {', '.join(chunk)}",
                    self.ec2.terminate_instances,
                    InstanceIds=chunk,
                )
            except ProviderError as e:
                # Gone between the lookup and the call: that is what was asked for.
                if error_code(e) not in _NOT_FOUND_CODES:
                    raise

    def _live_ids(self, ids: Sequence[str], what: str) -> builtins.list[str]:
        """Which of these ids are live instances of this cluster (filters, so unknown
        ids are simply absent instead of failing the whole call)."""
        live: builtins.list[str] = []
        for i in range(0, len(ids), _ID_CHUNK):
            raw = self._describe(
                self._cluster_filter()
                + [
                    {"Name": "instance-id", "Values": list(ids[i : i + _ID_CHUNK])},
                    {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
                ],
                what,
            )
            live.extend(str(x["InstanceId"]) for x in raw)
        return live

    # ---- head -----------------------------------------------------------------------

    def _wait_running(self, instance_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            raw = self._describe(
                [{"Name": "instance-id", "Values": [instance_id]}],
                f"wait for head {instance_id}",
            )
            state = raw[0]["State"]["Name"] if raw else "unknown"
            if raw and state == "running" and raw[0].get("PrivateIpAddress"):
                return raw[0]
            if state in ("shutting-down", "terminated", "stopping", "stopped"):
                raise ProviderError(f"aws: head {instance_id} went {state} while starting")
            if time.monotonic() >= deadline:
                raise TransientError(
                    f"aws: head {instance_id} not running after {self._wait_timeout_s:.0f}s "
                    f"(state {state})"
                )
            time.sleep(self._poll_s)

    def _head_token(self, renew: bool) -> str:
        """The head's launch token, kept in the cluster dir so a retry reuses it."""
        path = self.ctx.path / HEAD_TOKEN_FILE
        if renew or not path.exists():
            self.ctx.cluster_dir.ensure()
            path.write_text(f"{self.ctx.cluster[:20]}-head-{uuid.uuid4().hex[:16]}\n")
        return path.read_text().strip()

    def ensure_head(self) -> HeadInfo:
        """An on-demand head (aws.head_instance_type) tagged role=head, started if absent,
        running `spotctl head` (started over SSH if not running; token uploaded 0600).

        Nodes reach the head at its private address. The controller uses `public_url`
        (the head's public address): the coordinator and store ports are open to the
        cluster's group only, so outside the VPC that needs an SSH tunnel to the head
        (not built yet); under the test seam it is the loopback address.
        """
        heads = [i for i in self.list(self.ctx.cluster) if i.role == "head"]
        live = [h for h in heads if h.state in ("pending", "running")]
        if live:
            head_id = live[0].id
        else:
            token = self._head_token(renew=bool(heads) or self._head_gone())
            started = self._run(
                f"start head {self.spec.head_instance_type} (on-demand) in {self.region}",
                instance_type=self.spec.head_instance_type,
                zone="",
                count=1,
                request_id=token,
                token=token,
                role="head",
                tags={},
                spot=False,
            )
            head_id = started[0].id
        inst = self._to_instance(self._wait_running(head_id))
        self._head = self._nodes.head(inst, self._head_process, "aws")
        return self._head

    def bootstrap(self, instances: Sequence[Instance]) -> builtins.list[HostResult]:
        """Make launched workers nodes over SSH: wait until each runs (addresses known),
        start its agent (AWS IMDSv2 notices), confirm its first heartbeat at the head.
        Per-host results; one host failing never hides the others."""
        head = self._head or self.ensure_head()
        ready: builtins.list[Instance] = []
        failed: builtins.list[HostResult] = []
        for inst in instances:
            try:
                ready.append(self._to_instance(self._wait_running(inst.id)))
            except ProviderError as e:
                failed.append(HostResult(inst.id, False, str(e), False, 0.0))
        return failed + self._nodes.bootstrap(ready, head)

    def _head_gone(self) -> bool:
        """True when the saved head token already launched a head that is now gone."""
        path = self.ctx.path / HEAD_TOKEN_FILE
        if not path.exists():
            return False
        raw = self._describe(
            self._cluster_filter()
            + [{"Name": f"tag:{TAG_REQUEST}", "Values": [path.read_text().strip()]}],
            "look up the previous head",
        )
        return bool(raw)

    # ---- cleanup --------------------------------------------------------------------

    def _wait_gone(self, ids: Iterable[str]) -> builtins.list[str]:
        ids = list(ids)
        deadline = time.monotonic() + self._wait_timeout_s
        while ids:
            ids = self._live_ids(ids, "wait for instances to terminate")
            if not ids or time.monotonic() >= deadline:
                break
            time.sleep(self._poll_s)
        return ids

    def cleanup(self) -> builtins.list[str]:
        """Terminate every instance of the cluster, then its security group and key pair.

        Returns one line per thing that is still there afterwards (empty when clean).
        """
        leaks: builtins.list[str] = []
        insts = self.list(self.ctx.cluster)
        if self._nodes.override is not None:
            # Test seam: the "instances" are processes behind one sshd; stop them as
            # terminating the VMs would.
            leaks += [f"{r.node_id}: {r.reason}" for r in self._nodes.release(insts) if not r.ok]
        ids = [i.id for i in insts]
        self.terminate(ids)
        for left in self._wait_gone(ids):
            leaks.append(f"instance {left} in {self.region} still not terminated")
        for group in self._find_groups():
            gid = str(group["GroupId"])
            deadline = time.monotonic() + self._wait_timeout_s
            while True:
                try:
                    self._call(
                        f"delete security group {gid}", self.ec2.delete_security_group, GroupId=gid
                    )
                    break
                except ProviderError as e:
                    if error_code(e) == "InvalidGroup.NotFound":
                        break
                    # Network interfaces of just-terminated instances linger a little.
                    if error_code(e) == "DependencyViolation" and time.monotonic() < deadline:
                        time.sleep(self._poll_s)
                        continue
                    leaks.append(f"security group {gid} ({group.get('GroupName', '')}): {e}")
                    break
        pairs = self._call(
            f"find key pairs of cluster {self.ctx.cluster}",
            self.ec2.describe_key_pairs,
            Filters=self._cluster_filter(),
        ).get("KeyPairs", [])
        for pair in pairs:
            try:
                self._call(
                    f"delete key pair {pair['KeyName']}",
                    self.ec2.delete_key_pair,
                    KeyName=pair["KeyName"],
                )
            except ProviderError as e:
                leaks.append(f"key pair {pair['KeyName']}: {e}")
        self._prepared = None
        if not leaks:
            self.key_path.unlink(missing_ok=True)
            (self.ctx.path / HEAD_TOKEN_FILE).unlink(missing_ok=True)
        return leaks


def launch_with_failover(
    provider: Any, offers: Sequence[Offer], count: int, request_id: str
) -> tuple[Offer, list[Instance]]:
    """Try offers in order; a capacity error moves to the next at once.

    Quota, auth and other errors stop the walk (they would fail the same way elsewhere).
    Works with any provider whose launch raises CapacityError. When every offer is out
    of capacity, raises one CapacityError listing each zone/type tried.
    """
    if not offers:
        raise CapacityError("no offer to launch (none matched the spec)")
    tried: list[str] = []
    for offer in offers:
        try:
            return offer, provider.launch(offer, count, request_id)
        except CapacityError as e:
            tried.append(f"{offer.instance_type} in {offer.zone} ({error_code(e) or e})")
    raise CapacityError(f"no capacity in any of {len(offers)} offer(s): " + "; ".join(tried))


def create(ctx: ProviderContext) -> AwsProvider:
    return AwsProvider(ctx)
