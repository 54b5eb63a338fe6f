"""AWS provider, launch: starting, listing and terminating instances.

This module owns the instance lifecycle calls: the AMI a launch uses, `run_instances`
(spot or on-demand, all or nothing, IMDSv2 with hop limit 1, tags at creation,
ClientToken idempotency), idempotent `launch` by request id, `list` and `terminate` by
cluster tag, the mapping of EC2 instances to spotctl Instances, and
`launch_with_failover`, which walks offers on capacity errors.
"""

from __future__ import annotations

import builtins
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from spotctl.errors import CapacityError, ProviderError, SpecError
from spotctl.providers.aws import efa
from spotctl.providers.aws.api import (
    _ID_CHUNK,
    _NOT_FOUND_CODES,
    LIVE_STATES,
    TAG_CLUSTER,
    TAG_GPUS,
    TAG_NETWORK,
    TAG_ON_DEMAND,
    TAG_PRICE,
    TAG_REQUEST,
    TAG_ROLE,
    _coded,
    _tag_map,
    _tags,
    error_code,
)
from spotctl.providers.aws.network import AwsNetwork
from spotctl.providers.aws.storage import AwsStorage
from spotctl.providers.base import Instance, Offer

_ZONE_ID_RE = re.compile(r"[a-z]{2,4}\d+-az\d+")


def client_token(request_id: str, offer: Offer) -> str:
    """ClientToken for run_instances: the request id, plus the offer it was tried on.

    A failover walk tries several offers under one request id; the same token with other
    parameters would be refused (IdempotentParameterMismatch), so the offer goes into the
    token. Retrying the same offer under the same request id reuses the token, which lets
    EC2 itself return the first call's instances. At most 64 characters.
    """
    digest = hashlib.sha256(f"{offer.zone}/{offer.instance_type}".encode()).hexdigest()[:10]
    return f"{request_id[:53]}-{digest}"


PREVIEW_REQUEST = "preview"  # request id and client token of a previewed request


def network_tag(n_efa: int, placement: str) -> str:
    """The spotctl:network tag (and status's network column): "ena", "efaN", or "efaN"
    with the placement when it is a fallback."""
    if not n_efa:
        return "ena"
    if placement == efa.PLACEMENT_SECOND:
        return f"efa{n_efa}, second placement group"
    if placement == efa.PLACEMENT_NONE:
        return f"efa{n_efa}, no placement group"
    return f"efa{n_efa}"


