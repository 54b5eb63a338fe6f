from __future__ import annotations

import time

import typer

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name


def register(app: typer.Typer) -> None:
    @app.command()
    def status(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        interval: float = typer.Option(1.0, "--interval", min=0.2, max=60),
        all_runs: bool = typer.Option(
            False, "--all", help="Every node the cluster had, earlier runs' too (default: "
                                 "the current run's, since the last `down`)."),
    ) -> None:
        """Live table of the cluster: nodes, world size, step, checkpoint, cost."""
        from spotctl.control import status as st

        store = open_store()
        name = resolve_name(store, name)
        if json_out:
            return print_json(st.status_json(store, name, all_runs))
        store.get_cluster(name)
        con = console()
        if once or not con.is_terminal:
            con.print(st.render(st.collect(store, name, all_runs=all_runs), width=con.width))
            return
        from rich.live import Live

        with Live(st.render(st.collect(store, name, all_runs=all_runs), width=con.width), console=con, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(st.render(st.collect(store, name, all_runs=all_runs), width=con.width))
            except KeyboardInterrupt:
                pass
