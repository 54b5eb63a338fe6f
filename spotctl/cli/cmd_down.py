from __future__ import annotations

import sys

import typer

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name
from spotctl.errors import SpotctlError


def register(app: typer.Typer) -> None:
    @app.command()
    def down(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
        purge: bool = typer.Option(
            False, "--purge",
            help="Also delete the cluster's checkpoints (every object under its bucket "
                 "prefix; on a local cluster its checkpoints folder). Without it they are "
                 "kept, so a later `up` resumes from them."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Stop every node and the head; remove what the cluster created (checkpoints stay
        unless --purge)."""
        from spotctl.control import reconcile

        store = open_store()
        name = resolve_name(store, name)
        store.get_cluster(name)
        what = " and DELETE its checkpoints" if purge else ""
        if not yes and not typer.confirm(f"Tear down cluster {name}{what}?"):
            raise typer.Abort()
        from spotctl.control.report import fetch_samples

        try:  # a cloud head's samples, for `spotctl report` afterwards; never blocks cleanup
            fetch_samples(store, name)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, `down` must still clean up
            console(stderr=True).print(f"warning: could not keep the head's samples: {e}")
        res = reconcile.teardown(store, name, purge=purge, progress=_say_waits)
        leaks = res.leaks
        if json_out:
            print_json(res.to_json())
        else:
            kept = f"; {checkpoints_line(res.purged, purge, res.kept_at)}" if res.can_purge \
                else (f"; checkpoints kept in {res.kept_at} (train.checkpoint_dir: yours to "
                      "remove)" if res.kept_at else "")
            # one line, however long its path: never wrapped (a pipe's width included)
            console().print(f"cluster {name} is down{kept}"
                            + ("" if not leaks else f"; LEAKS: {leaks}"), soft_wrap=True)
        if leaks:
            raise SpotctlError(f"cluster {name}: {len(leaks)} leftover resource(s): {leaks}")


def checkpoints_line(purged: int | None, purge: bool, where: str | None = None) -> str:
    """What became of the checkpoints, for the line `down` prints (`where`: their place,
    when the provider says)."""
    at = f" in {where}" if where else ""
    if not purge:
        return f"checkpoints kept{at} (`spotctl down --purge` deletes them)"
    if purged is None:
        return "checkpoints NOT deleted"  # why: in the leaks
    if where:
        return f"checkpoints deleted: {purged} file(s) in {where}"
    return f"checkpoints deleted: {purged} object(s) under the cluster's prefix"


def _say_waits(msg: str, frac: float | None = None) -> None:
    """`down` waiting on another run's lock says whose (pid, command, since) on stderr."""
    if msg.startswith("waiting for"):
        print(msg, file=sys.stderr, flush=True)