class AwsLaunch(AwsNetwork, AwsStorage):
    """Instances of the cluster: run, launch, list, terminate."""

    def _ami(self, role: str = "worker") -> str:
        """The AMI for a role: pinned (aws.ami / aws.head_ami) or named by a public SSM
        parameter (aws.ami_ssm_parameter / aws.head_ami_ssm_parameter)."""
        if role == "head":
            if self.spec.head_ami or self.spec.ami:
                return self.spec.head_ami or self.spec.ami
            return self._ssm_ami(self.spec.head_ami_ssm_parameter, "aws.head_ami")
        if self.spec.ami:
            return self.spec.ami
        return self._ssm_ami(self.spec.ami_ssm_parameter, "aws.ami")

    def _ssm_ami(self, name: str, field: str) -> str:
        if name in self._amis:
            return self._amis[name]
        try:
            resp = self._call(f"resolve image parameter {name}", self.ssm.get_parameter, Name=name)
        except ProviderError as e:
            if error_code(e) in ("ParameterNotFound", "ValidationException"):
                raise SpecError(
                    f"{field}: not set, and the SSM parameter {name} does not exist in "
                    f"{self.region}; set {field} or {field}_ssm_parameter"
                ) from None
            raise
        ami = str(resp["Parameter"]["Value"])
        self._amis[name] = ami
        return ami

    def _image(self, ami: str) -> tuple[str, int, str]:
        """(root device, snapshot GB, name) of an AMI, described once; SpecError when the
        image does not exist in this region."""
        if ami not in self._roots:
            images = self._call(
                f"describe image {ami}", self.ec2.describe_images, ImageIds=[ami]
            ).get("Images", [])
            if not images:
                raise SpecError(f"aws.ami: image {ami} not found in {self.region}")
            image = images[0]
            root = str(image.get("RootDeviceName") or "/dev/sda1")
            size = max(
                (
                    int((m.get("Ebs") or {}).get("VolumeSize") or 0)
                    for m in image.get("BlockDeviceMappings", [])
                    if m.get("DeviceName") == root
                ),
                default=0,
            )
            self._roots[ami] = (root, size, str(image.get("Name") or ""))
        return self._roots[ami]

    def _image_owners(self, ami: str) -> list[str]:
        """What IAM's `ec2:Owner` may say of an AMI: its owner's alias ("amazon" for AWS's
        and Canonical's public images) and its owner's account id."""
        images = self._call(
            f"describe image {ami}", self.ec2.describe_images, ImageIds=[ami]
        ).get("Images", [])
        if not images:
            raise SpecError(f"aws.ami: image {ami} not found in {self.region}")
        owners = [str(images[0].get("ImageOwnerAlias") or ""), str(images[0].get("OwnerId") or "")]
        return [o for o in dict.fromkeys(owners) if o]

    def _block_devices(self, ami: str, role: str) -> list[dict[str, Any]]:
        """Root volume sized for the role (workers: aws.root_volume_gb or 100 GB, the head
        20 GB), never below the image's own snapshot; gp3, deleted with the instance."""
        root, minimum, _ = self._image(ami)
        want = (self.spec.root_volume_gb or 100) if role == "worker" else 20
        return [
            {
                "DeviceName": root,
                "Ebs": {
                    "VolumeSize": max(want, minimum),
                    "VolumeType": "gp3",
                    "DeleteOnTermination": True,
                },
            }
        ]

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
                # what the launch gave the node ("efa32", "ena"; "" for the head), and the
                # environment its workers need for it
                "network": tags.get(TAG_NETWORK, ""),
                "node_env": efa.node_env(itype) if tags.get(TAG_NETWORK, "").startswith("efa")
                else {},
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
        placement: str = "",
    ) -> list[Instance]:
        """RunInstances for one role (see `launch_request`); the instances it started."""
        kwargs = self.launch_request(instance_type=instance_type, zone=zone, count=count,
                                     request_id=request_id, token=token, role=role, tags=tags,
                                     spot=spot, placement=placement)
        attempt = 0
        while True:
            try:
                resp = self._call(what, self.ec2.run_instances, **kwargs)
                break
            except ProviderError as e:
                attempt += 1
                just_made = "instance profile" in str(e).lower()
                if error_code(e) == "InvalidParameterValue" and just_made:
                    if self._wait_profile_usable(attempt):
                        continue
                if (error_code(e) == "InvalidParameterCombination"
                        and len(kwargs.get("NetworkInterfaces", [])) > 1):
                    # EC2 refused this type's interface layout: another offer (a plain
                    # type, another zone) may launch, so the walk moves on
                    raise _coded(CapacityError(
                        f"{e} (the interface layout of {instance_type} was refused; "
                        "trying the next offer)"), "InvalidParameterCombination") from None
                raise
        return [self._to_instance(i) for i in resp.get("Instances", [])]

    def launch_request(
        self,
        *,
        instance_type: str,
        zone: str,
        count: int,
        request_id: str,
        token: str,
        role: str,
        tags: dict[str, str],
        spot: bool,
        placement: str = "",
        dry: bool = False,
    ) -> dict[str, Any]:
        """The RunInstances parameters of a launch: `up` sends them, and `check` and
        `up --dry-run` show (and `check` DryRuns) the same for the cluster's first plan.

        `placement` picks where in the zone an EFA worker goes: "" or "group-1" the
        cluster's placement group of the zone, "group-2" its second one, "none" no group
        (the planner's fallbacks after capacity errors, base.Offer.placements).

        With `dry` nothing is made: resources `up` would create first are used where they
        exist, and otherwise stood in for (the VPC's default security group for the
        cluster's, no key pair, placement group or instance profile yet); each stand-in is
        named in `self.dry_notes`.
        """
        self.dry_notes: list[str] = []
        if dry:
            group, key = self._dry_group_and_key()
        else:
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
        ami = self._ami(role)
        # a worker of an EFA type, fast network on: its EFA interfaces, in the cluster's
        # placement group of the zone (or the fallback the plan picked)
        n_efa = efa.efa_count(instance_type) if role == "worker" and self.fast_network else 0
        if role == "worker":
            all_tags[TAG_NETWORK] = network_tag(n_efa, placement)
        kwargs: dict[str, Any] = dict(
            ImageId=ami,
            BlockDeviceMappings=self._block_devices(ami, role),
            InstanceType=instance_type,
            # All or nothing: a launch yields exactly what the plan counted, and a zone
            # that cannot fit the whole count fails over to the next offer.
            MinCount=count,
            MaxCount=count,
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
        if key:
            kwargs["KeyName"] = key
        if zone:
            kwargs["Placement"] = {"AvailabilityZone": zone}
        if n_efa:
            if not zone:
                raise SpecError(f"aws: EFA launches of {instance_type} need a zone")
            del kwargs["SecurityGroupIds"]
            # several interfaces: no public address at launch (EC2 refuses it), an Elastic
            # IP once the node runs (_ensure_public_address)
            kwargs["NetworkInterfaces"] = efa.network_interfaces(
                instance_type, n_efa, self._subnet(zone, explicit=True), group, public=True)
            group_name = self._placement_for(zone, placement, dry)
            if group_name:
                kwargs["Placement"]["GroupName"] = group_name
        elif subnet := self._subnet(zone):
            # Not the default VPC: its subnets do not hand out public addresses by
            # default, and SSH from the controller needs one.
            del kwargs["SecurityGroupIds"]
            kwargs["NetworkInterfaces"] = [
                {
                    "DeviceIndex": 0,
                    "SubnetId": subnet,
                    "Groups": [group],
                    "AssociatePublicIpAddress": True,
                    "DeleteOnTermination": True,
                }
            ]
        if spot:
            kwargs["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        profile = ""
        if role == "worker":
            # Workers reach the cluster's checkpoint prefix, and only it (storage.py).
            profile = self.node_profile
        elif self.ctx.spec.head_rebalances:
            # The head replaces this cluster's lost workers, and can do nothing else.
            profile = self.head_profile
        if profile and dry and not self._profile_exists(profile):
            self.dry_notes.append(f"no instance profile (up makes {profile})")
        elif profile:
            kwargs["IamInstanceProfile"] = {"Name": profile}
        return kwargs

    def _dry_group_and_key(self) -> tuple[str, str]:
        """The cluster's security group and key pair where they exist; else the VPC's
        default group and no key (a dry run makes nothing), said in `dry_notes`."""
        groups = self._find_groups()
        if groups:
            group = str(groups[0]["GroupId"])
        else:
            vpc, _ = self._vpc()
            found = self._call(
                f"find the default security group of {vpc}", self.ec2.describe_security_groups,
                Filters=[{"Name": "vpc-id", "Values": [vpc]},
                         {"Name": "group-name", "Values": ["default"]}],
            ).get("SecurityGroups", [])
            group = str(found[0]["GroupId"]) if found else ""
            self.dry_notes.append(f"security group {group or '?'} (the VPC's default) "
                                  f"stands in for {self._group_name}, which up makes")
        pairs = self._call(
            f"find key pair {self.key_name}", self.ec2.describe_key_pairs,
            Filters=[{"Name": "key-name", "Values": [self.key_name]}],
        ).get("KeyPairs", [])
        if not pairs:
            self.dry_notes.append(f"no key pair (up makes {self.key_name})")
        return group, (self.key_name if pairs else "")

    def _profile_exists(self, name: str) -> bool:
        iam = self._session.client("iam", **self._client_kwargs)
        try:
            self._call(f"find instance profile {name}", iam.get_instance_profile,
                       InstanceProfileName=name)
        except ProviderError as e:
            if error_code(e) == "NoSuchEntity":
                return False
            raise
        return True

    def _placement_for(self, zone: str, placement: str, dry: bool = False) -> str:
        """The placement group name an EFA launch names: the zone's first or second
        cluster group, or "" for none. A dry run names only a group that exists."""
        if placement == efa.PLACEMENT_NONE:
            return ""
        second = placement == efa.PLACEMENT_SECOND
        if not dry:
            return self._placement_group(zone, second=second)
        name = self._placement_name(zone, second)
        if not any(g.get("GroupName") == name for g in self._find_placement_groups()):
            self.dry_notes.append(f"no placement group (up makes {name})")
            return ""
        return name

    def _ensure_public_address(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A running worker launched with several EFA interfaces starts without a public
        address (efa.py): its primary interface gets one of the cluster's Elastic IPs, a
        free one first (a node gone since left it), else a new one, tagged with the
        cluster (`down` releases them). Returns the instance as EC2 describes it after."""
        tags = _tag_map(raw)
        net = tags.get(TAG_NETWORK, "")
        m = re.match(r"efa(\d+)", net)
        count = int(m.group(1)) if m else 0
        if raw.get("PublicIpAddress") or tags.get(TAG_ROLE, "worker") != "worker" \
                or not efa.elastic_ip(str(raw.get("InstanceType", "")), count):
            return raw
        primary = [n for n in raw.get("NetworkInterfaces", [])
                   if int((n.get("Attachment") or {}).get("DeviceIndex", -1)) == 0
                   and int((n.get("Attachment") or {}).get("NetworkCardIndex", 0) or 0) == 0]
        if not primary:
            raise ProviderError(f"aws: {raw['InstanceId']} has no primary network interface "
                                "to give an Elastic IP")
        eni = str(primary[0]["NetworkInterfaceId"])
        for _ in range(3):
            free = [a for a in self._cluster_addresses() if not a.get("AssociationId")]
            if free:
                alloc = str(free[0]["AllocationId"])
            else:
                alloc = str(self._call(
                    f"allocate an Elastic IP for {raw['InstanceId']}", self.ec2.allocate_address,
                    Domain="vpc", TagSpecifications=[{"ResourceType": "elastic-ip", "Tags": _tags(
                        {TAG_CLUSTER: self.ctx.cluster})}])["AllocationId"])
            try:
                self._call(f"give {raw['InstanceId']} its Elastic IP", self.ec2.associate_address,
                           AllocationId=alloc, NetworkInterfaceId=eni, AllowReassociation=False)
                break
            except ProviderError as e:  # taken meanwhile by another node: take another
                if error_code(e) != "Resource.AlreadyAssociated":
                    raise
        again = self._describe([{"Name": "instance-id", "Values": [str(raw["InstanceId"])]}],
                               f"describe {raw['InstanceId']}")
        return again[0] if again else raw

    def _cluster_addresses(self) -> builtins.list[dict[str, Any]]:
        return list(self._call(
            f"find Elastic IPs of cluster {self.ctx.cluster}", self.ec2.describe_addresses,
            Filters=self._cluster_filter()).get("Addresses", []))

    def _release_addresses(self) -> builtins.list[str]:
        """Release the cluster's Elastic IPs (after its instances are gone); one line per
        address still held."""
        left = []
        for a in self._cluster_addresses():
            try:
                self._call(f"release Elastic IP {a.get('PublicIp', '')}",
                           self.ec2.release_address, AllocationId=str(a["AllocationId"]))
            except ProviderError as e:
                if error_code(e) != "InvalidAllocationID.NotFound":
                    left.append(f"Elastic IP {a.get('PublicIp', '')} ({a['AllocationId']}): {e}")
        return left

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
            placement=offer.placement,
        )

    def preview(self, offer: Offer, count: int) -> dict[str, Any]:
        """The RunInstances request `launch(offer, count, ...)` would send, made as a dry
        run (nothing created; the request and client token are placeholders): what
        `check` DryRuns and `up --dry-run --json` shows. `dry_notes` says what stands in
        for resources `up` makes first."""
        return self.launch_request(
            instance_type=offer.instance_type, zone=offer.zone, count=count,
            request_id=PREVIEW_REQUEST, token=PREVIEW_REQUEST, role="worker",
            tags={TAG_PRICE: f"{offer.spot_price:g}",
                  TAG_ON_DEMAND: f"{offer.on_demand_price or 0:g}",
                  TAG_GPUS: str(offer.gpus)},
            spot=True, placement=offer.placement, dry=True)

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
