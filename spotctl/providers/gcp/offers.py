"""GCP provider, offers: spot offers from the shipped catalog, and what a shape needs.

This module owns what can be bought and what each shape requires: the rows of
spotctl/providers/gcp/catalog.py filtered by region, zones, machine types and GPU; the
zones a launch may fail over to (same shape, same region, cheapest first); the guest
accelerator type a machine needs (none for a2/a3/g2, which bundle their GPUs); and the
boot disk and NIC a machine family accepts (disk type, gVNIC, the image's minimum size,
read from the image itself).
"""

from __future__ import annotations

import builtins
import re
from functools import partial

from spotctl.errors import SpecError
from spotctl.providers.base import Offer
from spotctl.providers.gcp import catalog as catalog_gcp
from spotctl.providers.gcp.api import GcpApi


class GcpOffers(GcpApi):
    """Spot offers and GPU shapes."""

    def offers(self) -> builtins.list[Offer]:
        """The catalog's Spot shapes the spec wants. With the fast network on, the A3
        types whose bandwidth between VMs needs GPUDirect's extra NICs (which spotctl does
        not set up) are left out, and refused in one line when the spec names them."""
        from spotctl.providers.gcp import placement  # it imports this module

        region = None if self.region in ("*", "all") else self.region
        gpu = gpu_model(self.spec.gpu)
        fast = bool(self.ctx.spec.placement.fast_network)
        if fast and (why := placement.gpudirect_refusal(list(self.spec.machine_types or []))):
            raise SpecError(why)
        out: builtins.list[Offer] = []
        for r in catalog_gcp.rows(region):
            if self.spec.zones and r.zone not in self.spec.zones:
                continue
            if self.spec.machine_types and r.machine_type not in self.spec.machine_types:
                continue
            if fast and r.machine_type in placement.GPUDIRECT_TCPX:
                continue
            if gpu and r.gpu_name.lower() != gpu:
                continue
            out.append(r.to_offer())
        return out

    def _failover_zones(self, offer: Offer) -> builtins.list[str]:
        """The offer's zone first, then other zones of its region selling the same shape."""
        same = [
            r
            for r in catalog_gcp.rows(offer.region)
            if r.machine_type == offer.instance_type
            and r.gpus == offer.gpus
            and r.gpu_name == offer.gpu_name
            and r.zone != offer.zone
            and (not self.spec.zones or r.zone in self.spec.zones)
        ]
        same.sort(key=lambda r: (r.spot_price, r.zone))
        return [offer.zone] + [r.zone for r in same]

    def _guest_accelerator(self, offer: Offer) -> str:
        if offer.instance_type in catalog_gcp.BUNDLED:
            return ""
        accel = catalog_gcp.GUEST_ACCELERATORS.get(offer.gpu_name, "")
        if offer.gpus and not accel:
            raise SpecError(
                f"gcp: {offer.instance_type} with {offer.gpu_name} is not a GPU shape spotctl "
                f"knows (use a2/a3/g2 or n1 with {', '.join(catalog_gcp.GUEST_ACCELERATORS)})"
            )
        return accel

    # ----------------------------------------------------------------- boot disk and NIC

    def _image(self, url: str) -> tuple[str, int]:
        """(self link, minimum disk GB) of an image URL or image-family URL."""
        return self._image_info(url)[:2]

    def image_takes_gvnic(self, url: str) -> bool:
        """The image's guestOsFeatures name GVNIC (GCP refuses a gVNIC VM from one that
        does not)."""
        return self._image_info(url)[2]

    def _image_info(self, url: str) -> tuple[str, int, bool]:
        """(self link, minimum disk GB, GVNIC among its guestOsFeatures), looked up once."""
        cached = self._images.get(url)
        if cached is not None:
            return cached
        m = re.fullmatch(r"(?:.*/)?projects/([^/]+)/global/images/(family/)?([^/]+)", url)
        if m is None:
            raise SpecError(
                f"gcp image {url!r}: expected projects/P/global/images/NAME "
                "or projects/P/global/images/family/FAMILY"
            )
        project, family, name = m.group(1), bool(m.group(2)), m.group(3)
        images = self.clients.images
        fn = (
            partial(images.get_from_family, project=project, family=name, retry=None)
            if family
            else partial(images.get, project=project, image=name, retry=None)
        )
        image = self._call(f"look up image {url}", fn, missing_ok=True)
        if image is None:
            raise SpecError(f"gcp image {url!r}: not found (gcp.image / gcp.head_image)")
        gvnic = any(str(getattr(f, "type_", "")) == "GVNIC"
                    for f in getattr(image, "guest_os_features", None) or [])
        found = (str(image.self_link or url), int(image.disk_size_gb or 10), gvnic)
        self._images[url] = found
        return found

    def _boot_disk(self, zone: str, machine_type: str, role: str) -> tuple[str, str, int]:
        """(image, disk type URL, size GB) for a VM of `machine_type`. The spec's disk
        settings are the workers': the head (an e2 by default, which takes no Hyperdisk)
        gets its family's type and 20 GB."""
        worker = role == "worker"
        image, minimum = self._image(self.spec.image if worker else self.spec.head_image)
        size = (self.spec.disk_gb or 100) if worker else 20
        size = int(self.ctx.options.get("gcp_disk_gb", size))
        kind = (self.spec.disk_type if worker else "") or disk_type_for(machine_type)
        return image, f"zones/{zone}/diskTypes/{kind}", max(size, minimum)


