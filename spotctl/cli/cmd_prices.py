"""`spotctl prices`: what spot capacity costs now, for any provider, as a table or JSON."""

from __future__ import annotations

import datetime as dt
import importlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import typer
from rich.table import Table

from spotctl.control.tables import Col, fit_table
from spotctl.errors import AuthError, SpecError
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
    if region and not offers:
        known = sorted({o.region for o in mod.load_offers(None)})
        raise SpecError(f"--region: {provider} has no region {region!r} in the shipped catalog "
                        f"(known: {', '.join(known[:12])}{', ...' if len(known) > 12 else ''})")
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


PRICE_COLS = (
    Col("type"), Col("zone"), Col("GPUs", right=True), Col("GPU", drop=3),
    Col("spot $/h", right=True, short="spot"),
    Col("on-demand $/h", right=True, drop=4, short="on-dem."),
    Col("$/GPU-h", right=True, short="$/GPU"), Col("savings %", right=True, drop=5, short="save%"),
    Col("interruption", drop=2, short="interr."),
)

# Where each number comes from; the shipped files are described in spotctl/data/*_SOURCES.md.
_CATALOG = "the catalog shipped with spotctl (a public list-price snapshot, date not recorded)"
_ADVISOR = "interruption bands: AWS Spot Advisor snapshot of 2025-06-28"


def price_sources(provider: str, live: bool) -> dict[str, str]:
    """{"spot": ..., "on_demand": ...}: where this provider's numbers come from."""
    if provider == "aws" and live:
        return {"spot": "live", "on_demand": "catalog"}
    if provider in ("aws", "gcp"):
        return {"spot": "catalog", "on_demand": "catalog"}
    return {"spot": "spec", "on_demand": "spec"}


def source_note(provider: str, live: bool, at: float) -> str:
    when = dt.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M")
    if provider == "aws" and live:
        return (f"spot $/h: live, EC2 spot price history at {when}; on-demand $/h: {_CATALOG}; "
                f"{_ADVISOR}")
    if provider == "aws":
        return f"spot and on-demand $/h: {_CATALOG}; {_ADVISOR}"
    if provider == "gcp":
        return (f"spot and on-demand $/h: {_CATALOG}; GCP spot prices change at most monthly "
                "and are not fetched live")
    return f"{provider}: prices as the spec sets them"


def offers_table(offers: Sequence[Offer], title: str = "", width: int = 120) -> Table:
    """A pure builder: one row per offer, same rows as the JSON output, fit to `width`."""
    rows = []
    for o in offers:
        savings = o.savings_pct
        rows.append((
            o.instance_type, o.zone, str(o.gpus), o.gpu_name, _money(o.spot_price),
            _money(o.on_demand_price), _money(o.price_per_gpu_hour),
            "" if savings is None else f"{savings:.0f}", band_label(o.interruption_band),
        ))
    return fit_table(PRICE_COLS, rows, width, title=title or None)


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
        live = not catalog and provider != "gcp"  # gcp offers are the shipped catalog's
        fell_back = ""
        if catalog:
            offers = catalog_offers(provider, region, gpu)
        else:
            try:
                offers = live_offers(provider, region, gpu)
            except AuthError as e:
                if provider != "aws":
                    raise
                offers, live = catalog_offers(provider, region, gpu), False
                del e
                fell_back = ("note: no usable aws credentials; these are the shipped catalog's "
                             "prices (a public snapshot, date not recorded), not live ones")
        offers = sort_offers(offers)
        at = time.time()
        if fell_back:
            print(fell_back, file=sys.stderr)
        if as_json:
            src = price_sources(provider, live)
            print_json([dict(r, price_source=src) for r in offer_rows(offers)])
            return
        if not offers:
            console().print(f"no {provider} offers" + (f" for GPU {gpu}" if gpu else ""))
            return
        out = console()
        kind = "live" if live else "catalog"
        out.print(offers_table(offers, title=f"{provider} spot offers ({kind})", width=out.width))
        out.print(source_note(provider, live, at), soft_wrap=True)
