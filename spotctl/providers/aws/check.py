"""AWS provider, pre-flight checks: what a new account lacks before `up` spends anything.

This module owns `spotctl check --provider aws`: one line each for credentials (STS), the
region (its zones), the spot GPU vCPU quotas that spot launches count against (Service
Quotas codes L-3819A6DF for G/VT, L-7212CCBC for P2-P4, L-C4BD4855 for the P5 generation;
new accounts have 0) minus the
spot vCPUs already running, against what the cluster's gpus.min takes, the VPC and
subnets the cluster would use, the worker and head images, a dry-run launch of exactly
the request `up` sends for the cluster's first plan (AwsLaunch.preview: tags, subnet,
interfaces, placement group, instance profile, image; IAM, and a new account's
PendingVerification), and the checkpoint bucket. A failing line that would
stop `up` is blocking; a quota that cannot be read is a warning.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spotctl.errors import AuthError, ProviderError, SpecError, SpotctlError
from spotctl.providers.aws import efa
from spotctl.providers.aws.api import (
    ELASTIC_IP_QUOTA,
    SPOT_QUOTA_CODES,
    error_code,
    quota_family,
)
from spotctl.providers.aws.launch import AwsLaunch
from spotctl.providers.aws.offers import AwsOffers
from spotctl.providers.checks import Check, jsonable, run_check
from spotctl.remote.package import image_torch


class AwsChecks(AwsOffers, AwsLaunch):
    """`checks()`: the account's readiness, one Check per line."""

    def checks(self) -> list[Check]:
        out = [run_check("credentials", self._check_identity)]
        if not out[0].ok:
            return out  # every other call would fail the same way
        out.append(run_check("region", self._check_region))
        out.append(self._check_spot_quota())
        eips = self._check_elastic_ips()
        if eips is not None:
            out.append(eips)
        out.append(run_check("network", self._check_network))
        out.append(run_check("GPU network", self._check_gpu_network))
        image = run_check("image (workers)", lambda: self._check_image("worker"))
        out.append(image)
        out.append(run_check("image (head)", lambda: self._check_image("head")))
        out.append(self._run_launch_check() if image.ok else
                   Check("launch (dry run)", False, "not tried without a worker image",
                         blocking=False))  # fmt: skip
        out.append(run_check("checkpoint bucket", self._check_bucket))
        return out

    def _run_launch_check(self) -> Check:
        try:
            return self._check_launch()
        except SpotctlError as e:
            return Check("launch (dry run)", False, " ".join(str(e).split()))

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

    def _quota_need(self, types: dict[str, dict[str, Any]]) -> dict[str, tuple[int, str, int]]:
        """Per quota family: (vCPUs that gpus.min GPUs take on its wanted type needing
        the fewest, that type, how many instances)."""
        want = max(1, self.ctx.spec.gpus.min)
        need: dict[str, tuple[int, str, int]] = {}
        for t, info in types.items():
            fam = quota_family(t)
            gpus = sum(int(g.get("Count", 0)) for g in (info.get("GpuInfo") or {}).get("Gpus") or [])
            if fam not in SPOT_QUOTA_CODES or gpus <= 0:
                continue
            count = -(-want // gpus)
            vcpus = count * int((info.get("VCpuInfo") or {}).get("DefaultVCpus", 0))
            if fam not in need or vcpus < need[fam][0]:
                need[fam] = (vcpus, t, count)
        return need

    def _spot_vcpus_in_use(self) -> dict[str, int]:
        """vCPUs of this region's pending and running spot instances, per quota family:
        what the spot quota already counts (other clusters and other tools included)."""
        raw = self._describe(
            [{"Name": "instance-state-name", "Values": ["pending", "running"]}],
            f"count spot instances in {self.region}",
        )
        spot = [i for i in raw if i.get("InstanceLifecycle") == "spot"
                and quota_family(str(i.get("InstanceType", "")))]  # fmt: skip
        types = self._describe_types(sorted({str(i["InstanceType"]) for i in spot}), strict=False)
        used: dict[str, int] = {}
        for i in spot:
            t = str(i["InstanceType"])
            vcpus = int((types.get(t, {}).get("VCpuInfo") or {}).get("DefaultVCpus", 0))
            used[quota_family(t)] = used.get(quota_family(t), 0) + vcpus
        return used

    def _check_spot_quota(self) -> Check:
        """Enough spot vCPU quota left (the limit minus the spot vCPUs running now) for the
        cluster's minimum GPUs (gpus.min) on at least one wanted GPU family."""
        name = "spot GPU quota"
        try:
            need = self._quota_need(self._describe_types(self._wanted_types(), strict=False))
            used = self._spot_vcpus_in_use() if need else {}
        except (ProviderError, SpecError) as e:
            return Check(name, False, " ".join(str(e).split()))
        if not need:
            return Check(name, True, "no G or P instance types wanted", blocking=False)
        quotas = self._client(
            "service-quotas", str(self.ctx.options.get("service_quotas_endpoint_url") or "")
        )
        want = max(1, self.ctx.spec.gpus.min)
        parts, enough, unknown = [], False, False
        for fam, (vcpus, itype, count) in sorted(need.items()):
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
            free = value - used.get(fam, 0)
            enough = enough or free >= vcpus
            parts.append(f"{title} ({code}): {value:g} vCPUs, {used.get(fam, 0)} in use, "
                         f"gpus.min {want} needs {vcpus} ({count} x {itype})")  # fmt: skip
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

    def _check_elastic_ips(self) -> Check | None:
        """Elastic IPs left (quota minus those allocated) for gpus.min on the wanted types
        launched with several EFA interfaces, each node of which holds one (efa.py);
        None when no such type is wanted."""
        name = "Elastic IP quota"
        try:
            types = self._describe_types(self._wanted_types(), strict=False)
        except (ProviderError, SpecError):
            return None
        want = max(1, self.ctx.spec.gpus.min)
        nodes: dict[str, int] = {}
        for t, info in types.items():
            gpus = sum(int(g.get("Count", 0))
                       for g in (info.get("GpuInfo") or {}).get("Gpus") or [])
            if self.fast_network and gpus and efa.elastic_ip(t, efa.efa_count(t)):
                nodes[t] = -(-want // gpus)
        if not nodes:
            return None
        itype, need = min(nodes.items(), key=lambda kv: (kv[1], kv[0]))
        only = len(nodes) == len(types)  # every wanted type needs them
        code, title = ELASTIC_IP_QUOTA
        quotas = self._client(
            "service-quotas", str(self.ctx.options.get("service_quotas_endpoint_url") or ""))
        try:
            used = len(self._call(f"count Elastic IPs in {self.region}",
                                  self.ec2.describe_addresses).get("Addresses", []))
            value = float(self._call(f"read quota {code}", quotas.get_service_quota,
                                     ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ProviderError as e:
            return Check(name, False, f"{title} ({code}): unreadable ({error_code(e) or e}); "
                         f"gpus.min {want} on {itype} needs {need}", blocking=False)
        detail = (f"{title} ({code}): {value:g}, {used} allocated; gpus.min {want} on "
                  f"{itype} needs {need} (one per node with several EFA interfaces)")
        if value - used >= need:
            return Check(name, True, detail)
        return Check(name, False, detail + " -- ask for more in the Service Quotas console "
                     "(EC2, this code)", blocking=only)

    def _check_launch(self) -> Check:
        """RunInstances with DryRun of the request `up` would send first: the first plan's
        launch (ctx.options["first_launch"], from the planner) built by the same code as
        `up`'s (preview), for the spec's cluster name. The identity may launch it (the IAM
        policy's tag conditions see the cluster tag), the account may launch at all (a new
        one is refused with PendingVerification for a while), and EC2 takes the request's
        shape (interfaces, placement, profile)."""
        name = "launch (dry run)"
        first = self.ctx.options.get("first_launch")
        offers = self.offers()
        if callable(first):
            pick = first(offers)
        else:  # a provider made without `check`'s planner: the cheapest offer, one node
            best = min(offers, key=lambda o: (o.price_per_gpu_hour, o.zone, o.instance_type),
                       default=None)
            pick = (best, 1) if best is not None else None
        if pick is None:
            return Check(name, False, "the first plan launches nothing here (no offer fits "
                         "the spec), so no request to try", blocking=False)
        offer, count = pick
        twin = type(self)(replace(self.ctx, cluster=self.ctx.spec.name))
        req = twin.preview(offer, count)
        what = f"{count} x {offer.instance_type} (spot) in {offer.zone}"
        try:
            self._call(f"dry-run launch of {what}", self.ec2.run_instances, DryRun=True, **req)
        except ProviderError as e:
            code = error_code(e)
            if code == "PendingVerification":
                raise AuthError(
                    "AWS is still verifying this new account (PendingVerification): no "
                    "instance can start until it is done, usually within minutes, at most 4 "
                    "hours; wait, or open a case with AWS Support if it takes longer"
                ) from None
            if code == "UnauthorizedOperation":
                raise AuthError(
                    f"this identity may not launch {what} as `up` asks "
                    "(UnauthorizedOperation: RunInstances with the cluster's tags, subnet, "
                    "interfaces, placement group and instance profile, which needs "
                    "iam:PassRole; the template allows its GPU families and t3 only, from "
                    "images owned by amazon: add your type, or your account's id to ec2:Owner "
                    f"for image {req.get('ImageId', '')}): attach the policy in "
                    "templates/aws-iam-policy.json to it"
                ) from None
            if code != "DryRunOperation":
                raise
        nics = req.get("NetworkInterfaces", [])
        parts = [f"the first plan's {what} would be allowed",
                 f"{len(nics)} interface(s)" if nics else "the default subnet's interface",
                 f"placement group {req['Placement']['GroupName']}"
                 if req.get("Placement", {}).get("GroupName") else "no placement group",
                 f"profile {req['IamInstanceProfile']['Name']}"
                 if req.get("IamInstanceProfile") else "no profile"]
        if twin.dry_notes:
            parts.append("stand-ins until up makes them: " + "; ".join(twin.dry_notes))
        return Check(name, True, ", ".join(parts), data={"request": jsonable(req)})

    def _check_network(self) -> str:
        vpc, default = self._vpc()
        if default and not self.spec.subnet_ids:
            return f"default VPC {vpc}"
        self._subnet("")  # raises when the VPC has no usable subnet
        zones = sorted({str(n.get("AvailabilityZone")) for n in self._subnets or []})
        return f"VPC {vpc}, subnets in {', '.join(zones)}"

    def _existing_wanted_types(self) -> dict[str, dict[str, Any]]:
        """EC2's descriptions of the wanted types that exist in the region; none raises."""
        types = self._describe_types(self._wanted_types(), strict=False)
        if not types:
            raise SpecError(f"aws.instance_types: none of the wanted types exists in {self.region}")
        return types

    def _check_gpu_network(self) -> str:
        """Per wanted type, the network its workers get (as `up --dry-run` says), checked
        against EC2's own description of the type in this region: where spotctl asks for
        EFA interfaces, EC2 must say the type supports at least that many (else the launch
        would be refused)."""
        types = self._existing_wanted_types()
        parts, short = [], []
        for t in sorted(types):
            want = efa.efa_count(t) if self.fast_network else 0
            net = types[t].get("NetworkInfo") or {}
            has = int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0)) \
                if net.get("EfaSupported") else 0
            if want > has:
                short.append(f"{t}: EFA x{want} asked, EC2 in {self.region} says "
                             f"{f'at most {has}' if has else 'no EFA'}")
            parts.append(f"{t}: {efa.describe(t, self.fast_network)}")
        if short:
            raise SpecError("; ".join(short) + " (set [placement] fast_network = false to "
                            "launch with one plain interface)")
        return "; ".join(parts)

    def _check_image(self, role: str) -> str:
        ami = self._ami(role)
        _, _, name = self._image(ami)  # raises when the image does not exist here
        if role != "worker":
            return ami
        # the workers' torch, as a Deep Learning AMI's name (or its SSM parameter) says it
        param = "" if self.spec.ami else self.spec.ami_ssm_parameter
        note = image_torch(name) or image_torch(param)
        return ami + (f" ({name})" if name else "") + (f"; {note}" if note else "")
