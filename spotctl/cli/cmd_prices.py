"""`spotctl prices`: what spot capacity costs now, for any provider, as a table or JSON."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import typer
from rich import box
from rich.table import Table

from spotctl.errors import SpecError
from spotctl.providers import Offer, ProviderContext, get_provider
from spotctl.providers.aws.catalog import band_label  # Spot Advisor buckets, provider-neutral
from spotctl.spec import PROVIDERS, load_spec

PLACEHOLDER_CLUSTER = "prices"


def _overrides(provider: str, region: str | None, gpu: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": PLACEHOLDER_CLUSTER, "provider": provider}
    if provider in ("aws", "gcp"):
        out[f"{provider}.region"] = region
        out[f"{provider}.gpu"] = gpu
    return out


def _gpu_matches(offer: Offer, gpu: str | None) -> bool:
    return not gpu or offer.gpu_name.lower() == gpu.strip().lower()


def catalog_offers(provider: str, region: str | None, gpu: str | None) -> list[Offer]:
    """Offers from the catalog shipped for `provider`, without calling its API."""
    try:
        mod = importlib.import_module(f"spotctl.providers.{provider}.catalog")
    except ImportError:
        raise SpecError(f"--catalog: provider {provider!r} ships no price catalog") from None
    offers: list[Offer] = mod.load_offers(region)
    return [o for o in offers if _gpu_matches(o, gpu)]


def live_offers(provider: str, region: str | None, gpu: str | None) -> list[Offer]:
    from spotctl.state import Store

    spec = load_spec(overrides=_overrides(provider, region, gpu), check_script=False)
    store = Store()
    try:
        ctx = ProviderContext(
            cluster=PLACEHOLDER_CLUSTER,
            spec=spec,
            cluster_dir=store.cluster_dir(PLACEHOLDER_CLUSTER),
        )
        offers: list[Offer] = get_provider(provider, ctx).offers()
    finally:
        store.close()
    if provider in ("aws", "gcp"):
        return offers  # the provider filtered by {provider}.gpu, knowing its GPU aliases
    return [o for o in offers if _gpu_matches(o, gpu)]


def sort_offers(offers: Sequence[Offer]) -> list[Offer]:
    band = 5  # unknown bands sort after every known one
    return sorted(
        offers,
        key=lambda o: (
            o.price_per_gpu_hour,
            o.interruption_band if o.interruption_band is not None else band,
            o.zone,
            o.instance_type,
        ),
    )


def _money(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def offers_table(offers: Sequence[Offer], title: str = "") -> Table:
    """A pure builder: one row per offer, same rows as the JSON output."""
    t = Table(title=title or None, box=box.SIMPLE_HEAD)
    for col, right in (
        ("type", False),
        ("zone", False),
        ("GPUs", True),
        ("GPU", False),
        ("spot $/h", True),
        ("on-demand $/h", True),
        ("$/GPU-h", True),
        ("savings %", True),
        ("interruption", False),
    ):
        t.add_column(col, justify="right" if right else "left", no_wrap=True)
    for o in offers:
        savings = o.savings_pct
        t.add_row(
            o.instance_type,
            o.zone,
            str(o.gpus),
            o.gpu_name,
            _money(o.spot_price),
            _money(o.on_demand_price),
            _money(o.price_per_gpu_hour),
            "" if savings is None else f"{savings:.0f}",
            band_label(o.interruption_band),
        )
    return t


def offer_rows(offers: Sequence[Offer]) -> list[dict[str, Any]]:
    rows = []
    for o in offers:
        row = o.to_json()
        row["interruption"] = band_label(o.interruption_band)
        rows.append(row)
    return rows


def register(app: typer.Typer) -> None:
    @app.command("prices")
    def prices(
        provider: str = typer.Option(
            "aws", "--provider", "-p", help=f"one of {', '.join(PROVIDERS)}"
        ),
        region: str | None = typer.Option(None, "--region", "-r", help="region to price"),
        gpu: str | None = typer.Option(None, "--gpu", help="only this GPU, e.g. A10G"),
        catalog: bool = typer.Option(
            False, "--catalog", help="use the shipped price catalog; no cloud API calls"
        ),
        as_json: bool = typer.Option(False, "--json", help="print JSON rows"),
    ) -> None:
        """List spot offers: type, zone, GPUs, prices, savings and interruption band."""
        from spotctl.cli.common import console, print_json

        if provider not in PROVIDERS:
            raise SpecError(
                f"--provider: unknown provider {provider!r} (choose from {', '.join(PROVIDERS)})"
            )
        offers = (
            catalog_offers(provider, region, gpu) if catalog else live_offers(provider, region, gpu)
        )
        offers = sort_offers(offers)
        if as_json:
            print_json(offer_rows(offers))
            return
        if not offers:
            console().print(f"no {provider} offers" + (f" for GPU {gpu}" if gpu else ""))
            return
        source = "catalog snapshot" if catalog else "live"
        out = console()
        # Rows never wrap: pipes and narrow terminals get the full row, not "g5.x…".
        out.width = max(out.width, 120)
        out.print(offers_table(offers, title=f"{provider} spot offers ({source})"))
