from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from spotctl.cli.common import console, open_store, print_json
from spotctl.errors import NotFoundError, SpotctlError
from spotctl.spec import load_spec


def spec_from_flags(config: Path | None, **flags: Any):
    overrides = {
        "name": flags.get("name"), "provider": flags.get("provider"), "gpus": flags.get("gpus"),
        "train.script": flags.get("script"), "train.max_steps": flags.get("max_steps"),
        "train.checkpoint_every": flags.get("checkpoint_every"),
        "budget.max_usd_per_hour": flags.get("budget"),
    }
    # a missing script is an error with --dry-run too (exit 2): the plan would not run
    return load_spec(config, overrides)


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        gpus: str = typer.Option(None, "--gpus", help="Total GPUs: MIN..MAX or N."),
        provider: str = typer.Option(None, "--provider", help="local | aws | gcp | ssh"),
        name: str = typer.Option(None, "--name", help="Cluster name."),
        config: Path = typer.Option(None, "--config", help="Spec file (default ./spotctl.toml)."),
        script: str = typer.Option(None, "--script", help="Training script."),
        max_steps: int = typer.Option(None, "--max-steps", min=0),
        checkpoint_every: int = typer.Option(None, "--checkpoint-every", min=1),
        budget: float = typer.Option(None, "--budget", min=0, help="USD/h cap (0 = none)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Plan only; launch nothing."),
        json_out: bool = typer.Option(
            False, "--json", help="Print the result as JSON (phases: JSON lines on stderr)."),
        wait: float = typer.Option(180.0, "--wait", min=0, help="Seconds to wait for nodes."),
    ) -> None:
        """Start (or reconcile) a cluster: head, nodes, and the elastic training job."""
        from spotctl.control import reconcile

        spec = spec_from_flags(config, name=name, provider=provider, gpus=gpus, script=script,
                               max_steps=max_steps, checkpoint_every=checkpoint_every,
                               budget=budget, dry_run=dry_run)
        store = open_store()
        if dry_run:
            from spotctl.providers import network_of

            res = reconcile.reconcile(store, spec, dry_run=True)
            if json_out:
                from spotctl.providers.checks import jsonable

                out = res.to_json()
                provider = reconcile.provider_for(store, spec, None)
                for a in out.get("actions", []):  # each launch names its nodes' network
                    for la in [a, *a.get("launches", [])]:
                        if la.get("instance_type"):
                            offer = _offer_of(res.plan, la)
                            la["network"] = network_of(spec, offer)
                            if hasattr(provider, "preview"):  # the request `up` would send
                                try:
                                    la["request"] = jsonable(provider.preview(offer, la["count"]))
                                except SpotctlError as err:  # e.g. no image: `check` says
                                    la["request_error"] = " ".join(str(err).split())
                return print_json(out)
            con = console()
            if not res.plan.actions:
                con.print("nothing to launch: " + "; ".join(res.plan.notes))
            for act in res.plan.actions:
                for a in (act.launches if act.type == "move" else (act,)):
                    o = a.offer
                    if o is None:
                        con.print(f"{a.type}: {a.reason}")
                        continue
                    con.print(f"launch {a.count} x {o.instance_type} ({o.gpus} GPU) in {o.zone} "
                              f"at ${o.spot_price:.4f}/h each, network {network_of(spec, o)}: "
                              f"{a.reason}")
            for note in res.plan.notes if res.plan.actions else ():
                con.print(f"note: {note}")
            return
        from spotctl.cli.up_progress import Reporter, first_step_wait_s, watch
        from spotctl.control.address import fill_ssh_cidr

        first_step_wait_s()  # a bad SPOTCTL_UP_STEP_WAIT_S stops `up` before it launches
        from spotctl.control import jobmark

        # a reused name never resumes another job's checkpoints (before anything starts)
        jobmark.check(spec, store.cluster_dir(spec.name))
        con = console(stderr=True)
        filled = fill_ssh_cidr(spec)  # an unset [aws]/[gcp] ssh_cidr: this machine's address
        if filled:
            con.print(f"up: {filled}", highlight=False, markup=False, soft_wrap=True)
        live = con.is_terminal and not json_out
        try:
            was_up = store.get_cluster(spec.name).state != "down"
        except NotFoundError:
            was_up = False
        try:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"),
                          TimeElapsedColumn(), console=con, transient=True,
                          disable=not live) as prog:
                task = prog.add_task("reconciling", total=None)
                phases = Reporter(json_out, (lambda line: prog.update(task, description=line))
                                  if live else None,
                                  lambda line: prog.console.print(f"up: {line}"))
                # the SSH rule follows this machine's ssh_cidr (aws; gcp reconciles its rules)
                res = reconcile.reconcile(store, spec, progress=phases.reconcile,
                                          options={"follow_ssh_cidr": True})
                jobmark.mark(spec, store.cluster_dir(spec.name))
                seen, want, training = watch(store, spec.name, wait, phases, spec.gpus.min)
        except KeyboardInterrupt:
            interrupted(store, spec.name, was_up)
        out = res.to_json()
        out["nodes_reporting"] = seen
        out["training"] = training
        if json_out:
            print_json(out)
        else:
            console().print(
                f"cluster {spec.name}: {len(res.launched)} node(s) launched, "
                f"{seen}/{want} reporting{', training' if training else ''}; "
                f"`spotctl status` to watch"
            )
            for e in res.errors:
                console().print(f"warning: {e}")
            from spotctl.providers.local import private

            note = private.missing_note(store.cluster_dir(spec.name).path,
                                        private.setting(spec))
            if note:
                console().print(note, highlight=False, markup=False, soft_wrap=True)
            if spec.provider == "local" or spec.head_rebalances:
                from spotctl.head.client import HeadUnavailable

                try:
                    running = "rebalancer" in reconcile.head_client(store, spec.name).status()
                except HeadUnavailable:
                    running = spec.head_rebalances
                note = head_loop_note(spec.head_rebalances, running)
                if note:
                    console().print(note, highlight=False, markup=False, soft_wrap=True)
            elif spec.provider in ("aws", "gcp"):
                from spotctl.control.cron import replacement_hint

                hint = replacement_hint(spec.name)
                if hint:
                    console().print(f"note: {hint}", highlight=False, markup=False,
                                    soft_wrap=True)
        if want and seen < want:
            raise SpotctlError(f"only {seen} of {want} nodes reported within {wait:.0f}s "
                               "(see `spotctl logs --all`)")
        if res.bootstrap_failed and not seen:
            # every node's bootstrap failed: those nodes are gone already (they would only
            # bill), and nothing reports
            first = next(e for e in res.errors if e.startswith(res.bootstrap_failed[0]))
            raise SpotctlError(f"no node came up: {first}")