# Families whose VMs take only Hyperdisk boot disks; the others get pd-balanced (pd-standard,
# GCP's default when no type is sent, is refused by g2, a3, c3 and newer families).
HYPERDISK_ONLY = ("a3-ultragpu", "a4-", "c4-", "c4a-", "c4d-", "n4-", "x4-")
# Families that refuse the VirtIO NIC: they need gVNIC (GCP's own virtual NIC).
GVNIC_ONLY = ("a3-", "a4-", "g2-", "c3-", "c3d-", "c4-", "n4-", "h3-")


# GCP's accelerator names that are not the catalog's GPU name with "nvidia-" before it:
# the n1 ones the launch sends (catalog.GUEST_ACCELERATORS), and the bundled families'
_ACCELERATOR_MODELS = {
    **{accel: gpu for gpu, accel in catalog_gcp.GUEST_ACCELERATORS.items()},
    "nvidia-tesla-a100": "A100", "nvidia-a100-80gb": "A100-80GB", "nvidia-h100-80gb": "H100",
    "nvidia-h100-mega-80gb": "H100-MEGA", "nvidia-h200-141gb": "H200",
}  # fmt: skip


def gpu_model(name: str) -> str:
    """[gcp] gpu as the catalog names the model, lowercase ("" = any): the catalog's own
    name ("L4", "a100-80gb") or GCP's accelerator name ("nvidia-l4"); anything else is
    refused in one line naming the models there are."""
    if not name.strip():
        return ""
    key = name.strip().lower()
    model = _ACCELERATOR_MODELS.get(key) or key.removeprefix("nvidia-")
    known = sorted({r.gpu_name for r in catalog_gcp.rows(None)})
    if model.lower() not in {k.lower() for k in known}:
        raise SpecError(f"gcp.gpu: {name!r} is not a GPU model GCP sells as Spot; one of "
                        f"{', '.join(known)} (or its accelerator name, e.g. nvidia-l4)")
    return model.lower()


def disk_type_for(machine_type: str) -> str:
    return "hyperdisk-balanced" if machine_type.startswith(HYPERDISK_ONLY) else "pd-balanced"


def nic_type_for(machine_type: str) -> str:
    """"GVNIC" where the family requires it, else "" (GCP's default VirtIO)."""
    return "GVNIC" if machine_type.startswith(GVNIC_ONLY) else ""
