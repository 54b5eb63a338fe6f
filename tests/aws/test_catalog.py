"""The shipped AWS catalog and Spot Advisor subset (no network, no moto)."""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from spotctl.providers.aws import catalog as catalog_aws

pytestmark = pytest.mark.aws

SHARED = Path(os.environ.get("SPOTCTL_SHARED_DATA", Path(__file__).parents[3] / "shared/data"))
PKG_DATA = Path(catalog_aws.__file__).resolve().parents[2] / "data"


def test_no_duplicate_zone_rows_and_p4de_keeps_the_priced_row() -> None:
    keys = Counter((r.instance_type, r.region, r.zone_id) for r in catalog_aws.catalog())
    assert max(keys.values()) == 1
    p4de = [
        r
        for r in catalog_aws.catalog()
        if r.instance_type == "p4de.24xlarge"
        and r.region == "us-east-1"
        and r.zone_id == "use1-az4"
    ]
    assert [r.spot_price for r in p4de] == [7.8074]


@pytest.mark.parametrize(
    ("itype", "region", "price"),
    [
        ("g4dn.xlarge", "us-east-1", 0.526),
        ("p4d.24xlarge", "us-east-1", 32.7726),
        ("p5.48xlarge", "us-east-1", 98.32),
        ("p5e.48xlarge", "us-east-2", None),  # the source has no on-demand price
        ("g5.xlarge", "ap-south-1", None),  # region not in the catalog
        ("m5.large", "us-east-1", None),  # not a GPU type
    ],
)
def test_on_demand_price(itype: str, region: str, price: float | None) -> None:
    assert catalog_aws.on_demand_price(itype, region) == price


def test_interruption_band_matches_the_advisor_feed() -> None:
    assert catalog_aws.interruption_band("m5.large", "us-east-1") is None
    assert catalog_aws.interruption_band("g5.xlarge", "ap-south-1") is None
    src = SHARED / "spot-advisor" / "spot-advisor-data.json"
    if not src.exists():
        pytest.skip(f"{src} not present")
    feed = json.loads(src.read_text())["spot_advisor"]
    for region in catalog_aws.regions():
        for itype in catalog_aws.instance_types(region):
            entry = feed.get(region, {}).get("Linux", {}).get(itype)
            want = None if entry is None else entry["r"]
            assert catalog_aws.interruption_band(itype, region) == want, (itype, region)


def test_load_offers_uses_zone_ids_and_filters_region() -> None:
    offers = catalog_aws.load_offers("us-west-2")
    assert offers
    assert {o.region for o in offers} == {"us-west-2"}
    assert all(o.zone.startswith("usw2-az") for o in offers)
    assert all(o.spot_price > 0 and o.gpus > 0 and o.provider == "aws" for o in offers)
    g5 = [o for o in offers if o.instance_type == "g5.xlarge"]
    assert g5 and all(
        o.on_demand_price == catalog_aws.on_demand_price("g5.xlarge", "us-west-2") for o in g5
    )
    assert len(catalog_aws.load_offers()) > len(offers)


def test_excluded_families_are_absent() -> None:
    families = {r.instance_type.split(".")[0] for r in catalog_aws.catalog()}
    assert not families & set(catalog_aws.EXCLUDED_FAMILIES)


def test_shipped_files_rebuild_from_the_public_snapshots(tmp_path: Path) -> None:
    if not (SHARED / "catalog" / "aws_gpu.csv").exists():
        pytest.skip(f"{SHARED} not present")
    catalog_aws.rebuild(SHARED, tmp_path)
    for name in (catalog_aws.CATALOG_FILE, catalog_aws.ADVISOR_FILE):
        assert (tmp_path / name).read_text() == (PKG_DATA / name).read_text(), name
    # Every source row survives except the dropped families and the p4de duplicates.
    src = list(csv.DictReader((SHARED / "catalog" / "aws_gpu.csv").read_text().splitlines()))
    kept = [r for r in src if r["InstanceType"].split(".")[0] not in catalog_aws.EXCLUDED_FAMILIES]
    dupes = len(kept) - len({(r["InstanceType"], r["Region"], r["AvailabilityZone"]) for r in kept})
    assert dupes == 5
    assert len(catalog_aws.catalog()) == len(kept) - dupes


def test_default_types_are_only_those_the_deep_learning_ami_supports() -> None:
    """The catalog still prices p3/p3dn (V100), but the default worker image's driver
    dropped them: `up` must not look at them unless asked with an image that runs them."""
    every = catalog_aws.instance_types("us-east-1")
    assert any(t.startswith(("p3.", "p3dn.")) for t in every)
    defaults = catalog_aws.default_instance_types("us-east-1")
    assert not any(t.startswith(("p3.", "p3dn.")) for t in defaults)
    assert {"g4dn.xlarge", "g5.xlarge", "g6e.xlarge", "p4d.24xlarge", "p5.48xlarge"} <= set(
        defaults)
    assert {t.split(".")[0] for t in catalog_aws.default_instance_types()} <= set(
        catalog_aws.DLAMI_FAMILIES)
