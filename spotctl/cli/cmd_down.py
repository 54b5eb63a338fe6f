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
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Stop every node and the head; remove what the cluster created."""
        from spotctl.control import reconcile

        store = open_store()
        name = resolve_name(store, name)
        store.get_cluster(name)
        if not yes and not typer.confirm(f"Tear down cluster {name}?"):
            raise typer.Abort()
        from spotctl.control.report import fetch_samples

        try:  # a cloud head's samples, for `spotctl report` afterwards; never blocks cleanup
            fetch_samples(store, name)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, `down` must still clean up
            console(stderr=True).print(f"warning: could not keep the head's samples: {e}")
        leaks = reconcile.down(store, name, progress=_say_waits)
        if json_out:
            print_json({"cluster": name, "leaks": leaks})
        else:
            console().print(f"cluster {name} is down" + ("" if not leaks else f"; LEAKS: {leaks}"))
        if leaks:
            raise SpotctlError(f"cluster {name}: {len(leaks)} leftover resource(s): {leaks}")


def _say_waits(msg: str, frac: float | None = None) -> None:
    """`down` waiting on another run's lock says whose (pid, command, since) on stderr."""
    if msg.startswith("waiting for"):
        print(msg, file=sys.stderr, flush=True)
