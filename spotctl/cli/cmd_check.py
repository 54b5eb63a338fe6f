"""`spotctl check --provider aws|gcp`: what a cloud account lacks before `up` spends anything."""

from __future__ import annotations

import sys

import typer

from spotctl.cli.common import console, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def check(
        provider: str = typer.Option(..., "--provider", help="aws or gcp."),
        region: str | None = typer.Option(None, "--region", help="Region to check."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Credentials, region, spot GPU quota, network, images: one line each.

        Exits 1 when anything would stop `spotctl up`, 0 otherwise (warnings included).
        """
        from rich.markup import escape

        from spotctl.control.check import blocking_failures, check_account
        from spotctl.spec import load_spec

        overrides: dict[str, object] = {"provider": provider}
        if region and provider in ("aws", "gcp"):
            overrides[f"{provider}.region"] = region
        spec = load_spec(overrides=overrides, check_script=False)
        checks = check_account(provider, spec)
        blocked = blocking_failures(checks)
        if json_out:
            print_json({"provider": provider, "ok": not blocked,
                        "checks": [c.to_json() for c in checks]})  # fmt: skip
        else:
            con = console()
            width = max(len(c.name) for c in checks)
            for c in checks:
                mark = "ok  " if c.ok else ("FAIL" if c.blocking else "warn")
                style = "green" if c.ok else ("red" if c.blocking else "yellow")
                con.print(f"[{style}]{mark}[/] {c.name:<{width}}  {escape(c.detail)}",
                          highlight=False, markup=True, soft_wrap=True)  # fmt: skip
            if blocked:
                con.print(f"{len(blocked)} problem(s) would stop `spotctl up --provider "
                          f"{provider}`", highlight=False)  # fmt: skip
        if blocked:
            sys.exit(1)
