"""`spotctl cost`: what the cluster cost, what on-demand would have, and what preemptions
cost in GPU-hours. Table and JSON come from the same report."""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.text import Text

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name
from spotctl.control.cost import CostReport
from spotctl.control.tables import Col, fit_table

COST_COLS = (
    Col("node"), Col("zone", drop=5), Col("type", drop=6), Col("GPUs", right=True, drop=3),
    Col("state", drop=4), Col("hours", right=True, drop=2), Col("$/h", right=True, drop=1),
    Col("spent $", right=True), Col("on-demand $", right=True, short="on-dem. $"),
    Col("saved $", right=True),
)


def render(r: CostReport, width: int = 120) -> Group:
    rows = [(
        n.id, n.zone, n.instance_type, str(n.gpus), n.state, f"{n.hours:.3f}",
        f"{n.price:.4f}", f"{n.spent_usd:.4f}",
        "-" if n.on_demand_usd is None else f"{n.on_demand_usd:.4f}",
        "-" if n.saved_usd is None else f"{n.saved_usd:.4f}",
    ) for n in r.nodes]
    t = fit_table(COST_COLS, rows, width)
    summary = Text(
        f"cluster {r.cluster}: {len(r.nodes)} node(s), {r.gpu_hours:.3f} GPU-h, "
        f"now {r.usd_per_hour:.4f} $/h\n{r.header()}\n"
        f"replay {r.replay_gpu_hours:.3f} GPU-h"
        + (f" (step {r.step_time_s:.3g}s)" if r.step_time_s else " (step time unknown)")
        + f", downtime {r.downtime_gpu_hours:.3f} GPU-h over {r.preemption_rescales} rescale(s)"
    )
    return Group(summary, t)


def register(app: typer.Typer) -> None:
    @app.command()
    def cost(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Money spent, what on-demand would have cost, and GPU-hours lost to preemptions."""
        from spotctl.control.cost import cluster_cost
        from spotctl.control.reconcile import sync_events

        store = open_store()
        name = resolve_name(store, name)
        store.get_cluster(name)
        sync_events(store, name)  # the head's rescale events carry the preemption losses
        report = cluster_cost(store, name, time.time())
        if json_out:
            return print_json(report.to_json())
        con = console()
        con.print(render(report, width=con.width))
