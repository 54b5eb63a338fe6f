"""AWS provider, network and keys: the cluster's security group and key pair.

This module owns what a cluster needs before its first instance: the VPC and the subnet
per zone it launches into (aws.vpc_id, else the default VPC, else the VPC tagged
spotctl:vpc=true; aws.subnet_ids or any subnet of that VPC in the zone), the security group
(SSH only from aws.ssh_cidr or the caller's address, everything else only between
members of the group) in that VPC, and the cluster's key pair (private half kept 0600 in
the cluster dir), both found by tag/name so `prepare` is idempotent.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from spotctl.errors import CapacityError, ProviderError, SpecError
from spotctl.providers.aws.api import (
    KEY_FILE,
    TAG_CLUSTER,
    TAG_VPC,
    AwsApi,
    _coded,
    _tag_map,
    _tags,
    error_code,
)


class AwsNetwork(AwsApi):
    """Security group and key pair of the cluster."""

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

        The provider never looks the caller's address up itself: `up` fills an unset
        ssh_cidr first and says so (spotctl/control/address.py); without one of the two
        it refuses rather than open SSH to the world.
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

    def _vpc(self) -> tuple[str, bool]:
        """(VPC id, is default): aws.vpc_id, else the region's default VPC, else the one
        VPC tagged spotctl:vpc=true (accounts made since 2013 may have deleted theirs)."""
        if self._network is not None:
            return self._network
        if self.spec.vpc_id:
            vpcs = self._call(
                f"find VPC {self.spec.vpc_id} in {self.region}",
                self.ec2.describe_vpcs,
                Filters=[{"Name": "vpc-id", "Values": [self.spec.vpc_id]}],
            ).get("Vpcs", [])
            if not vpcs:
                raise SpecError(f"aws.vpc_id: {self.spec.vpc_id} does not exist in {self.region}")
            self._network = (str(vpcs[0]["VpcId"]), bool(vpcs[0].get("IsDefault")))
            return self._network
        for filters in (
            [{"Name": "isDefault", "Values": ["true"]}],
            [{"Name": f"tag:{TAG_VPC}", "Values": ["true"]}],
        ):
            vpcs = self._call(
                f"find a VPC in {self.region}", self.ec2.describe_vpcs, Filters=filters
            ).get("Vpcs", [])
            if vpcs:
                vpcs.sort(key=lambda v: str(v["VpcId"]))
                self._network = (str(vpcs[0]["VpcId"]), bool(vpcs[0].get("IsDefault")))
                return self._network
        raise SpecError(
            f"aws.vpc_id: {self.region} has no default VPC and no VPC tagged "
            f"{TAG_VPC}=true; set aws.vpc_id (and aws.subnet_ids) or tag one"
        )

    def _subnet(self, zone: str, explicit: bool = False) -> str:
        """The subnet to launch into in `zone` ("" = any zone), or "" to let EC2 use the
        default VPC's default subnet (never with `explicit`: network interfaces named in
        the request need their subnet). A zone without a subnet is no place to launch."""
        vpc, default = self._vpc()
        if default and not self.spec.subnet_ids and not explicit:
            return ""
        if self._subnets is None:
            filters = [{"Name": "vpc-id", "Values": [vpc]}]
            if self.spec.subnet_ids:
                filters.append({"Name": "subnet-id", "Values": list(self.spec.subnet_ids)})
            self._subnets = sorted(
                self._paged(
                    "describe_subnets", f"find subnets of {vpc}", "Subnets", Filters=filters
                ),
                key=lambda n: (str(n.get("AvailabilityZone")), str(n["SubnetId"])),
            )
            if self.spec.subnet_ids:
                missing = set(self.spec.subnet_ids) - {str(n["SubnetId"]) for n in self._subnets}
                if missing:
                    raise SpecError(
                        f"aws.subnet_ids: {', '.join(sorted(missing))} not in {vpc} ({self.region})"
                    )
        usable = [
            n
            for n in self._subnets
            if (not zone or n.get("AvailabilityZone") == zone)
            and int(n.get("AvailableIpAddressCount", 1)) > 0
        ]
        if not usable:
            raise _coded(
                CapacityError(f"aws: no subnet of {vpc} in {zone or self.region} to launch into"),
                "NoSubnet",
            )
        return str(usable[0]["SubnetId"])

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
            gid = str(groups[0]["GroupId"])
            if not self._self_egress(groups[0]):  # a group made before the rule was
                self._allow_self_egress(gid)
            # only `up`, run by the controller, moves it: a reconcile elsewhere (a head's
            # rebalance with the spec it was given) would move it back to an old address
            follow = self.ctx.options.get(FOLLOW_SSH_CIDR)
            if follow and (self.spec.ssh_cidr or self.ctx.options.get("ssh_cidr")):
                self._follow_ssh_cidr(gid, groups[0], self._ssh_cidr())
            return gid
        cidr = self._ssh_cidr()
        vpc, _ = self._vpc()
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
        # torchft's Lighthouse on engine torchft, and the ephemeral ports gloo/NCCL pick
        # between workers) only from the group.
        self._call(
            f"open SSH from {cidr} on {self._group_name}",
            self.ec2.authorize_security_group_ingress,
            GroupId=gid,
            IpPermissions=[
                _ssh_permission(cidr),
                {
                    "IpProtocol": "-1",
                    "UserIdGroupPairs": [{"GroupId": gid, "Description": "cluster members"}],
                },
            ],
        )
        self._allow_self_egress(gid)
        return gid

    @staticmethod
    def _self_egress(group: dict[str, Any]) -> bool:
        """Whether the group lets all traffic out to its own members."""
        return any(p.get("IpProtocol") == "-1"
                   and any(pair.get("GroupId") == group["GroupId"]
                           for pair in p.get("UserIdGroupPairs", []))
                   for p in group.get("IpPermissionsEgress", []))

    def _allow_self_egress(self, gid: str) -> None:
        """All traffic out to the group's own members. EFA needs it beside the inbound
        rule: its traffic is not IP, so the default 0.0.0.0/0 egress rule does not cover
        it (EC2 User Guide, "Prepare an EFA-enabled security group": inbound and outbound
        all traffic to and from the group itself)."""
        try:
            self._call(
                f"let {self._group_name} reach its own members", self.ec2.authorize_security_group_egress,
                GroupId=gid,
                IpPermissions=[{
                    "IpProtocol": "-1",
                    "UserIdGroupPairs": [{"GroupId": gid, "Description": "cluster members (EFA)"}],
                }],
            )
        except ProviderError as e:  # added meanwhile by another run of `up`
            if error_code(e) != "InvalidPermission.Duplicate":
                raise

    def _follow_ssh_cidr(self, gid: str, group: dict[str, Any], cidr: str) -> None:
        """The existing group's SSH rule to `cidr` only: the controller's address (which
        `up` fills ssh_cidr with when unset) moves, and a stale one is revoked."""
        have: set[str] = set()
        for perm in group.get("IpPermissions", []):
            if (perm.get("IpProtocol"), perm.get("FromPort"), perm.get("ToPort")) == ("tcp", 22, 22):
                have.update(r["CidrIp"] for r in perm.get("IpRanges", []))
                have.update(r["CidrIpv6"] for r in perm.get("Ipv6Ranges", []))
        if cidr not in have:
            self._call(
                f"open SSH from {cidr} on {self._group_name}",
                self.ec2.authorize_security_group_ingress,
                GroupId=gid,
                IpPermissions=[_ssh_permission(cidr)],
            )
        for old in sorted(have - {cidr}):
            self._call(
                f"close SSH from {old} on {self._group_name}",
                self.ec2.revoke_security_group_ingress,
                GroupId=gid,
                IpPermissions=[_ssh_permission(old)],
            )

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

    @property
    def _placement_prefix(self) -> str:
        return f"spotctl-{self.ctx.cluster}-"

    def _placement_name(self, zone: str, second: bool = False) -> str:
        return f"{self._placement_prefix}{zone}" + ("-2" if second else "")

    def _placement_group(self, zone: str, second: bool = False) -> str:
        """The cluster's placement group in `zone` (strategy cluster: one zone's nodes
        close together for EFA), created on the first launch there, tagged, found by
        name. One per zone: a cluster group's first instance fixes its zone. `second`:
        the zone's second group, where launches go while the first is out of capacity."""
        name = self._placement_name(zone, second)
        if name in self._placement.values():
            return name
        try:
            found = self._call(f"find placement group {name}", self.ec2.describe_placement_groups,
                               GroupNames=[name]).get("PlacementGroups", [])
        except ProviderError as e:
            if error_code(e) not in ("InvalidPlacementGroup.Unknown",):
                raise
            found = []
        if found:
            if _tag_map(found[0]).get(TAG_CLUSTER) != self.ctx.cluster:
                raise SpecError(
                    f"aws: placement group {name} exists but is not tagged for cluster "
                    f"{self.ctx.cluster}; delete it or pick another cluster name")
        else:
            try:
                self._call(
                    f"create placement group {name}", self.ec2.create_placement_group,
                    GroupName=name, Strategy="cluster",
                    TagSpecifications=[{"ResourceType": "placement-group",
                                        "Tags": _tags({TAG_CLUSTER: self.ctx.cluster})}],
                )
            except ProviderError as e:  # made meanwhile by another launch of this cluster
                if error_code(e) != "InvalidPlacementGroup.Duplicate":
                    raise
        self._placement[f"{zone}/{int(second) + 1}"] = name
        return name

    def _find_placement_groups(self) -> list[dict[str, Any]]:
        return list(self._call(
            f"find placement groups of cluster {self.ctx.cluster}",
            self.ec2.describe_placement_groups, Filters=self._cluster_filter(),
        ).get("PlacementGroups", []))

    def _delete_placement_group(self, name: str) -> None:
        try:
            self._call(f"delete placement group {name}", self.ec2.delete_placement_group,
                       GroupName=name)
        except ProviderError as e:
            if error_code(e) != "InvalidPlacementGroup.Unknown":
                raise
        self._placement = {z: n for z, n in self._placement.items() if n != name}

    def prepare(self) -> None:
        """Security group and key pair of the cluster (idempotent, found by tag/name)."""
        if self._prepared is None:
            self._prepared = (self._ensure_group(), self._ensure_key())


# ctx.options key `up` sets: an existing group's SSH rule is moved to ssh_cidr
FOLLOW_SSH_CIDR = "follow_ssh_cidr"


def _ssh_permission(cidr: str) -> dict[str, Any]:
    """The ingress rule for SSH from one CIDR (IPv4 or IPv6)."""
    if ":" in cidr:
        ranges: dict[str, Any] = {"Ipv6Ranges": [{"CidrIpv6": cidr,
                                                  "Description": "spotctl controller"}]}
    else:
        ranges = {"IpRanges": [{"CidrIp": cidr, "Description": "spotctl controller"}]}
    return {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, **ranges}
