"""GCP provider, offers: spot offers from the shipped catalog, and what a shape needs.

This module owns what can be bought (no API calls): the rows of
spotctl/providers/gcp/catalog.py filtered by region, zones, machine types and GPU; the
zones a launch may fail over to (same shape, same region, cheapest first); and the guest
accelerator type a machine needs (none for a2/a3/g2, which bundle their GPUs).
"""

from __future__ import annotations

import builtins

from spotctl.errors import SpecError
from spotctl.providers.base import Offer
from spotctl.providers.gcp import catalog as catalog_gcp
from spotctl.providers.gcp.api import GcpApi


class GcpOffers(GcpApi):
    """Spot offers and GPU shapes."""

    def offers(self) -> builtins.list[Offer]:
        region = None if self.region in ("*", "all") else self.region
        gpu = self.spec.gpu.lower()
        out: builtins.list[Offer] = []
        for r in catalog_gcp.rows(region):
            if self.spec.zones and r.zone not in self.spec.zones:
                continue
            if self.spec.machine_types and r.machine_type not in self.spec.machine_types:
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
