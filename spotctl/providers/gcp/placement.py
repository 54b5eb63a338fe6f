"""GCP fast network: gVNIC on GPU VMs and a compact placement policy per zone.

gVNIC is Google's own virtual NIC: higher bandwidth than VirtIO and required by the newer
families (offers.GVNIC_ONLY). A compact placement policy (a regional resource policy with
`groupPlacementPolicy.collocation: COLLOCATED`) asks GCP to put the VMs that name it close
together in their zone; the families that take one are below (Compute Engine docs,
"Placement policies overview": A2, A3, G2 among the GPU families; VMs must terminate on
host maintenance, as GPU VMs do). Every VM of one policy is in one zone, so the cluster has
one policy per zone, named for both and found by its description.
"""

from __future__ import annotations

from spotctl.providers.gcp.offers import nic_type_for

COMPACT_FAMILIES = ("a2-", "a3-", "g2-")
LABEL_NETWORK = "spotctl-network"  # the VM's network as launched: gvnic-compact, gvnic, virtio


def policy_name(cluster: str, zone: str) -> str:
    return f"spotctl-{cluster}-{zone}"[:63].rstrip("-")


def policy_description(cluster: str) -> str:
    """What marks a policy as the cluster's (resource policies have no labels)."""
    return f"spotctl cluster {cluster}: compact placement"


def network_for(machine_type: str, gpus: int, fast: bool) -> tuple[str, bool]:
    """(nicType, compact placement) for a worker VM: gVNIC on every GPU VM with the fast
    network on (and wherever the family requires it), compact placement where the family
    takes it."""
    nic = "GVNIC" if fast and gpus > 0 else nic_type_for(machine_type)
    return nic, fast and gpus > 0 and machine_type.startswith(COMPACT_FAMILIES)


def label(nic: str, compact: bool) -> str:
    return ("gvnic" if nic == "GVNIC" else "virtio") + ("-compact" if compact else "")


# The 8-GPU A3 types whose GPU-to-GPU bandwidth between VMs comes from extra NICs and
# Google's GPUDirect stack (Compute Engine docs, "Maximize GPU network bandwidth"):
# a3-highgpu-8g and A3 Edge 4 extra NICs with GPUDirect-TCPX, a3-megagpu-8g 8 with
# GPUDirect-TCPXO, A3 Ultra 8 RDMA NICs with GPUDirect-RDMA. spotctl attaches neither the
# NICs nor the plugin, so with the fast network on these types are refused (offers name
# why); with it off they run NCCL over the primary gVNIC.
GPUDIRECT_TCPX = {"a3-highgpu-8g": "GPUDirect-TCPX, 4 extra NICs",
                  "a3-edgegpu-8g": "GPUDirect-TCPX, 4 extra NICs",
                  "a3-edgegpu-8g-nolssd": "GPUDirect-TCPX, 4 extra NICs",
                  "a3-megagpu-8g": "GPUDirect-TCPXO, 8 extra NICs",
                  "a3-ultragpu-8g": "GPUDirect-RDMA, 8 RDMA NICs",
                  "a3-ultragpu-8g-nolssd": "GPUDirect-RDMA, 8 RDMA NICs"}


def gpudirect_refusal(machine_types: list[str]) -> str:
    """The one line that refuses named types whose bandwidth needs GPUDirect's extra NICs
    (with the fast network on), or "" when none of them is named."""
    named = [t for t in machine_types if t in GPUDIRECT_TCPX]
    if not named:
        return ""
    what = "; ".join(f"{t} needs {GPUDIRECT_TCPX[t]}" for t in named)
    return (f"gcp.machine_types: {what}, which spotctl does not set up (its VMs would get "
            "one gVNIC, a fraction of their bandwidth between VMs): set [placement] "
            "fast_network = false to run them over one gVNIC anyway, or pick another type "
            "(a2, g2, a3-highgpu-1g/2g/4g)")


def describe(machine_type: str, gpus: int, fast: bool) -> str:
    """The network a node of this machine type gets, in a few words (plans, status)."""
    nic, compact = network_for(machine_type, gpus, fast)
    words = "gVNIC" if nic == "GVNIC" else "VirtIO"
    if compact:
        return f"{words}, compact placement"
    if not fast and gpus:
        return f"{words} (fast network off: [placement] fast_network = false)"
    return f"{words} (no compact placement for this family)" if gpus else words
