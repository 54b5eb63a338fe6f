"""`spotctl cost`: what the cluster cost, what on-demand would have, and what preemptions
cost in GPU-hours. Table and JSON come from the same report."""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from spotctl.cli.common import console, open_store, print_json
from spotctl.control.cost import CostReport


def render(r: CostReport) -> Group:
    t = Table(show_edge=False, header_style="bold")
    for col in (
        "node",
        "zone",
        "type",
        "GPUs",
        "state",
        "hours",
        "$/h",
        "spent $",
        "on-demand $",
        "saved $",
    ):
        t.add_column(col, justify="left" if col in ("node", "zone", "type", "state") else "right")
    for n in r.nodes:
        t.add_row(
            n.id,
            n.zone,
            n.instance_type,
            str(n.gpus),
            n.state,
            f"{n.hours:.3f}",
            f"{n.price:.4f}",
            f"{n.spent_usd:.4f}",
            "-" if n.on_demand_usd is None else f"{n.on_demand_usd:.4f}",
            "-" if n.saved_usd is None else f"{n.saved_usd:.4f}",
        )
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
        name: str = typer.Option("spotctl", "--name", help="Cluster name."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Money spent, what on-demand would have cost, and GPU-hours lost to preemptions."""
        from spotctl.control.cost import cluster_cost
        from spotctl.control.reconcile import sync_events

        store = open_store()
        store.get_cluster(name)
        sync_events(store, name)  # the head's rescale events carry the preemption losses
        report = cluster_cost(store, name, time.time())
        if json_out:
            return print_json(report.to_json())
        console().print(render(report))
