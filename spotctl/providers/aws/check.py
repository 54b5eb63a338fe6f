"""AWS provider, pre-flight checks: what a new account lacks before `up` spends anything.

This module owns `spotctl check --provider aws`: one line each for credentials (STS), the
region (its zones), the spot GPU vCPU quotas that spot launches count against (Service
Quotas codes L-3819A6DF for G/VT and L-7212CCBC for P; new accounts have 0), the VPC and
subnets the cluster would use, the worker and head images, and the checkpoint bucket. A failing line that would
stop `up` is blocking; a quota that cannot be read is a warning.
"""

from __future__ import annotations

from typing import Any

from spotctl.errors import ProviderError, SpecError
from spotctl.providers.aws.api import SPOT_QUOTA_CODES, error_code
from spotctl.providers.aws.launch import AwsLaunch
from spotctl.providers.aws.offers import AwsOffers
from spotctl.providers.checks import Check, run_check


class AwsChecks(AwsOffers, AwsLaunch):
    """`checks()`: the account's readiness, one Check per line."""

    def checks(self) -> list[Check]:
        out = [run_check("credentials", self._check_identity)]
        if not out[0].ok:
            return out  # every other call would fail the same way
        out.append(run_check("region", self._check_region))
        out.append(self._check_spot_quota())
        out.append(run_check("network", self._check_network))
        out.append(run_check("image (workers)", lambda: self._check_image("worker")))
        out.append(run_check("image (head)", lambda: self._check_image("head")))
        out.append(run_check("checkpoint bucket", self._check_bucket))
        return out

    def _check_bucket(self) -> str:
        bucket = self.bucket_name()
        if self.bucket_exists():
            return f"s3://{bucket}/{self.prefix} (bucket reachable)"
        if self.spec.bucket:
            raise SpecError(f"aws.bucket: bucket {bucket} does not exist (or is not yours)")
        return f"s3://{bucket}/{self.prefix} (bucket created, private, on first up)"

    def _client(self, service: str, endpoint: str = "") -> Any:
        kwargs = dict(self._client_kwargs)
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        return self._session.client(service, **kwargs)

    def _check_identity(self) -> str:
        ident = self._call("who am I (sts)", self._client("sts").get_caller_identity)
        return f"account {ident.get('Account', '?')} as {ident.get('Arn', '?')}"

    def _check_region(self) -> str:
        zones = self._call(
            f"list zones of {self.region}",
            self.ec2.describe_availability_zones,
            Filters=[{"Name": "state", "Values": ["available"]}],
        ).get("AvailabilityZones", [])
        if not zones:
            raise SpecError(f"aws.region: {self.region} has no available zone for this account")
        return f"{self.region}: {len(zones)} zones"

    def _check_spot_quota(self) -> Check:
        """Enough spot vCPU quota for at least one instance of a wanted GPU family."""
        name = "spot GPU quota"
        try:
            types = self._describe_types(self._wanted_types(), strict=False)
        except (ProviderError, SpecError) as e:
            return Check(name, False, " ".join(str(e).split()))
        need: dict[str, tuple[int, str]] = {}  # family -> (fewest vCPUs, that type)
        for t, info in types.items():
            fam = t[0]
            if fam in SPOT_QUOTA_CODES:
                vcpus = int((info.get("VCpuInfo") or {}).get("DefaultVCpus", 0))
                if fam not in need or vcpus < need[fam][0]:
                    need[fam] = (vcpus, t)
        if not need:
            return Check(name, True, "no G or P instance types wanted", blocking=False)
        quotas = self._client(
            "service-quotas", str(self.ctx.options.get("service_quotas_endpoint_url") or "")
        )
        parts, enough, unknown = [], False, False
        for fam, (vcpus, itype) in sorted(need.items()):
            code, title = SPOT_QUOTA_CODES[fam]
            try:
                q = self._call(
                    f"read quota {code}",
                    quotas.get_service_quota,
                    ServiceCode="ec2",
                    QuotaCode=code,
                )
                value = float(q["Quota"]["Value"])
            except ProviderError as e:
                if error_code(e) not in ("NoSuchResourceException", "AccessDeniedException"):
                    raise
                unknown = True
                parts.append(f"{title} ({code}): unreadable ({error_code(e)})")
                continue
            enough = enough or value >= vcpus
            parts.append(f"{title} ({code}): {value:g} vCPUs, {itype} needs {vcpus}")
        detail = "; ".join(parts)
        if enough:
            return Check(name, True, detail)
        if unknown:
            return Check(name, False, detail, blocking=False)
        return Check(
            name,
            False,
            detail + " -- ask for more in the Service Quotas console (EC2, these codes)",
        )

    def _check_network(self) -> str:
        vpc, default = self._vpc()
        if default and not self.spec.subnet_ids:
            return f"default VPC {vpc}"
        self._subnet("")  # raises when the VPC has no usable subnet
        zones = sorted({str(n.get("AvailabilityZone")) for n in self._subnets or []})
        return f"VPC {vpc}, subnets in {', '.join(zones)}"

    def _check_image(self, role: str) -> str:
        ami = self._ami(role)
        self._block_devices(ami, role)  # raises when the image does not exist here
        return ami
