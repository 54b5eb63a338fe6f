"""The AWS price catalog and Spot Advisor subset shipped in the package.

Both files live in spotctl/data/ and are derived from public snapshots (see
spotctl/data/AWS_SOURCES.md); `python -m spotctl.providers.aws.catalog SHARED_DATA_DIR` rebuilds
them. The catalog gives on-demand prices (the EC2 API has no price call that does not
need the Pricing service) and a snapshot of spot prices for `spotctl prices --catalog`;
the live provider takes spot prices from describe_spot_price_history instead.

Zones: the catalog's zones are zone IDs (`use1-az4`), which name the same physical zone
in every account. The live path uses zone names (`us-east-1a`) from
describe_spot_price_history, and the name-to-ID mapping differs per account, so catalog
offers and live offers never share a zone string. Nothing here joins them by zone; prices
are joined by (instance type, region) only.
"""

from __future__ import annotations

import ast
import csv
import json
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from spotctl.providers.base import Offer

CATALOG_FILE = "aws_gpu_catalog.csv"
ADVISOR_FILE = "aws_spot_advisor.json"
CATALOG_COLUMNS = (
    "instance_type",
    "gpu_name",
    "gpus",
    "gpu_memory_gib",
    "vcpus",
    "memory_gib",
    "on_demand_price",
    "spot_price",
    "region",
    "zone_id",
)
# Families left out of the shipped catalog: nodes run CUDA PyTorch on x86_64 images, so
# AMD GPUs (g4ad) and Graviton hosts (g5g) cannot run them as they are.
EXCLUDED_FAMILIES = ("g4ad", "g5g")
# Families the default worker image supports: the Deep Learning AMI that
# aws.ami_ssm_parameter names (OSS NVIDIA driver, PyTorch 2.9, Ubuntu 24.04) lists G4dn, G5,
# G6, Gr6, G6e, P4d, P4de, P5, P5e, P5en and P6-B200 (not in this catalog); its driver has
# dropped P3 and P3dn (V100). The catalog keeps their prices (the simulator uses them);
# default offers leave them out.
DLAMI_FAMILIES = ("g4dn", "g5", "g6", "gr6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en")
# Spot Advisor interruption-frequency buckets, index = band.
BAND_LABELS = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")


@dataclass(frozen=True)
class CatalogRow:
    instance_type: str
    gpu_name: str  # accelerator name as the catalog spells it, e.g. "A100-80GB"
    gpus: int  # GPUs per instance
    gpu_memory_gib: float  # per GPU
    vcpus: int
    memory_gib: float
    on_demand_price: float | None  # USD/h, None when the source had none
    spot_price: float | None  # USD/h at snapshot time, None when the source had none
    region: str
    zone_id: str  # zone ID, e.g. "use1-az4" (not a zone name)


def _opt_float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _data_text(name: str) -> str:
    return resources.files("spotctl").joinpath("data", name).read_text()


@cache
def catalog() -> tuple[CatalogRow, ...]:
    rows = csv.DictReader(_data_text(CATALOG_FILE).splitlines())
    return tuple(
        CatalogRow(
            instance_type=r["instance_type"],
            gpu_name=r["gpu_name"],
            gpus=int(r["gpus"]),
            gpu_memory_gib=float(r["gpu_memory_gib"]),
            vcpus=int(r["vcpus"]),
            memory_gib=float(r["memory_gib"]),
            on_demand_price=_opt_float(r["on_demand_price"]),
            spot_price=_opt_float(r["spot_price"]),
            region=r["region"],
            zone_id=r["zone_id"],
        )
        for r in rows
    )


@cache
def _advisor() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_data_text(ADVISOR_FILE))
    return data


def regions() -> list[str]:
    return sorted({r.region for r in catalog()})


def instance_types(region: str | None = None) -> list[str]:
    """GPU instance types the catalog knows, in one region or in any."""
    return sorted({r.instance_type for r in catalog() if region is None or r.region == region})


def default_instance_types(region: str | None = None) -> list[str]:
    """The types `up` looks at when aws.instance_types is empty: the catalog's GPU types
    the default Deep Learning AMI runs on."""
    return [t for t in instance_types(region) if t.split(".")[0] in DLAMI_FAMILIES]


def catalog_row(instance_type: str, region: str | None = None) -> CatalogRow | None:
    """Any row for this type (in this region when given): GPU name, count, memory."""
    for r in catalog():
        if r.instance_type == instance_type and (region is None or r.region == region):
            return r
    return None


def on_demand_price(instance_type: str, region: str) -> float | None:
    """On-demand USD/h for this type in this region, None when the catalog has none."""
    for r in catalog():
        if r.instance_type == instance_type and r.region == region and r.on_demand_price:
            return r.on_demand_price
    return None


