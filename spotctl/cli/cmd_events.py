from __future__ import annotations

import datetime as dt
import json

import typer
from rich.table import Table

from spotctl.cli.common import console, open_store, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def events(
        name: str = typer.Option("spotctl", "--name", help="Cluster name."),
        type_: str = typer.Option(None, "--type", help="Only events of this type."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """The cluster's events: launches, joins, notices, drains, rescales, down."""
        from spotctl.control.reconcile import sync_events

        store = open_store()
        store.get_cluster(name)
        sync_events(store, name)
        rows = store.events(name, type_)
        if json_out:
            return print_json(rows)
        t = Table(show_edge=False, header_style="bold")
        for c in ("time", "type", "details"):
            t.add_column(c)
        for e in rows:
            when = dt.datetime.fromtimestamp(e["ts"]).strftime("%H:%M:%S.%f")[:-3]
            rest = {k: v for k, v in e.items() if k not in ("ts", "type")}
            t.add_row(when, e["type"], json.dumps(rest, default=str))
        console().print(t)
