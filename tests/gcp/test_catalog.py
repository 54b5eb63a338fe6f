"""The shipped GCP catalog: derived prices, sums, filters, and `spotctl prices`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from spotctl.providers.gcp import catalog as catalog_gcp

pytestmark = pytest.mark.gcp

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "catalog"


def _offer(region: str, zone: str, machine: str, gpu: str | None = None):
    found = [
        o
        for o in catalog_gcp.load_offers(region)
        if o.zone == zone and o.instance_type == machine and (gpu is None or o.gpu_name == gpu)
    ]
    assert len(found) == 1, found
    return found[0]


def test_a2_price_is_host_plus_gpu():
    o = _offer("us-central1", "us-central1-a", "a2-highgpu-1g")
    assert o.provider == "gcp" and o.gpus == 1 and o.gpu_name == "A100"
    assert o.on_demand_price == pytest.approx(0.73948 + 2.93391)
    assert o.spot_price == pytest.approx(0.29576 + 1.1472)
    assert o.gpu_memory_gib == 40.0


def test_g2_and_bundled_counts():
    o = _offer("us-central1", "us-central1-a", "g2-standard-4")
    assert o.on_demand_price == pytest.approx(0.14679 + 0.56004)
    assert _offer("us-central1", "us-central1-a", "g2-standard-48").gpus == 4
    assert _offer("us-central1", "us-central1-a", "a2-megagpu-16g").gpus == 16


def test_n1_guest_accelerators_priced_with_real_host_rows():
    t4 = _offer("us-central1", "us-central1-a", "n1-standard-8", "T4")
    # n1-standard-8 host 0.38 / 0.0963 (same source file) + T4 x1 0.35 / 0.14.
    assert t4.on_demand_price == pytest.approx(0.38 + 0.35)
    assert t4.spot_price == pytest.approx(0.0963 + 0.14)
    v100x8 = [
        o for o in catalog_gcp.load_offers("us-central1") if o.gpu_name == "V100" and o.gpus == 8
    ]
    assert v100x8 and all(o.instance_type == "n1-standard-64" for o in v100x8)
    row = next(
        r
        for r in catalog_gcp.rows("us-central1")
        if r.zone == "us-central1-a" and r.gpu_name == "T4" and r.gpus == 1
    )
    assert row.guest_accelerator == "nvidia-tesla-t4"


def test_every_row_is_host_plus_gpu_and_region_filter_holds():
    rows = catalog_gcp.rows()
    assert len(rows) > 200
    for r in rows:
        assert r.on_demand_price == pytest.approx(r.host_on_demand + r.gpu_on_demand, abs=1e-5)
        assert r.spot_price == pytest.approx(r.host_spot + r.gpu_spot, abs=1e-5)
        assert 0 < r.spot_price < r.on_demand_price or r.gpu_name.startswith("H")
    assert {o.region for o in catalog_gcp.load_offers("europe-west4")} == {"europe-west4"}
    assert catalog_gcp.load_offers("nowhere-1") == []


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not present")
def test_shipped_catalog_matches_a_fresh_derivation(tmp_path):
    out = tmp_path / "cat.csv"
    assert catalog_gcp.main([str(SHARED), "--out", str(out)]) == 0
    shipped = (Path(catalog_gcp.__file__).resolve().parents[2] / "data" / catalog_gcp.CATALOG_FILE).read_text()
    assert out.read_text() == shipped
    # Every a2/a3/g2 host row of the input found its GPU row.
    with (SHARED / "gcp_gpu_hosts.csv").open() as f:
        hosts = list(csv.DictReader(f))
    bundled = [r for r in catalog_gcp.rows() if not r.guest_accelerator]
    assert len(bundled) == len(hosts)


def test_prices_command_json(spotctl_home):
    from typer.testing import CliRunner

    from spotctl.cli.app import app

    res = CliRunner().invoke(
        app, ["prices", "--provider", "gcp", "--region", "us-central1", "--json"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert rows and {r["provider"] for r in rows} == {"gcp"}
    assert {r["region"] for r in rows} == {"us-central1"}
    a2 = [r for r in rows if r["instance_type"] == "a2-highgpu-1g" and r["zone"] == "us-central1-a"]
    assert a2 and a2[0]["on_demand_price"] == pytest.approx(3.67339)
    prices = [r["price_per_gpu_hour"] for r in rows]
    assert prices == sorted(prices)


def test_prices_command_gpu_filter(spotctl_home):
    from typer.testing import CliRunner

    from spotctl.cli.app import app

    res = CliRunner().invoke(app, ["prices", "-p", "gcp", "--gpu", "t4", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert rows and {r["gpu_name"] for r in rows} == {"T4"}