def interruption_band(instance_type: str, region: str) -> int | None:
    """Spot Advisor bucket 0 (<5%) .. 4 (>20%) for Linux, None when not listed."""
    entry = _advisor()["regions"].get(region, {}).get(instance_type)
    return None if entry is None else int(entry["r"])


def advisor_savings_pct(instance_type: str, region: str) -> int | None:
    """Spot Advisor's typical savings vs on-demand, in %, None when not listed."""
    entry = _advisor()["regions"].get(region, {}).get(instance_type)
    return None if entry is None else int(entry["s"])


def band_label(band: int | None) -> str:
    if band is None or not 0 <= band < len(BAND_LABELS):
        return ""
    return BAND_LABELS[band]


def load_offers(region: str | None = None) -> list[Offer]:
    """Offers at the catalog snapshot's spot prices (zones are zone IDs, see module doc)."""
    out = []
    for r in catalog():
        if r.spot_price is None or (region is not None and r.region != region):
            continue
        out.append(
            Offer(
                provider="aws",
                region=r.region,
                zone=r.zone_id,
                instance_type=r.instance_type,
                gpus=r.gpus,
                gpu_name=r.gpu_name,
                spot_price=r.spot_price,
                on_demand_price=r.on_demand_price,
                interruption_band=interruption_band(r.instance_type, r.region),
                gpu_memory_gib=r.gpu_memory_gib,
            )
        )
    return out


# ---- rebuilding the shipped files from the public snapshots ---------------------------


def _fmt(x: float) -> str:
    return f"{x:g}"


def derive_catalog(source_csv: Path) -> list[dict[str, str]]:
    """Rows of the shipped catalog from skypilot-catalog's aws vms.csv subset.

    p4de.24xlarge has duplicate (type, region, zone) rows that differ only in the GPU
    name inside GpuInfo; only one of each pair carries a SpotPrice, and that one is kept.
    """
    by_key: dict[tuple[str, str, str], dict[str, str]] = {}
    for r in csv.DictReader(source_csv.read_text().splitlines()):
        if r["InstanceType"].split(".")[0] in EXCLUDED_FAMILIES:
            continue
        key = (r["InstanceType"], r["Region"], r["AvailabilityZone"])
        prev = by_key.get(key)
        if prev is not None and prev["SpotPrice"].strip() and not r["SpotPrice"].strip():
            continue
        by_key[key] = r
    out = []
    for r in by_key.values():
        info = ast.literal_eval(r["GpuInfo"]) if r["GpuInfo"].strip() else {}
        gpus = info.get("Gpus") or [{}]
        mem_mib = float(gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0))
        out.append(
            {
                "instance_type": r["InstanceType"],
                "gpu_name": r["AcceleratorName"],
                "gpus": str(int(float(r["AcceleratorCount"]))),
                "gpu_memory_gib": _fmt(round(mem_mib / 1024, 3)),
                "vcpus": str(int(float(r["vCPUs"]))),
                "memory_gib": _fmt(float(r["MemoryGiB"])),
                "on_demand_price": r["Price"].strip(),
                "spot_price": r["SpotPrice"].strip(),
                "region": r["Region"],
                "zone_id": r["AvailabilityZone"],
            }
        )
    return out


def derive_advisor(source_json: Path, rows: list[dict[str, str]]) -> dict[str, Any]:
    """Linux entries of the Spot Advisor feed for the catalog's regions and types."""
    src = json.loads(source_json.read_text())
    wanted_regions = sorted({r["region"] for r in rows})
    wanted_types = {r["instance_type"] for r in rows}
    out_regions: dict[str, dict[str, dict[str, int]]] = {}
    for region in wanted_regions:
        linux = src["spot_advisor"].get(region, {}).get("Linux", {})
        out_regions[region] = {
            t: {"s": int(v["s"]), "r": int(v["r"])}
            for t, v in sorted(linux.items())
            if t in wanted_types
        }
    return {
        "note": "Subset of AWS Spot Advisor data; see AWS_SOURCES.md. "
        "s = savings % vs on-demand, r = index into ranges.",
        "global_rate": src.get("global_rate", ""),
        "ranges": src["ranges"],
        "regions": out_regions,
    }


def rebuild(shared_data: Path, out_dir: Path) -> None:
    rows = derive_catalog(shared_data / "catalog" / "aws_gpu.csv")
    with open(out_dir / CATALOG_FILE, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CATALOG_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    advisor = derive_advisor(shared_data / "spot-advisor" / "spot-advisor-data.json", rows)
    (out_dir / ADVISOR_FILE).write_text(json.dumps(advisor, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    rebuild(Path(sys.argv[1]), Path(__file__).resolve().parents[2] / "data")
