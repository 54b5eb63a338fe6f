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
        ami = self._ami(role)
        # a worker of an EFA type, fast network on: its EFA interfaces, in the cluster's
        # placement group of the zone
        n_efa = efa.efa_count(instance_type) if role == "worker" and self.fast_network else 0
        if role == "worker":
            all_tags[TAG_NETWORK] = f"efa{n_efa}" if n_efa else "ena"
        kwargs: dict[str, Any] = dict(
            ImageId=ami,
            BlockDeviceMappings=self._block_devices(ami, role),
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
        if n_efa:
            if not zone:
                raise SpecError(f"aws: EFA launches of {instance_type} need a zone")
            del kwargs["SecurityGroupIds"]
            kwargs["NetworkInterfaces"] = efa.network_interfaces(
                instance_type, n_efa, self._subnet(zone, explicit=True), group, public=True)
            kwargs["Placement"]["GroupName"] = self._placement_group(zone)
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
        if role == "worker":
            # Workers reach the cluster's checkpoint prefix, and only it (storage.py).
            kwargs["IamInstanceProfile"] = {"Name": self.node_profile}
        elif self.ctx.spec.head_rebalances:
            # The head replaces this cluster's lost workers, and can do nothing else.
            kwargs["IamInstanceProfile"] = {"Name": self.head_profile}
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
                raise
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
