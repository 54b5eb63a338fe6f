from __future__ import annotations

import typer

from spotctl.cli.common import console, open_store, print_json
from spotctl.errors import SpecError


def register(app: typer.Typer) -> None:
    @app.command()
    def preempt(
        node: str = typer.Argument(..., help="Node id."),
        name: str = typer.Option("spotctl", "--name", help="Cluster name."),
        style: str = typer.Option("aws", "--style", help="aws (2 min notice) | gcp (30 s)"),
        in_s: float = typer.Option(None, "--in", min=1, help="Seconds until the hard stop."),
        json_out: bool = typer.Option(False, "--json"),
    ) -> None:
        """Local clusters: send a preemption notice to a node, as the cloud would."""
        from spotctl.control.reconcile import provider_for
        from spotctl.spec import ClusterSpec

        if style not in ("aws", "gcp"):
            raise SpecError(f"--style must be aws or gcp, got {style!r}")
        store = open_store()
        row = store.get_cluster(name)
        if row.provider != "local":
            raise SpecError("preempt works on local clusters only (clouds send their own)")
        prov = provider_for(store, ClusterSpec.model_validate(row.spec))
        out = prov.preempt(node, style, in_s)
        store.add_event(name, "preempt-requested", {"node": node, "style": style, "in_s": in_s})
        if json_out:
            return print_json(out)
        console().print(f"notice sent to {node} ({style}); hard stop at {out.get('deadline')}")

    @app.command()
    def kill(
        node: str = typer.Argument(..., help="Node id."),
        name: str = typer.Option("spotctl", "--name", help="Cluster name."),
    ) -> None:
        """Local clusters: SIGKILL a node's whole process tree (a failure with no notice)."""
        from spotctl.control.reconcile import provider_for
        from spotctl.spec import ClusterSpec

        store = open_store()
        row = store.get_cluster(name)
        if row.provider != "local":
            raise SpecError("kill works on local clusters only")
        provider_for(store, ClusterSpec.model_validate(row.spec)).kill(node)
        store.add_event(name, "kill-requested", {"node": node})
        console().print(f"killed {node}")
