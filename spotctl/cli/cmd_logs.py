from __future__ import annotations

import sys
import time

import typer

from spotctl.cli.common import NAME_HELP, open_store, resolve_name
from spotctl.errors import NotFoundError

LOGS = {"agent": "agent.log", "train": "torchrun.log", "node": "node.log"}


def register(app: typer.Typer) -> None:
    @app.command()
    def logs(
        node: str = typer.Argument(..., help="Node id (see `spotctl status`), or 'head'."),
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
        which: str = typer.Option("train", "--log", help="train | agent | node"),
        lines: int = typer.Option(50, "--lines", "-n", min=0),
    ) -> None:
        """Print a node's training (or agent) log."""
        store = open_store()
        name = resolve_name(store, name)
        row = store.get_cluster(name)
        cdir = store.cluster_dir(name)
        if which not in LOGS:
            raise NotFoundError(f"--log must be one of {', '.join(LOGS)}")
        if node == "head":
            path = cdir.head_dir / "head.log"
        else:
            known = {n.id: n for n in store.nodes(name)}
            if node not in known:
                raise NotFoundError(f"no node {node!r} in cluster {name}")
            if row.provider != "local":
                from spotctl.remote import bootstrap

                return bootstrap.tail_node_log(store, name, known[node], LOGS[which], follow, lines)
            path = cdir.nodes_dir / node / LOGS[which]
        if not path.exists():
            raise NotFoundError(f"no log yet at {path}")
        with open(path, "rb") as f:
            data = f.read().decode(errors="replace").splitlines()
            for line in data[-lines:] if lines else []:
                print(line)
            sys.stdout.flush()
            while follow:
                chunk = f.readline()
                if chunk:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.3)
