"""`spotctl cron install | remove | show`: one crontab line per cluster running rebalance."""

from __future__ import annotations

import typer

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name

cron_app = typer.Typer(
    name="cron",
    help="Run `spotctl rebalance` from cron: one crontab line per cluster.",
    no_args_is_help=True,
)


@cron_app.command("install")
def install(
    name: str | None = typer.Option(None, "--name", help=NAME_HELP),
    every: str = typer.Option("5m", "--every", help="How often: Nm (1-59) or Nh (1-24)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Install (or update) the cluster's crontab line; installing twice keeps one line."""
    from spotctl.control import cron

    cron.parse_every(every)  # bad input fails before anything is read or written
    store = open_store()
    name = resolve_name(store, name)
    store.get_cluster(name)
    entry = cron.install(name, every, store.root, store.cluster_dir(name).ensure().path)
    if json_out:
        return print_json(entry.to_json())
    con = console()
    con.print(f"installed ({entry.schedule}) for cluster {name}; log: {entry.log}")
    con.print(entry.line, soft_wrap=True)


@cron_app.command("remove")
def remove(
    name: str | None = typer.Option(None, "--name", help=NAME_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Remove the cluster's crontab line; other lines stay as they are."""
    from spotctl.control import cron

    name = resolve_name(open_store(), name)
    removed = cron.remove(name)
    if json_out:
        return print_json({"cluster": name, "removed": removed})
    console().print(
        f"removed the crontab line of cluster {name}"
        if removed
        else f"no crontab line for cluster {name}"
    )


@cron_app.command("show")
def show(
    name: str = typer.Option(None, "--name", help="Cluster name (default: every cluster)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the spotctl crontab line(s)."""
    from spotctl.control import cron

    found = cron.show(name)
    if json_out:
        return print_json([e.to_json() for e in found])
    con = console()
    if not found:
        con.print(f"no crontab line for cluster {name}" if name else "no spotctl crontab lines")
    for e in found:
        con.print(f"{e.cluster}: every ({e.schedule}), log {e.log or '-'}")
        con.print(e.line, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(cron_app, name="cron")