SECOND_CTRL_C_S = 3.0  # after a Ctrl-C in `up`: a second one within this stops the cluster


class Interrupted(SpotctlError):
    """Ctrl-C in `up` (the shell's exit status for SIGINT)."""

    exit_code = 130


def interrupted(store: Any, name: str, was_up: bool) -> None:
    """Ctrl-C in `up`: say what goes on without `up` (the cluster keeps starting: the head
    and any node launched run on) and how to stop it; a second Ctrl-C within
    SECOND_CTRL_C_S stops what this `up` started (`spotctl down`; checkpoints kept). A
    cluster that was up before this `up` is never stopped by it. Raises Interrupted."""
    import time

    con = console(stderr=True)
    say = lambda line: con.print(line, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    if was_up:
        say(f"up: interrupted; cluster {name} was up before and goes on "
            "(`spotctl down` stops it)")
        raise Interrupted(f"interrupted: cluster {name} goes on")
    say(f"up: interrupted; cluster {name} is still starting (its head and the nodes "
        f"launched go on); `spotctl down` stops it. Ctrl-C again within "
        f"{SECOND_CTRL_C_S:.0f} s stops it now")
    try:
        time.sleep(SECOND_CTRL_C_S)
    except KeyboardInterrupt:
        from spotctl.control import reconcile

        say(f"up: stopping cluster {name}")
        res = reconcile.teardown(store, name)
        say(f"up: cluster {name} is down (checkpoints kept)"
            + (f"; LEAKS: {res.leaks}" if res.leaks else ""))
        raise Interrupted(f"interrupted: cluster {name} stopped") from None
    raise Interrupted(f"interrupted: cluster {name} is still starting (`spotctl down` "
                      "stops it)")


def head_loop_note(wanted: bool, running: bool) -> str:
    """What `up` says of a cluster's reconcile loop on its head: the head runs it or not, and
    whether that is what the spec now asks (the head takes the setting when it starts)."""
    if wanted and running:
        return "the head replaces lost nodes itself ([rebalance] on_head)"
    if not wanted and not running:
        return ""
    now = "runs" if running else "does not run"
    return (f"note: this cluster's head {now} the reconcile loop, which [rebalance] on_head "
            f"= {str(wanted).lower()} changes when the head starts again (`spotctl down`, "
            "then `up`)")


def _offer_of(plan: Any, d: dict[str, Any]) -> Any:
    """The offer of the plan's launch that `d` (its JSON) describes."""
    for act in plan.actions:
        for a in (*act.launches, act):
            o = a.offer
            if o is not None and (o.instance_type, o.zone, o.provider, o.placement) == (
                    d.get("instance_type"), d.get("zone"), d.get("provider"),
                    d.get("placement", "")):
                return o
    raise KeyError(d.get("instance_type"))
