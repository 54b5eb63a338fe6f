from __future__ import annotations

import datetime as dt
import time
from typing import Any

import typer

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name
from spotctl.errors import NotFoundError, SpecError, SpotctlError

MAX_IN_S = 3600  # a notice's lead time (clouds give 30 s to 2 min)


def notice_line(node: str, style: str, deadline: float | None, now: float) -> str:
    """`notice sent to n2 (aws): hard stop in 120 s, at 14:03:05 (local time)`."""
    if deadline is None:
        return f"notice sent to {node} ({style}); no hard stop announced"
    at = dt.datetime.fromtimestamp(deadline).strftime("%H:%M:%S")
    return (f"notice sent to {node} ({style}): hard stop in {max(0.0, deadline - now):.0f} s, "
            f"at {at} (local time)")


def refuse_if_done(store: Any, name: str, node: str) -> None:
    """A notice only makes sense to a node that trains: one line (non-zero exit) when the
    node is not among the cluster's live nodes (naming those that are) or when its job has
    already finished (or crashed), where a notice would change nothing."""
    from spotctl.control.reconcile import head_client
    from spotctl.head.client import HeadUnavailable

    live = [n.id for n in store.nodes(name, include_ended=False)]
    if node not in live:
        raise NotFoundError(f"node {node} is not running in cluster {name}; its nodes now: "
                            f"{', '.join(live) or 'none'} (`spotctl status`)")
    try:
        h = head_client(store, name, timeout_s=2).status().get("nodes", {}).get(node) or {}
    except HeadUnavailable:
        return  # the provider's preempt says what it can
    if h.get("state") == "finished":
        raise SpotctlError(f"the job on {node} already finished (step {h.get('step')}): "
                           "nothing to preempt")
    if h.get("state") == "crashed":
        raise SpotctlError(f"{node}'s workers crashed ({h.get('error')}): nothing to preempt")


def register(app: typer.Typer) -> None:
    @app.command()
    def preempt(
        node: str = typer.Argument(..., help="Node id."),
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        style: str = typer.Option("aws", "--style", help="aws (2 min notice) | gcp (30 s)"),
        in_s: float = typer.Option(None, "--in", min=1, max=MAX_IN_S,
                                   help="Seconds until the hard stop (1 to 3600; default the "
                                        "style's: 120 or 30). A gcp node's agent still counts 30."),
        json_out: bool = typer.Option(False, "--json"),
    ) -> None:
        """Local clusters: send a preemption notice to a node, as the cloud would."""
        from spotctl.control.reconcile import provider_for
        from spotctl.spec import ClusterSpec

        if style not in ("aws", "gcp"):
            raise SpecError(f"--style must be aws or gcp, got {style!r}")
        store = open_store()
        name = resolve_name(store, name)
        row = store.get_cluster(name)
        if row.provider != "local":
            raise SpecError("preempt works on local clusters only (clouds send their own)")
        refuse_if_done(store, name, node)
        prov = provider_for(store, ClusterSpec.model_validate(row.spec))
        out = prov.preempt(node, style, in_s)
        store.add_event(name, "preempt-requested", {"node": node, "style": style, "in_s": in_s})
        if json_out:
            return print_json(out)
        console().print(notice_line(node, style, out.get("deadline"), time.time()))

    @app.command()
    def kill(
        node: str = typer.Argument(..., help="Node id."),
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
    ) -> None:
        """Local clusters: SIGKILL a node's whole process tree (a failure with no notice)."""
        from spotctl.control.reconcile import provider_for
        from spotctl.spec import ClusterSpec

        store = open_store()
        name = resolve_name(store, name)
        row = store.get_cluster(name)
        if row.provider != "local":
            raise SpecError("kill works on local clusters only")
        provider_for(store, ClusterSpec.model_validate(row.spec)).kill(node)
        store.add_event(name, "kill-requested", {"node": node})
        console().print(f"killed {node}")
