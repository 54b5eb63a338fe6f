"""AWS provider, the EC2 API layer: the boto3 client, typed errors and retries.

This module owns how spotctl talks to EC2: the client (endpoint, no botocore retries),
`_call` (every API call goes through it), the mapping of EC2 error codes to
CapacityError / QuotaError / AuthError / TransientError (`_classify`), bounded backoff
for throttling and 5xx, pagination, and the tag names and helpers every other part of
the AWS provider uses. `AwsApi` is the base class the offers, network and launch parts
build on (spotctl/providers/aws/provider.py assembles them into AwsProvider).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from botocore.exceptions import ConnectionError as BotoConnectionError

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

COORDINATOR_PORT = 7470  # head's HTTP coordinator API
STORE_PORT = 29400  # head's TCPStore for torchrun's c10d rendezvous
METADATA_URL = "http://169.254.169.254"  # IMDSv2, what the agents poll for notices
TAG_CLUSTER = "spotctl:cluster"
TAG_ROLE = "spotctl:role"
TAG_REQUEST = "spotctl:request-id"
TAG_PRICE = "spotctl:price"
TAG_ON_DEMAND = "spotctl:on-demand-price"
TAG_GPUS = "spotctl:gpus"
TAG_NETWORK = "spotctl:network"  # "efa<N>" (N EFA interfaces) or "ena" (one plain one)
TAG_VPC = "spotctl:vpc"  # "true" on the VPC to use where the region has no default VPC
KEY_FILE = "aws-key.pem"
HEAD_TOKEN_FILE = "aws-head-request"
LIVE_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")

CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
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
        # a new account that AWS has not finished verifying: every launch is refused
        "PendingVerification",
    }
)
# Account limits: the same launch fails the same way in every zone, so they stop the walk.
# MaxSpotInstanceCountExceeded is the spot vCPU quota (0 on new accounts), not capacity.
QUOTA_CODES = frozenset({"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded"})
# Service Quotas codes (service "ec2") of the vCPU limits spot GPU launches count against,
# per quota family (quota_family): the P5 generation (p5, p5e, p5en) has its own.
SPOT_QUOTA_CODES = {
    "g": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "p": ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    "p5": ("L-C4BD4855", "All P5 Spot Instance Requests"),
}


def quota_family(instance_type: str) -> str:
    """The SPOT_QUOTA_CODES key a type's spot vCPUs count against ("" for none of them)."""
    family = instance_type.split(".", 1)[0]
    if family.startswith("p5"):
        return "p5"
    return family[:1] if family[:1] in ("g", "p") else ""
# Elastic IPs per region (5 by default): one per running node with several EFA interfaces
ELASTIC_IP_QUOTA = ("L-0263D0A3", "EC2-VPC Elastic IPs")
ON_DEMAND_STANDARD_QUOTA = ("L-1216C47A", "Running On-Demand Standard instances")
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
_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

T = TypeVar("T")


def _classify(code: str, status: int) -> type[ProviderError] | None:
    """The typed error for an API error code, None for 'not one of ours'."""
    if code in CAPACITY_CODES:
        return CapacityError
    if code in QUOTA_CODES:
        return QuotaError
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


@dataclass
class _Retry:
    attempts: int  # total tries for transient errors, >= 1
    base_s: float  # first backoff; doubles each try, full jitter, capped at 10 s


class AwsApi:
    """The EC2 client of one cluster and region, and the one way to call it."""

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.spec = ctx.spec.aws
        self.region = self.spec.region
        # EFA and a placement group for the types that have EFA ([placement] fast_network)
        self.fast_network = ctx.spec.placement.fast_network
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
            session = boto3.session.Session()
            self.ec2 = session.client("ec2", **kwargs)
            # Other services (SSM, STS, S3, IAM, Service Quotas) use boto3's own endpoint
            # resolution (AWS_ENDPOINT_URL in tests): the endpoint_url option is EC2's.
            self._session = session
            self._client_kwargs = {"config": config, "region_name": self.region}
            # Public SSM parameters name the current Deep Learning / Ubuntu AMIs.
            self.ssm = session.client("ssm", **self._client_kwargs)
        except (NoRegionError, BotoCoreError) as e:
            raise SpecError(f"aws: cannot create an EC2 client: {_one_line(str(e))}") from None
        self._types: dict[str, dict[str, Any]] = {}
        self._prepared: tuple[str, str] | None = None  # (security group id, key name)
        self._amis: dict[str, str] = {}  # SSM parameter -> AMI id, looked up once
        # AMI -> (root device, snapshot GB, image name), described once
        self._roots: dict[str, tuple[str, int, str]] = {}
        self._network: tuple[str, bool] | None = None  # (VPC id, is the default VPC)
        self._subnets: list[dict[str, Any]] | None = None
        self._placement: dict[str, str] = {}  # zone -> the cluster's placement group there
        self._nodes = CloudNodes(
            ctx, metadata="aws", metadata_url=METADATA_URL,
            api_port=COORDINATOR_PORT, store_port=STORE_PORT,
        )  # fmt: skip
        self._head_process = bool(opts.get("head_process", True))
        # the head's own reconcile loop runs this provider on the head VM: its instance id
        self._on_head = str(opts.get("on_head") or "")
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
                if code == "MaxSpotInstanceCountExceeded":
                    g, p = SPOT_QUOTA_CODES["g"][0], SPOT_QUOTA_CODES["p"][0]
                    p5 = SPOT_QUOTA_CODES["p5"][0]
                    msg += (
                        f" (spot vCPU quota: ask for more in Service Quotas, ec2 {g} for G/VT, "
                        f"{p} for P2-P4, {p5} for P5; `spotctl check --provider aws` shows it)"
                    )
                if code == "PendingVerification":
                    msg += (" (AWS is still verifying this new account, usually for minutes, "
                            "at most 4 hours; `spotctl check --provider aws` shows when it is done)")
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
