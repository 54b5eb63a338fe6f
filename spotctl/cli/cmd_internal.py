"""Commands the system runs itself: the head and the node agent."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command(hidden=True)
    def head(
        dir: Path = typer.Option(..., "--dir"),
        token_file: Path = typer.Option(..., "--token-file"),
        host: str = typer.Option("127.0.0.1", "--host"),
        http_port: int = typer.Option(0, "--http-port"),
        store_port: int = typer.Option(0, "--store-port"),
        supervise: bool = typer.Option(False, "--supervise", help="Restart it when it dies."),
        lighthouse_port: int = typer.Option(
            -1, "--lighthouse-port", help="Run torchft's Lighthouse on this port (0: any; "
            "-1: none) for the torchft engine."),
        rebalance: str = typer.Option(
            "", "--rebalance", help="Run this cluster's reconcile loop (rebalance --watch)."),
        rebalance_home: Path | None = typer.Option(
            None, "--rebalance-home", help="--rebalance: the state directory it uses."),
        rebalance_interval: float = typer.Option(
            60.0, "--rebalance-interval", help="--rebalance: seconds between runs."),
        rebalance_bundle: Path | None = typer.Option(
            None, "--rebalance-bundle", help="Run the reconcile loop of the cluster this "
            "bundle describes, from a state directory beside it (a cloud head)."),
    ) -> None:
        """Run the head (rendezvous store + coordinator API)."""
        from spotctl.head.server import run_head, supervise_head

        loop = None
        if rebalance:
            from spotctl.head.rebalancer import Rebalancer
            from spotctl.state import home

            loop = Rebalancer(rebalance, rebalance_home or home(), dir / "rebalance.log",
                              rebalance_interval)
        elif rebalance_bundle is not None:
            from spotctl.head.rebalancer import Rebalancer

            if not supervise:  # the supervisor hands the bundle to the head it runs
                loop = Rebalancer.from_bundle(rebalance_bundle, token_file,
                                              dir / "rebalance.log")
        if supervise:
            argv = ["--dir", str(dir), "--token-file", str(token_file), "--host", host,
                    "--http-port", str(http_port), "--store-port", str(store_port),
                    "--lighthouse-port", str(lighthouse_port)]
            if loop is not None:
                argv += ["--rebalance", rebalance, "--rebalance-home", str(loop.home),
                         "--rebalance-interval", f"{rebalance_interval:g}"]
            elif rebalance_bundle is not None:
                argv += ["--rebalance-bundle", str(rebalance_bundle)]
            raise typer.Exit(supervise_head(argv, dir))
        from spotctl.head.samples import start_sampler
        from spotctl.providers.local.capacity import reclaim_hook

        start_sampler(dir, token_file)  # what `spotctl report` draws between events

        # the head sits below the providers: whoever starts it hands in the local
        # provider's capacity schedule (a no-op unless the cluster has one)
        run_head(dir, token_file, host, http_port, store_port, reclaim=reclaim_hook(dir.parent),
                 lighthouse_port=lighthouse_port, rebalancer=loop)

    @app.command(hidden=True)
    def agent(config: Path = typer.Option(..., "--config")) -> None:
        """Run the node agent."""
        from spotctl.agent.supervisor import run_agent

        raise typer.Exit(run_agent(config))
