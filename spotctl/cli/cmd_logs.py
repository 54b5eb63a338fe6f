from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import typer

from spotctl.cli.common import NAME_HELP, open_store, resolve_name
from spotctl.errors import NotFoundError, SpecError

LOGS = {"agent": "agent.log", "train": "torchrun.log", "node": "node.log"}
# torch's warnings that every CPU (gloo) cluster prints and that ask nothing of the user:
# `spotctl logs` leaves them out (--raw or SPOTCTL_LOGS_RAW=1 shows every line; the file
# on the node keeps them all)
HARMLESS = re.compile(
    r"socket\.cpp:\d+\] \[c10d\] The hostname of the client socket cannot be retrieved"
    r"|Unable to reset NCCL flight recorder recording"
    r"|reducer\.cpp:\d+\] Warning: find_unused_parameters=True was specified in DDP "
    r"constructor, but did not find any unused parameters")


def shown(raw: bool) -> Callable[[str], bool]:
    """Which lines `logs` prints: all with `raw` (or SPOTCTL_LOGS_RAW=1), else all but
    HARMLESS ones."""
    import os

    if raw or os.environ.get("SPOTCTL_LOGS_RAW", "") not in ("", "0"):
        return lambda line: True
    return lambda line: HARMLESS.search(line) is None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def interleave(nodes: Callable[[], list[tuple[str, Path, bool]]], lines: int, follow: bool,
               write: Callable[[str], None], poll_s: float = 0.3,
               stop: Callable[[], bool] = lambda: False,
               keep: Callable[[str], bool] = lambda line: True) -> None:
    """Every node's log with a `node | ` prefix: the last `lines` lines of each log there
    now, then (follow) new lines as they come, whole logs of nodes that join later, and a
    line when a node leaves. `nodes()` gives (id, log path, ended) and is asked again each
    poll, so joins and leaves show up. `keep`: which lines to print."""
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
                backlog = [x for x in fh.read().decode(errors="replace").splitlines()
                           if keep(x)]
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
                if keep(text := raw.decode(errors="replace")):
                    write(f"{nid:<{width}} | {text}\n")
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
        raw: bool = typer.Option(
            False, "--raw", help="Every line, torch's harmless CPU warnings too (hidden "
                                 "otherwise; SPOTCTL_LOGS_RAW=1 does the same)."),
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
                interleave(nodes, lines, follow, _write, keep=shown(raw))
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
        keep = shown(raw)
        with open(path, "rb") as f:
            data = [x for x in f.read().decode(errors="replace").splitlines() if keep(x)]
            for line in data[-lines:] if lines else []:
                print(line)
            sys.stdout.flush()
            while follow:
                chunk = f.readline()
                if chunk:
                    if keep(text := chunk.decode(errors="replace")):
                        sys.stdout.write(text)
                    sys.stdout.flush()
                else:
                    time.sleep(0.3)
