"""`spotctl ssh NODE`: a shell (or one command) on a node, with the cluster's pinned keys."""

from __future__ import annotations

import typer

from spotctl.cli.common import open_store
from spotctl.errors import NotFoundError, SpecError
from spotctl.state import NodeRow, Store


def find_node(store: Store, node: str, name: str | None) -> tuple[str, NodeRow]:
    """The live node `node` in cluster `name`, or in the one cluster that has it."""
    clusters = [name] if name else [c.name for c in store.clusters()]
    if name:
        store.get_cluster(name)  # NotFoundError naming the cluster
    hits = [(c, n) for c in clusters for n in store.nodes(c, include_ended=False) if n.id == node]
    if not hits:
        where = f"cluster {name}" if name else "any cluster"
        raise NotFoundError(f"no live node {node!r} in {where} (see `spotctl status`)")
    if len(hits) > 1:
        names = ", ".join(c for c, _ in hits)
        raise SpecError(f"node {node!r} is in several clusters ({names}); pass --name")
    return hits[0]


def register(app: typer.Typer) -> None:
    @app.command()
    def ssh(
        node: str = typer.Argument(..., help="Node id (see `spotctl status`)."),
        command: list[str] = typer.Argument(None, help="Run this instead of a shell (after --)."),
        name: str = typer.Option(None, "--name", help="Cluster name (default: the one with NODE)."),
    ) -> None:
        """Open a shell on a node over SSH (host key pinned per cluster)."""
        from spotctl.remote.ssh import open_shell, target_from_node

        store = open_store()
        cluster, row = find_node(store, node, name)
        if row.provider == "local":
            raise SpecError(
                f"node {node} of cluster {cluster} is a local process tree, not a host; "
                f"see `spotctl logs {node} --name {cluster}`"
            )
        target = target_from_node(row)
        store.close()
        open_shell(target, store.cluster_dir(cluster).known_hosts, command or None)
