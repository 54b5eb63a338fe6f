"""AWS provider, offers: live spot offers from EC2 and the shipped catalog.

This module owns what can be bought: which GPU instance types to look at (aws.instance_types
or the catalog in spotctl/providers/aws/catalog.py), their descriptions (GPU count, name,
memory; retired catalog types dropped, unknown user-named types refused), the latest spot
price per (type, zone), and turning those into Offers filtered by gpu and zones.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from spotctl.errors import ProviderError, SpecError
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.aws import efa
from spotctl.providers.aws.api import AwsApi, _listed, error_code
from spotctl.providers.base import Offer


class AwsOffers(AwsApi):
    """Spot offers in the cluster's region."""

    def _wanted_types(self) -> list[str]:
        if self.spec.instance_types:
            named = list(dict.fromkeys(self.spec.instance_types))
            default_image = not self.spec.ami and self.spec.ami_ssm_parameter == \
                type(self.spec).model_fields["ami_ssm_parameter"].default
            gpu_families = {t.split(".")[0] for t in catalog_aws.instance_types()}
            bad = [t for t in named if t.split(".")[0] in gpu_families
                   and t.split(".")[0] not in catalog_aws.DLAMI_FAMILIES]
            if default_image and bad:
                raise SpecError(
                    f"aws.instance_types: {', '.join(bad)} cannot run the default Deep "
                    "Learning AMI (it supports "
                    f"{', '.join(catalog_aws.DLAMI_FAMILIES)}); pick one of those or set "
                    "aws.ami to an image with a driver for it"
                )
            return named
        types = catalog_aws.default_instance_types(self.region)
        if not types:
            raise SpecError(
                f"aws.region: the shipped catalog has no GPU types for {self.region!r} "
                f"(it covers {', '.join(catalog_aws.regions())}); set aws.instance_types"
            )
        return types

    def _describe_types(
        self, types: Sequence[str], strict: bool = True
    ) -> dict[str, dict[str, Any]]:
        """Type descriptions by name. `strict=False` drops types EC2 does not know.

        The catalog lists types that AWS has since retired (p3 at the time of writing),
        so its defaults are allowed to shrink; types the user named are not.
        """
        missing = [t for t in types if t not in self._types]
        for i in range(0, len(missing), 100):
            chunk = missing[i : i + 100]
            while chunk:
                try:
                    found = self._paged(
                        "describe_instance_types",
                        f"describe instance types in {self.region}",
                        "InstanceTypes",
                        InstanceTypes=chunk,
                    )
                    break
                except ProviderError as e:
                    if error_code(e) != "InvalidInstanceType":
                        raise
                    unknown = set(re.findall(r"[a-z0-9-]+\.[a-z0-9-]+", _listed(str(e))))
                    if strict or not unknown & set(chunk):
                        raise SpecError(
                            f"aws.instance_types: {str(e).split(': ', 3)[-1]} "
                            f"(region {self.region})"
                        ) from None
                    chunk = [t for t in chunk if t not in unknown]
            else:
                found = []
            for t in found:
                self._types[t["InstanceType"]] = t
        return {t: self._types[t] for t in types if t in self._types}

    def _latest_spot_prices(self, types: Sequence[str]) -> dict[tuple[str, str], float]:
        """Latest price per (type, zone name). StartTime=now returns the current price."""
        now = time.time()
        rows = self._paged(
            "describe_spot_price_history",
            f"read spot prices in {self.region}",
            "SpotPriceHistory",
            InstanceTypes=list(types),
            ProductDescriptions=["Linux/UNIX"],
            StartTime=now,
        )
        latest: dict[tuple[str, str], tuple[Any, float]] = {}
        for r in rows:
            key = (r["InstanceType"], r["AvailabilityZone"])
            ts = r.get("Timestamp")
            prev = latest.get(key)
            if prev is None or (ts is not None and prev[0] is not None and ts > prev[0]):
                latest[key] = (ts, float(r["SpotPrice"]))
        return {k: v[1] for k, v in latest.items()}

    def offers(self) -> list[Offer]:
        """Live spot offers per (type, zone) in the spec's region, filtered by gpu/zones."""
        explicit = bool(self.spec.instance_types)
        types = self._describe_types(self._wanted_types(), strict=explicit)
        gpu_types: dict[str, tuple[str, int, float]] = {}
        for name, info in types.items():
            gpus = (info.get("GpuInfo") or {}).get("Gpus") or []
            if not gpus:
                continue
            archs = info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
            if not explicit and "x86_64" not in archs:
                continue
            g = gpus[0]
            count = sum(int(x.get("Count", 0)) for x in gpus)
            mem = float(g.get("MemoryInfo", {}).get("SizeInMiB", 0)) / 1024
            gpu_types[name] = (str(g.get("Name", "")), count, round(mem, 3))
        if not gpu_types:
            return []
        prices = self._latest_spot_prices(sorted(gpu_types))
        want_gpu = self.spec.gpu.strip().lower()
        zones = set(self.spec.zones)
        out = []
        for (itype, zone), price in sorted(prices.items()):
            if itype not in gpu_types or (zones and zone not in zones):
                continue
            gpu_name, count, mem = gpu_types[itype]
            row = catalog_aws.catalog_row(itype, self.region)
            if want_gpu and want_gpu not in (
                gpu_name.lower(),
                (row.gpu_name.lower() if row else ""),
            ):
                continue
            out.append(
                Offer(
                    provider="aws",
                    region=self.region,
                    zone=zone,
                    instance_type=itype,
                    gpus=count,
                    gpu_name=gpu_name,
                    spot_price=price,
                    on_demand_price=catalog_aws.on_demand_price(itype, self.region),
                    interruption_band=catalog_aws.interruption_band(itype, self.region),
                    gpu_memory_gib=mem,
                    # an EFA worker's placement group, and where it goes when that is full
                    placements=efa.PLACEMENTS if self.fast_network and efa.efa_count(itype)
                    else (),
                )
            )
        return out
