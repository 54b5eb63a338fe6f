from __future__ import annotations

from typing import Any

import typer

from spotctl.cli.common import console, open_store, print_json
from spotctl.control.tables import Col, fit_table

LIST_COLS = (Col("cluster"), Col("provider"), Col("state"), Col("nodes", right=True),
             Col("gpus", right=True))


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_(json_out: bool = typer.Option(False, "--json")) -> None:
        """List known clusters."""
        store = open_store()
        rows: list[dict[str, Any]] = [
            {"cluster": c.name, "provider": c.provider, "state": c.state,
             "nodes": len(store.nodes(c.name, include_ended=False)),
             "gpus": c.spec.get("gpus")}
            for c in store.clusters()
        ]
        if json_out:
            return print_json(rows)
        con = console()
        con.print(fit_table(LIST_COLS, [
            (r["cluster"], r["provider"], r["state"], str(r["nodes"]),
             f"{(r['gpus'] or {}).get('min')}..{(r['gpus'] or {}).get('max')}") for r in rows
        ], con.width))
