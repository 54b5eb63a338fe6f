"""AWS fast network: EFA interfaces and cluster placement groups, per instance type.

EFA (Elastic Fabric Adapter) is what NCCL needs between GPU nodes on AWS; without it,
NCCL falls back to TCP sockets over the one ENA interface. The table below is the
allow-list: types not in it get one plain interface, and asking for EFA on them is
refused here, before any call (EC2 would refuse the launch).

Layout (EC2 User Guide, "Maximize network bandwidth on instances with multiple network
cards"): the primary interface sits on network card 0, device index 0, and may be an EFA
with ENA (`InterfaceType: efa`), never EFA-only. Every further card gets one interface:
`efa-only` at device index 0 where the type supports EFA-only interfaces, else an EFA
with ENA at device index 1 (the index the guide gives interfaces that carry ENA).

Public addresses: RunInstances takes `AssociatePublicIpAddress` only on a request with
one network interface, the new one at device index 0 (EC2 API reference,
InstanceNetworkInterfaceSpecification: "The public IP address can only be assigned to a
network interface for eth0 ... You cannot specify more than one network interface in the
request"; EC2 answers InvalidParameterCombination otherwise). A type launched with
several EFA interfaces therefore starts without a public address, and its node gets one
of the cluster's Elastic IPs on its primary interface once it runs (launch.py,
`_ensure_public_address`): SSH from the controller and egress (S3, the image's package
mirrors) work on the default VPC and on any subnet routed to an internet gateway, with
no NAT gateway to pay for. Each such node holds one Elastic IP while it runs.
"""

from __future__ import annotations

from typing import Any

from spotctl.errors import SpecError

# instance type -> (EFA interfaces = network cards used, EFA-only interfaces allowed).
# Counts are EC2's DescribeInstanceTypes NetworkInfo.EfaInfo.MaximumEfaInterfaces (the
# tests compare them with the instance-type data moto ships). Only the families the
# default Deep Learning AMI supports (catalog.DLAMI_FAMILIES); EFA-only interfaces on the
# multi-card P5 generation, where each card is one 100-200 Gbps EFA path.
EFA: dict[str, tuple[int, bool]] = {
    **{t: (1, False) for t in (
        "g4dn.8xlarge", "g4dn.12xlarge", "g4dn.16xlarge", "g4dn.metal",
        "g5.8xlarge", "g5.12xlarge", "g5.16xlarge", "g5.24xlarge", "g5.48xlarge",
        "g6.8xlarge", "g6.12xlarge", "g6.16xlarge", "g6.24xlarge", "g6.48xlarge",
        "gr6.8xlarge", "g6e.8xlarge", "g6e.12xlarge", "g6e.16xlarge")},
    "g6e.24xlarge": (2, False),
    "g6e.48xlarge": (4, False),
    "p4d.24xlarge": (4, False),
    "p4de.24xlarge": (4, False),
    "p5.4xlarge": (1, False),
    "p5.48xlarge": (32, True),
    "p5e.48xlarge": (32, True),
    "p5en.48xlarge": (16, True),
}
# Where in a zone an EFA worker goes (base.Offer.placement): the cluster's placement group
# of the zone, its second one, or none; the planner falls back in this order after
# capacity errors and comes back once the first one's back-off ends.
PLACEMENT_FIRST, PLACEMENT_SECOND, PLACEMENT_NONE = "group-1", "group-2", "none"
PLACEMENTS = (PLACEMENT_FIRST, PLACEMENT_SECOND, PLACEMENT_NONE)
# Types whose EFA does GPUDirect RDMA (libfabric's FI_EFA_USE_DEVICE_RDMA).
RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en")


def efa_count(instance_type: str) -> int:
    """EFA interfaces the type takes; 0 for a type without EFA."""
    return EFA.get(instance_type, (0, False))[0]


def elastic_ip(instance_type: str, count: int) -> bool:
    """Whether a node launched with `count` EFA interfaces needs an Elastic IP for its
    public address (several interfaces: the launch may not ask for one)."""
    return count > 1 and efa_count(instance_type) >= count


def network_interfaces(
    instance_type: str, count: int, subnet: str, group: str, public: bool
) -> list[dict[str, Any]]:
    """RunInstances' NetworkInterfaces for `count` EFA interfaces (0: one plain ENA).
    Refuses EFA the type does not have: more than the table allows, or a type without.
    `public` asks for a public address at launch, which EC2 takes only on a request of
    one interface: with several it is left out (the node gets an Elastic IP instead)."""
    most, efa_only = EFA.get(instance_type, (0, False))
    if count > most:
        raise SpecError(
            f"aws: {instance_type} has {most or 'no'} EFA interface{'s' if most != 1 else ''}; "
            f"{count} asked (EFA types: {', '.join(sorted(EFA))})")
    base: dict[str, Any] = {"SubnetId": subnet, "Groups": [group], "DeleteOnTermination": True}
    primary: dict[str, Any] = {**base, "NetworkCardIndex": 0, "DeviceIndex": 0}
    if public and count <= 1:
        primary["AssociatePublicIpAddress"] = True
    if count <= 0:
        return [primary]
    out = [{**primary, "InterfaceType": "efa"}]
    for card in range(1, count):
        if efa_only:
            out.append({**base, "NetworkCardIndex": card, "DeviceIndex": 0,
                        "InterfaceType": "efa-only"})
        else:
            out.append({**base, "NetworkCardIndex": card, "DeviceIndex": 1,
                        "InterfaceType": "efa"})
    return out


def node_env(instance_type: str) -> dict[str, str]:
    """What NCCL's workers need on an EFA node: libfabric's EFA provider (the AWS OFI
    NCCL plugin of the Deep Learning AMI picks it up), GPUDirect RDMA where the type
    has it. Empty for a type without EFA."""
    if not efa_count(instance_type):
        return {}
    env = {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
    if instance_type.split(".", 1)[0] in RDMA_FAMILIES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def describe(instance_type: str, fast: bool) -> str:
    """The network a node of this type gets, in a few words (plans, status)."""
    n = efa_count(instance_type)
    if fast and n > 1:
        return f"EFA x{n}, cluster placement group, Elastic IP"
    if fast and n:
        return f"EFA x{n}, cluster placement group"
    if n:
        return "ENA (fast network off: [placement] fast_network = false)"
    return "ENA (no EFA on this type)"
