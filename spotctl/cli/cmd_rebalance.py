from __future__ import annotations

import json
import sys
from typing import Any

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
        watch: bool = typer.Option(
            False, "--watch",
            help="Keep running: reconcile when the head reports a notice, leave or rescale, "
            "and every --interval seconds (same lock as cron).",
        ),
        interval: float = typer.Option(60.0, "--interval", help="--watch: seconds between runs."),
        poll: float = typer.Option(1.0, "--poll", help="--watch: seconds between head polls."),
        duration: float | None = typer.Option(
            None, "--duration", help="--watch: stop after this many seconds [forever]."),
    ) -> None:
        """Replace lost capacity, grow toward the maximum, move to cheaper capacity (cron)."""
        from spotctl.control import reconcile

        store = open_store()
        name = resolve_name(store, name)
        spec = cluster_spec(store, name)
        row = store.get_cluster(name)
        if row.state == "down":
            raise StateError(f"cluster {name} is down; `spotctl up` starts it again")
        if watch:
            return _watch(store, name, json_out, interval, poll, duration, dry_run)
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


def _watch(store: Any, name: str, json_out: bool, interval: float, poll: float,
           duration: float | None, dry_run: bool) -> None:
    """`rebalance --watch`: one line per run (a JSON object with --json), until
    --duration passes or the cluster is down."""
    from spotctl.control import trigger
    from spotctl.errors import SpecError

    if dry_run:
        raise SpecError("--watch and --dry-run: choose one")
    if interval <= 0 or poll <= 0 or (duration is not None and duration <= 0):
        raise SpecError("--interval, --poll and --duration must be positive")
    con = console()

    def show(out: dict[str, Any]) -> None:
        if json_out:
            sys.stdout.write(json.dumps(out, default=str) + "\n")
            sys.stdout.flush()
            return
        acts = out.get("actions") or []
        what = (f"failed: {out['error']}" if out.get("error")
                else "skipped (lock held)" if out.get("skipped")
                else "; ".join(f"{a['type']}: {a['reason']}" for a in acts) if acts
                else "nothing to do")
        con.print(f"[{', '.join(out['trigger'])}] {what}")

    trigger.watch(store, name, lambda: cluster_spec(store, name), interval_s=interval,
                  poll_s=poll, duration_s=duration, on_run=show)
