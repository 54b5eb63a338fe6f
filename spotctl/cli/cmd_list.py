from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from spotctl.cli.common import console, open_store, print_json


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
        t = Table(show_edge=False, header_style="bold")
        for col in ("cluster", "provider", "state", "nodes", "gpus"):
            t.add_column(col)
        for r in rows:
            g = r["gpus"] or {}
            t.add_row(r["cluster"], r["provider"], r["state"], str(r["nodes"]),
                      f"{g.get('min')}..{g.get('max')}")
        console().print(t)
