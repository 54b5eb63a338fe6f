"""The GCP GPU price catalog shipped in the package, and how it was derived.

GCP prices a GPU VM in two parts: the host (vCPU + memory of the machine type) and the
GPUs. The public catalog we derive from (see spotctl/data/GCP_SOURCES.md) lists the two
parts as separate rows, so a full VM price is host row + GPU row for the same zone:

- a2 / a3 / g2 machine types have their GPUs bundled: the machine type fixes the GPU
  model and count (table `BUNDLED`), so the join is exact.
- n1 takes T4 / V100 as guest accelerators; we pair each GPU count with one n1-standard
  host size (table `N1_HOST`) whose host rows come from the same source file and commit.

`derive()` builds the shipped CSV from the three source files; `load_offers()` reads the
shipped CSV and is all the provider and `spotctl prices` need at run time.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path

from spotctl.providers.base import Offer

CATALOG_FILE = "gcp_gpu_catalog.csv"
N1_HOSTS_FILE = "gcp_n1_hosts.csv"

# Machine type -> (GPU name in the source's AcceleratorName column, GPUs per VM).
BUNDLED: dict[str, tuple[str, int]] = {
    **{f"a2-highgpu-{n}g": ("A100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("A100", 16),
    **{f"a2-ultragpu-{n}g": ("A100-80GB", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("H100", n) for n in (1, 2, 4, 8)},
    # A3 Edge carries the same 8 x H100 80GB as a3-highgpu-8g (its host price matches too).
    "a3-edgegpu-8g": ("H100", 8),
    "a3-edgegpu-8g-nolssd": ("H100", 8),
    "a3-megagpu-8g": ("H100-MEGA", 8),
    "a3-ultragpu-8g": ("H200", 8),
    "a3-ultragpu-8g-nolssd": ("H200", 8),
    **{f"g2-standard-{n}": ("L4", 1) for n in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("L4", 2),
    "g2-standard-48": ("L4", 4),
    "g2-standard-96": ("L4", 8),
}

# GPU name -> Compute Engine accelerator type, for GPUs attached to n1 as guest accelerators.
GUEST_ACCELERATORS: dict[str, str] = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100"}

# GPUs per VM -> n1 host. 8 vCPU per GPU stays inside every per-count vCPU limit GCP sets
# for T4 and V100 (V100: 12/24/48/96 max for 1/2/4/8 GPUs; T4: 48/48/96 for 1/2/4).
N1_HOST: dict[int, str] = {
    1: "n1-standard-8",
    2: "n1-standard-16",
    4: "n1-standard-32",
    8: "n1-standard-64",
}


@dataclass(frozen=True)
class CatalogRow:
    """One purchasable GPU VM shape in one zone, with both halves of its price."""

    machine_type: str  # e.g. "a2-highgpu-1g", "n1-standard-8"
    gpu_name: str  # e.g. "A100", "T4"
    gpus: int  # GPUs per VM
    guest_accelerator: str  # "" when bundled in the machine type, else e.g. "nvidia-tesla-t4"
    vcpus: float
    memory_gib: float
    gpu_memory_gib: float  # per GPU
    region: str
    zone: str
    on_demand_price: float  # USD/h, host + GPUs
    spot_price: float  # USD/h, host + GPUs
    host_on_demand: float  # the host half, as in the source
    host_spot: float
    gpu_on_demand: float  # the GPU half, as in the source
    gpu_spot: float

    def to_offer(self) -> Offer:
        return Offer(
            provider="gcp",
            region=self.region,
            zone=self.zone,
            instance_type=self.machine_type,
            gpus=self.gpus,
            gpu_name=self.gpu_name,
            spot_price=self.spot_price,
            on_demand_price=self.on_demand_price,
            gpu_memory_gib=self.gpu_memory_gib,
        )


def _float(s: str) -> float | None:
    s = (s or "").strip()
    return float(s) if s else None


def _gpu_memory_gib(info: str) -> float:
    """GpuInfo looks like "{'Gpus': [{'MemoryInfo': {'SizeInMiB': 16384}}]}"."""
    if not info:
        return 0.0
    try:
        data = ast.literal_eval(info)
        return float(data["Gpus"][0]["MemoryInfo"]["SizeInMiB"]) / 1024.0
    except (ValueError, SyntaxError, KeyError, IndexError, TypeError):
        return 0.0


def derive(
    gpu_rows: Iterable[dict[str, str]],
    host_rows: Iterable[dict[str, str]],
    n1_rows: Iterable[dict[str, str]] = (),
) -> list[CatalogRow]:
    """Join host rows with GPU rows of the same zone. Rows lacking a price are skipped."""
    gpus: dict[tuple[str, int, str], dict[str, str]] = {}
    for r in gpu_rows:
        gpus[(r["AcceleratorName"], int(r["AcceleratorCount"]), r["AvailabilityZone"])] = r
    out: list[CatalogRow] = []

    def join(host: dict[str, str], gpu_name: str, count: int, guest: str) -> None:
        g = gpus.get((gpu_name, count, host["AvailabilityZone"]))
        if g is None:
            return
        prices = [_float(host["Price"]), _float(host["SpotPrice"])]
        prices += [_float(g["Price"]), _float(g["SpotPrice"])]
        if any(p is None for p in prices):
            return
        h_od, h_sp, g_od, g_sp = (float(p or 0.0) for p in prices)
        out.append(
            CatalogRow(
                machine_type=host["InstanceType"],
                gpu_name=gpu_name,
                gpus=count,
                guest_accelerator=guest,
                vcpus=float(host["vCPUs"]),
                memory_gib=float(host["MemoryGiB"]),
                gpu_memory_gib=_gpu_memory_gib(g["GpuInfo"]),
                region=host["Region"],
                zone=host["AvailabilityZone"],
                on_demand_price=round(h_od + g_od, 5),
                spot_price=round(h_sp + g_sp, 5),
                host_on_demand=h_od,
                host_spot=h_sp,
                gpu_on_demand=g_od,
                gpu_spot=g_sp,
            )
        )

    for h in host_rows:
        bundled = BUNDLED.get(h["InstanceType"])
        if bundled:
            join(h, bundled[0], bundled[1], "")
    for h in n1_rows:
        for count, host_type in N1_HOST.items():
            if host_type != h["InstanceType"]:
                continue
            for gpu_name, accel in GUEST_ACCELERATORS.items():
                join(h, gpu_name, count, accel)
    out.sort(key=lambda r: (r.region, r.zone, r.machine_type, r.gpu_name, r.gpus))
    return out


def to_csv(rows: Iterable[CatalogRow]) -> str:
    buf = io.StringIO()
    names = [f.name for f in fields(CatalogRow)]
    w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def _parse(text: str) -> Iterator[CatalogRow]:
    for r in csv.DictReader(io.StringIO(text)):
        yield CatalogRow(
            machine_type=r["machine_type"],
            gpu_name=r["gpu_name"],
            gpus=int(r["gpus"]),
            guest_accelerator=r["guest_accelerator"],
            vcpus=float(r["vcpus"]),
            memory_gib=float(r["memory_gib"]),
            gpu_memory_gib=float(r["gpu_memory_gib"]),
            region=r["region"],
            zone=r["zone"],
            on_demand_price=float(r["on_demand_price"]),
            spot_price=float(r["spot_price"]),
            host_on_demand=float(r["host_on_demand"]),
            host_spot=float(r["host_spot"]),
            gpu_on_demand=float(r["gpu_on_demand"]),
            gpu_spot=float(r["gpu_spot"]),
        )


def _data_text(name: str) -> str:
    return resources.files("spotctl").joinpath("data", name).read_text()


@lru_cache(maxsize=1)
def catalog() -> tuple[CatalogRow, ...]:
    """Every row of the shipped catalog (read once per process)."""
    return tuple(_parse(_data_text(CATALOG_FILE)))


def rows(region: str | None = None) -> list[CatalogRow]:
    return [r for r in catalog() if region is None or r.region == region]


def regions() -> list[str]:
    return sorted({r.region for r in catalog()})


def load_offers(region: str | None = None) -> list[Offer]:
    """Spot offers from the shipped catalog, optionally for one region."""
    return [r.to_offer() for r in rows(region)]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    """Rebuild spotctl/data/gcp_gpu_catalog.csv: `python -m spotctl.providers.gcp.catalog DATA_DIR`."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("catalog_dir", type=Path, help="folder with gcp_gpu.csv, gcp_gpu_hosts.csv")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[2] / "data"
    derived = derive(
        _read_csv(a.catalog_dir / "gcp_gpu.csv"),
        _read_csv(a.catalog_dir / "gcp_gpu_hosts.csv"),
        _read_csv(here / N1_HOSTS_FILE),
    )
    (a.out or here / CATALOG_FILE).write_text(to_csv(derived))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
