from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import typer

from spotctl.cli.common import NAME_HELP, open_store, resolve_name
from spotctl.errors import NotFoundError, SpecError

LOGS = {"agent": "agent.log", "train": "torchrun.log", "node": "node.log"}


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def interleave(nodes: Callable[[], list[tuple[str, Path, bool]]], lines: int, follow: bool,
               write: Callable[[str], None], poll_s: float = 0.3,
               stop: Callable[[], bool] = lambda: False) -> None:
    """Every node's log with a `node | ` prefix: the last `lines` lines of each log there
    now, then (follow) new lines as they come, whole logs of nodes that join later, and a
    line when a node leaves. `nodes()` gives (id, log path, ended) and is asked again each
    poll, so joins and leaves show up."""
    files: dict[str, tuple[BinaryIO, bytes]] = {}
    done: set[str] = set()
    first = True
    while True:
        current = nodes()
        width = max((len(n) for n, _, _ in current), default=2)
        for nid, path, ended in current:
            if nid in done:
                continue
            if nid not in files:
                if not path.exists():
                    if ended:
                        done.add(nid)
                    continue
                fh: BinaryIO = open(path, "rb")  # noqa: SIM115 - kept open while following
                backlog = fh.read().decode(errors="replace").splitlines()
                if first:
                    backlog = backlog[-lines:] if lines else []
                elif follow:
                    write(f"{nid:<{width}} | -- joined --\n")
                for line in backlog:
                    write(f"{nid:<{width}} | {line}\n")
                files[nid] = (fh, b"")
                if not follow:
                    continue
            f, part = files[nid]
            part += f.read()
            *full, part = part.split(b"\n")
            for raw in full:
                write(f"{nid:<{width}} | {raw.decode(errors='replace')}\n")
            files[nid] = (f, part)
            if ended and follow:
                write(f"{nid:<{width}} | -- left --\n")
                f.close()
                del files[nid]
                done.add(nid)
        first = False
        if not follow or stop():
            break
        time.sleep(poll_s)
    for f, _ in files.values():
        f.close()


def register(app: typer.Typer) -> None:
    @app.command()
    def logs(
        node: str | None = typer.Argument(None, help="Node id (see `spotctl status`), or 'head'."),
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
        which: str = typer.Option("train", "--log", help="train | agent | node"),
        lines: int = typer.Option(50, "--lines", "-n", min=0),
        all_nodes: bool = typer.Option(False, "--all", help="Every node's log, interleaved "
                                       "with node prefixes; with -f follows joins and leaves."),
    ) -> None:
        """Print a node's training (or agent) log, or every node's with --all."""
        if (node is None) == (not all_nodes):
            raise SpecError("give a NODE or --all (not both)")
        store = open_store()
        name = resolve_name(store, name)
        row = store.get_cluster(name)
        cdir = store.cluster_dir(name)
        if which not in LOGS:
            raise SpecError(f"--log must be one of {', '.join(LOGS)}")
        if node is None:
            if row.provider != "local":
                raise SpecError("logs --all reads local clusters' logs; for a cloud node use "
                                "`spotctl logs NODE`")
            cluster = name

            def nodes() -> list[tuple[str, Path, bool]]:
                return [(n.id, cdir.nodes_dir / n.id / LOGS[which], n.ended_at is not None)
                        for n in store.nodes(cluster)]

            try:
                interleave(nodes, lines, follow, _write)
            except KeyboardInterrupt:
                pass
            return
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
