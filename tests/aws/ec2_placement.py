"""What moto's EC2 lacks for the fast network, added to the moto server the tests run.

moto (5.x) has no placement groups at all (Create/Describe/DeletePlacementGroup answer
500), and its RunInstances takes any network interface list on any type, keeping the
first interface only. Real EC2 refuses, and so does this extension (installed on moto's
EC2 response class, so it serves every client of the in-process moto server):

- placement groups: create (tags at creation), describe (by name or tag filter; an
  unknown name is InvalidPlacementGroup.Unknown), delete (refused while a live instance
  is in it: InvalidPlacementGroup.InUse); a duplicate name is InvalidPlacementGroup.Duplicate.
- RunInstances into a group: the group must exist, and a cluster group holds one zone
  (the zone of its first instance).
- RunInstances' network interfaces, checked against the type's data moto ships (EC2's
  DescribeInstanceTypes): EFA interface types only on types with EFA, no more than
  MaximumEfaInterfaces, network cards within MaximumNetworkCards, one interface per
  (card, device), an EFA-only interface never the primary (card 0, device 0), and no
  AssociatePublicIpAddress on a request of several interfaces (EC2 API reference,
  InstanceNetworkInterfaceSpecification.AssociatePublicIpAddress: "can only be assigned
  to a network interface for eth0 ... You cannot specify more than one network interface
  in the request"; EC2 answers InvalidParameterCombination, "The associatePublicIPAddress
  parameter cannot be specified when launching with multiple network interfaces"). They
  are checked before a DryRun is answered (that a real DryRun sees the interface rules
  too is what only a real account can confirm; docs/getting-started/aws.md).
- Placement groups that fill up: `GROUP_ROOM[name] = n` lets a group hold n live
  instances; a launch that would go beyond is refused with InsufficientInstanceCapacity,
  as EC2 often answers when capacity is added to a cluster group later (EC2 User Guide,
  "Placement groups": "If you try to add more instances to the placement group later ...
  there is a chance of getting an insufficient capacity error").

`efa_connect(ec2, a, b)` is the two-node NCCL-over-EFA stand-in: it "connects" instance a
to b only as EFA would, which needs a's group to let all traffic out to b's group and b's
group to let all traffic in from a's (EFA's traffic is not IP: a 0.0.0.0/0 egress rule does
not cover it; EC2 User Guide, "Prepare an EFA-enabled security group"), and raises
`EfaRefused` otherwise (where NCCL over aws-ofi-nccl fails its first handshake).

Every RunInstances request's parameters are kept in `REQUESTS` (newest last), so tests
can compare a launch with the documented request shape.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

GROUPS: dict[str, dict[str, Any]] = {}  # name -> {"id", "strategy", "tags", "zone", "ids"}
REQUESTS: list[dict[str, Any]] = []
GROUP_ROOM: dict[str, int] = {}  # placement group -> live instances it holds at most
_lock = threading.Lock()
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from moto.core.responses import ActionResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.instance_types import INSTANCE_TYPES
    from moto.ec2.responses import EC2Response

    def refuse(code: str, msg: str) -> None:
        raise EC2ClientError(code, msg)

    def _describe(name: str, g: dict[str, Any]) -> dict[str, Any]:
        return {"GroupName": name, "GroupId": g["id"], "Strategy": g["strategy"],
                "State": "available", "Tags": [{"Key": k, "Value": v}
                                               for k, v in g["tags"].items()]}

    def create_placement_group(self: Any) -> Any:
        name = self._get_param("GroupName")
        strategy = self._get_param("Strategy")
        if strategy not in ("cluster", "spread", "partition"):
            refuse("InvalidParameterValue", f"Value ({strategy}) for parameter strategy is invalid")
        tags: dict[str, str] = {}
        for spec in self._get_param("TagSpecifications", []) or []:
            if spec.get("ResourceType") == "placement-group":
                tags.update({t["Key"]: t["Value"] for t in spec.get("Tags", [])})
        with _lock:
            if name in GROUPS:
                refuse("InvalidPlacementGroup.Duplicate",
                       f"The Placement Group '{name}' already exists.")
            GROUPS[name] = {"id": f"pg-{uuid.uuid4().hex[:17]}", "strategy": strategy,
                            "tags": tags, "zone": "", "ids": set()}
            return ActionResult({"PlacementGroup": _describe(name, GROUPS[name])})

    def describe_placement_groups(self: Any) -> Any:
        names = self._get_param("GroupNames", []) or []
        filters = self._get_param("Filters", []) or []
        with _lock:
            for n in names:
                if n not in GROUPS:
                    refuse("InvalidPlacementGroup.Unknown",
                           f"The Placement Group '{n}' is unknown.")
            out = []
            for name, g in sorted(GROUPS.items()):
                if names and name not in names:
                    continue
                ok = True
                for f in filters:
                    key, values = f.get("Name", ""), f.get("Values", [])
                    if key.startswith("tag:"):
                        ok = ok and g["tags"].get(key[4:]) in values
                    elif key == "group-name":
                        ok = ok and name in values
                    else:
                        refuse("InvalidParameterValue", f"The filter '{key}' is invalid")
                if ok:
                    out.append(_describe(name, g))
            return ActionResult({"PlacementGroups": out})

    def delete_placement_group(self: Any) -> Any:
        name = self._get_param("GroupName")
        with _lock:
            g = GROUPS.get(name)
            if g is None:
                refuse("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
            live = [i for i in g["ids"] if _alive(self, i)]
            if live:
                refuse("InvalidPlacementGroup.InUse",
                       f"The placement group '{name}' is in use and may not be deleted.")
            del GROUPS[name]
        return ActionResult({})

    original_run = EC2Response.run_instances

    def run_instances(self: Any) -> Any:
        itype = self._get_param("InstanceType", "m1.small")
        zone = self._get_param("Placement.AvailabilityZone") or ""
        group = self._get_param("Placement.GroupName") or ""
        nics = self._get_param("NetworkInterfaces", []) or []
        with _lock:
            REQUESTS.append({"InstanceType": itype, "Placement": {"AvailabilityZone": zone,
                                                                   "GroupName": group},
                             "NetworkInterfaces": nics})
        _check_nics(itype, nics, INSTANCE_TYPES.get(itype, {}), refuse)
        if group:
            with _lock:
                g = GROUPS.get(group)
                if g is None:
                    refuse("InvalidPlacementGroup.Unknown",
                           f"The Placement Group '{group}' is unknown.")
                if g["strategy"] == "cluster" and g["zone"] and zone and zone != g["zone"]:
                    refuse("InvalidParameterCombination",
                           f"Placement group '{group}' is in {g['zone']}: a cluster placement "
                           f"group cannot span Availability Zones (asked: {zone})")
                room = GROUP_ROOM.get(group)
                count = int(self._get_param("MinCount", 1) or 1)
                if room is not None and self._get_param("DryRun") not in (True, "true"):
                    live = len([i for i in g["ids"] if _alive(self, i)])
                    if live + count > room:
                        refuse("InsufficientInstanceCapacity",
                               f"We currently do not have sufficient {itype} capacity in the "
                               f"placement group '{group}' you requested.")
        result = original_run(self)
        if len(nics) > 1 and self._get_param("DryRun") not in (True, "true"):
            # EC2 assigns no public address to an instance launched with several
            # interfaces (moto would, from the default subnet's MapPublicIpOnLaunch)
            for inst in result.result.instances:
                inst.nics[0].public_ip = None
        if group:
            res = result.result
            with _lock:
                g = GROUPS[group]
                for inst in res.instances:
                    g["ids"].add(inst.id)
                    g["zone"] = g["zone"] or inst.placement.zone
                    inst.placement.group_name = group  # DescribeInstances shows it
        return result

    def _alive(self: Any, instance_id: str) -> bool:
        try:
            (inst,) = self.ec2_backend.get_multi_instances_by_id([instance_id])
        except Exception:  # noqa: BLE001 - gone from moto: not in use
            return False
        return inst.state not in ("terminated",)

    original_terminate = EC2Response.terminate_instances

    def terminate_instances(self: Any) -> Any:
        # EC2 deletes a terminated instance's interfaces (DeleteOnTermination) and with
        # them any Elastic IP association; moto keeps the association
        result = original_terminate(self)
        ids = set(self._get_param("InstanceIds", []) or [])
        for eip in list(self.ec2_backend.addresses):
            eni = eip.eni
            owner = eip.instance or (eni.instance if eni is not None else None)
            if eip.association_id and owner is not None and owner.id in ids:
                self.ec2_backend.disassociate_address(association_id=eip.association_id)
        return result

    EC2Response.terminate_instances = terminate_instances
    EC2Response.create_placement_group = create_placement_group
    EC2Response.describe_placement_groups = describe_placement_groups
    EC2Response.delete_placement_group = delete_placement_group
    EC2Response.run_instances = run_instances
    _installed = True


def _check_nics(itype: str, nics: list[dict[str, Any]], data: dict[str, Any], refuse: Any) -> None:
    net = data.get("NetworkInfo", {})
    cards = int(net.get("MaximumNetworkCards", 1) or 1)
    efa_most = int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0) or 0)
    seen: set[tuple[int, int]] = set()
    efa = 0
    if len(nics) > 1 and any("AssociatePublicIpAddress" in n for n in nics):
        refuse("InvalidParameterCombination",
               "The associatePublicIPAddress parameter cannot be specified when launching "
               "with multiple network interfaces.")
    for nic in nics:
        kind = nic.get("InterfaceType", "interface") or "interface"
        card = int(nic.get("NetworkCardIndex", 0) or 0)
        dev = int(nic.get("DeviceIndex", 0) or 0)
        if kind not in ("interface", "efa", "efa-only", "trunk"):
            refuse("InvalidParameterValue", f"Value ({kind}) for parameter interfaceType is invalid")
        if card >= cards:
            refuse("InvalidParameterValue",
                   f"Network card index {card} is out of range for {itype} ({cards} cards)")
        if (card, dev) in seen:
            refuse("InvalidParameterValue",
                   f"Each network interface requires a unique device index and network card "
                   f"index ({card}, {dev})")
        seen.add((card, dev))
        if kind in ("efa", "efa-only"):
            efa += 1
            if not net.get("EfaSupported"):
                refuse("InvalidParameterCombination",
                       f"The instance type {itype} does not support Elastic Fabric Adapter")
        if kind == "efa-only" and (card, dev) == (0, 0):
            refuse("InvalidParameterCombination",
                   "An EFA-only network interface cannot be the primary network interface")
    if efa > efa_most:
        refuse("InvalidParameterCombination",
               f"{itype} supports at most {efa_most} EFA interfaces ({efa} given)")


class EfaRefused(Exception):
    """What NCCL over EFA meets where the security groups do not let EFA through."""


def efa_connect(ec2: Any, a: str, b: str) -> None:
    """Instance a "connects" to b over EFA, or EfaRefused says which rule is missing."""
    insts = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=[a, b])["Reservations"]
             for i in r["Instances"]}
    groups_of = {k: {g["GroupId"] for g in v.get("SecurityGroups", [])}
                 | {g["GroupId"] for n in v.get("NetworkInterfaces", []) for g in n.get("Groups", [])}
                 for k, v in insts.items()}
    rules = {g["GroupId"]: g for g in ec2.describe_security_groups(
        GroupIds=sorted(groups_of[a] | groups_of[b]))["SecurityGroups"]}

    def allows(perms: list[dict[str, Any]], peers: set[str]) -> bool:
        # all traffic to/from a peer's group: CIDR rules do not carry EFA (not IP)
        return any(p.get("IpProtocol") == "-1"
                   and {x["GroupId"] for x in p.get("UserIdGroupPairs", [])} & peers
                   for p in perms)

    for src, dst in ((a, b), (b, a)):
        if not any(allows(rules[g].get("IpPermissionsEgress", []), groups_of[dst])
                   for g in groups_of[src]):
            raise EfaRefused(f"{src} -> {dst}: no egress rule to the peer's security group "
                             "(NET/OFI fi_connect failed: the EFA handshake never left)")
        if not any(allows(rules[g].get("IpPermissions", []), groups_of[src])
                   for g in groups_of[dst]):
            raise EfaRefused(f"{src} -> {dst}: no ingress rule from the peer's security group")
