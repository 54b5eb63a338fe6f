from __future__ import annotations

import typer

from spotctl.cli.common import (
    NAME_HELP,
    cluster_spec,
    console,
    open_store,
    print_json,
    resolve_name,
)
from spotctl.errors import StateError


def register(app: typer.Typer) -> None:
    @app.command()
    def rebalance(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        dry_run: bool = typer.Option(False, "--dry-run", help="Plan only; change nothing."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Replace lost capacity, grow toward the maximum, move to cheaper capacity (cron)."""
        from spotctl.control import reconcile

        store = open_store()
        name = resolve_name(store, name)
        spec = cluster_spec(store, name)
        row = store.get_cluster(name)
        if row.state == "down":
            raise StateError(f"cluster {name} is down; `spotctl up` starts it again")
        reconcile.sync_events(store, name)
        if dry_run:
            res = reconcile.reconcile(store, spec, dry_run=True)
        else:
            try:
                with store.cluster_dir(name).lock("rebalance", wait=False):
                    res = reconcile.reconcile(store, spec, create=False)
            except StateError as err:
                # another cron run holds the lock: it acts, this one steps aside cleanly
                if json_out:
                    return print_json({"cluster": name, "skipped": True, "reason": str(err)})
                console().print(f"skipped: {err}")
                return
        out = res.to_json()
        if json_out:
            return print_json(out)
        con = console()
        if not res.plan.actions:
            con.print(f"{name}: nothing to do ({'; '.join(res.plan.notes) or 'in bounds'})")
        for a in out["actions"]:
            con.print(f"{a['type']}: {a['reason']}")
        for e in res.errors:
            con.print(f"warning: {e}")
