"""`spotctl report`: the totals of a run (running or finished) and, with --plot, its picture."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Group
from rich.text import Text

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name
from spotctl.control.report import Report
from spotctl.control.tables import Col, fit_line, fit_table

TOTAL_COLS = (Col("what"), Col("value", right=True))


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def render(rep: Report, width: int = 80) -> Group:
    t = rep.totals
    od = t.on_demand_usd
    rows = [
        ("hours run", f"{t.hours:.3f} h ({_dur(rep.end - rep.start)})"),
        ("steps", str(t.steps)),
        ("lost steps", str(t.lost_steps)),
        ("pauses (rescales)", f"{t.pauses}, {_dur(t.pause_s)} in all"
         + (f" ({t.pauses_unmeasured} not measured)" if t.pauses_unmeasured else "")),
        ("notices / hard losses", f"{t.notices} / {t.hard_losses}"),
        ("$ spent", f"{t.spent_usd:.4f}"),
        ("$ on demand", f"{od:.4f}" + (f" (saved {100 * (1 - t.spent_usd / od):.0f}%)"
                                      if od > 0 else "")),
        ("GPU-h offered / training", f"{t.gpu_hours_offered:.3f} / {t.gpu_hours_training:.3f}"),
        ("goodput", "-" if t.goodput_pct is None else f"{t.goodput_pct:.1f}% of offered"),
    ]
    head = fit_line([Text.assemble(("cluster ", "bold"), rep.cluster),
                     Text.assemble(("provider ", "bold"), rep.provider),
                     Text.assemble(("state ", "bold"), rep.state)], width)
    return Group(head, fit_table(TOTAL_COLS, rows, width))


def register(app: typer.Typer) -> None:
    @app.command()
    def report(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        plot: Path = typer.Option(None, "--plot", help="Write a PNG of the run here."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """A run in numbers (hours, steps, lost steps, pauses, $, goodput) and --plot."""
        from spotctl.control import report as rp
        from spotctl.control.reconcile import sync_events

        store = open_store()
        name = resolve_name(store, name)
        store.get_cluster(name)
        sync_events(store, name)
        rp.fetch_samples(store, name)
        rep = rp.build(store, name)
        drawn = rp.write_plot(rep, plot) if plot is not None else None
        if json_out:
            out = rep.to_json()
            if plot is not None:
                out["plot"] = {"path": str(plot), "marks": drawn}
            return print_json(out)
        con = console()
        con.print(render(rep, con.width))
        if plot is not None:
            con.print(f"wrote {plot}")
