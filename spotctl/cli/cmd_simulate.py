"""`spotctl simulate`: replay a spot trace and compare spotctl, restart and on-demand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from spotctl.cli.common import console, print_json
from spotctl.control.tables import Col, fit_table
from spotctl.errors import SpecError
from spotctl.spec import DEFAULT_ENGINE, ENGINES

SHIPPED_TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"


def _trace_path(text: str) -> Path:
    """A path, or the name of a trace shipped in spotctl/data/traces (with or without suffix)."""
    p = Path(text).expanduser()
    if p.exists():
        return p
    if p.name != text:  # a path that does not exist, not a shipped trace's name
        raise SpecError(f"--trace {text}: no such file")
    for cand in (SHIPPED_TRACES / text, *sorted(SHIPPED_TRACES.glob(f"{text}.*"))):
        if cand.is_file():
            return cand
    raise SpecError(f"--trace {text}: no such file (nor a shipped trace in {SHIPPED_TRACES})")


SIM_COLS = (
    Col("policy"), Col("cost $", right=True), Col("steps", right=True, drop=3),
    Col("$/step÷OD", right=True), Col("goodput", right=True),
    Col("finish h", right=True, drop=2), Col("lost", right=True, drop=4),
    Col("preempted", right=True, drop=1, short="pre/ntc"),
)


def build_table(data: dict[str, Any], width: int = 120) -> Table:
    """Pure renderer of `simulate`'s JSON document, fit to `width`."""
    tr, m = data["trace"], data["model"]

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    rows = [(
        r["policy"], f"{r['cost_usd']:.2f}", f"{r['progress_steps']:.0f}",
        fmt(r["cost_per_progress_vs_on_demand"], ".3f"), fmt(r["goodput_vs_oracle"], ".3f"),
        fmt(r["time_to_finish_h"], ".2f"), f"{r['lost_steps']:.0f}",
        f"{r['preemptions']}/{r['notices']}",
    ) for r in data["policies"]]
    return fit_table(
        SIM_COLS, rows, width,
        title=(
            f"{tr['name']} ({tr['format']}, {tr['span_h']:.1f} h, {tr['removals']} removals), "
            f"{m['nodes']} nodes, target {m['target_steps']:.0f} steps, "
            f"{m.get('engine', 'torchrun')} engine"
        ),
        caption=(
            f"spot: {m['spot_source']}; on-demand {m['on_demand_usd_per_node_hour']} $/node-h: "
            f"{m['on_demand_source']}; goodput = steps / oracle ({m['oracle_steps']:.0f}); "
            f"$/step÷OD = cost per step / on-demand's; preempted = preemptions/notices"
        ),
    )


def simulate_cmd(
    trace: str = typer.Option(
        ..., "--trace", help="spot-traces JSON or bamboo CSV file (or a shipped trace's name)"
    ),
    policy: str = typer.Option("all", "--policy", help="spotctl | restart | ondemand | all"),
    nodes: int | None = typer.Option(
        None, "--nodes", help="target nodes [default: the trace's maximum]"
    ),
    gpus_per_node: int | None = typer.Option(
        None, "--gpus-per-node", help="[default: from the trace name, else 1]"
    ),
    hours: float | None = typer.Option(None, "--hours", help="replay only the first H hours"),
    target_steps: float | None = typer.Option(
        None, "--target-steps", help="steps to finish [default: what on-demand does in the span]"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    plot: Path | None = typer.Option(
        None, "--plot", help="write a PNG of nodes and progress over time"
    ),
    recovery_json: Path | None = typer.Option(
        None, "--recovery-json",
        help="measured timings from scripts/bench (model field names; the engine's own win)"
    ),
    spot_price: float | None = typer.Option(
        None, "--spot-price", help="USD per node-hour (overrides catalog and trace)"
    ),
    on_demand_price: float | None = typer.Option(
        None, "--on-demand-price", help="USD per node-hour"
    ),
    instance_type: str | None = typer.Option(
        None, "--instance-type", help="catalog price lookup [default: from the trace name]"
    ),
    region: str | None = typer.Option(
        None, "--region", help="catalog price lookup [default: from the trace name]"
    ),
    step_time: float | None = typer.Option(None, "--step-time", help="seconds per step [2.0]"),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", help="steps between checkpoints [300]"
    ),
    checkpoint_cost: float | None = typer.Option(
        None, "--checkpoint-cost", help="seconds blocked per checkpoint [2.0]"
    ),
    notice_recovery: float | None = typer.Option(
        None, "--notice-recovery", help="spotctl notice -> resumed, s [torchft 0.3, torchrun 10]"
    ),
    hard_recovery: float | None = typer.Option(
        None, "--hard-recovery",
        help="spotctl loss without notice -> resumed, s [torchft 10, torchrun 30]"
    ),
    join_pause: float | None = typer.Option(
        None, "--join-pause", help="spotctl pause when a node joins, s [torchft 0.2, torchrun 10]"
    ),
    provision: float | None = typer.Option(
        None, "--provision", help="launch -> node ready, s [120]"
    ),
    job_start: float | None = typer.Option(
        None, "--job-start", help="cold job start on fresh nodes, s [60]"
    ),
    teardown: float | None = typer.Option(
        None, "--teardown", help="restart: teardown of survivors, s [60]"
    ),
    restart_retry: float | None = typer.Option(
        None, "--restart-retry", help="restart: wait between launch attempts, s [60]"
    ),
    reconcile_interval: float | None = typer.Option(
        None, "--reconcile-interval", help="spotctl rebalance period, s [300]"
    ),
    notice_fraction: float | None = typer.Option(
        None, "--notice-fraction", help="share of preemptions with a usable notice [0.9]"
    ),
    engine: str = typer.Option(
        DEFAULT_ENGINE, "--engine",
        help="training engine whose pauses and losses to model: torchft | torchrun",
    ),
) -> None:
    """Replay a spot trace: cost, progress and time to finish per policy."""
    from spotctl.simulate import POLICIES, SimModel, load_recovery_json, read_trace, resolve_prices
    from spotctl.simulate.model import with_overrides

    if policy == "all":
        policies: tuple[str, ...] = POLICIES
    elif policy in POLICIES:
        policies = (policy,)
    else:
        raise SpecError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}, all")
    if nodes is not None and nodes < 1:
        raise SpecError(f"--nodes {nodes}: must be at least 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise SpecError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    # every number flag: finite and in a range where the simulation ends in bounded time
    for flag, v, lo, hi in (
        ("--hours", hours, 1e-6, 1e6), ("--target-steps", target_steps, 1, 1e15),
        ("--step-time", step_time, 1e-4, 1e6), ("--checkpoint-cost", checkpoint_cost, 0, 1e6),
        ("--notice-recovery", notice_recovery, 0, 1e6),
        ("--hard-recovery", hard_recovery, 0, 1e6), ("--join-pause", join_pause, 0, 1e6),
        ("--provision", provision, 0, 1e6), ("--job-start", job_start, 0, 1e6),
        ("--teardown", teardown, 0, 1e6), ("--restart-retry", restart_retry, 1, 1e6),
        ("--reconcile-interval", reconcile_interval, 1, 1e6),
        ("--notice-fraction", notice_fraction, 0, 1), ("--spot-price", spot_price, 0, 1e5),
        ("--on-demand-price", on_demand_price, 0, 1e5),
    ):
        if v is not None and not (math.isfinite(v) and lo <= v <= hi):
            raise SpecError(f"{flag} {v}: must be a number from {lo:g} to {hi:g}")
    if hours is not None and hours <= 0:
        raise SpecError(f"--hours {hours}: must be positive")
    if target_steps is not None and target_steps <= 0:
        raise SpecError(f"--target-steps {target_steps}: must be positive")

    tr = read_trace(_trace_path(trace))
    if hours is not None:
        tr = tr.truncated(hours)
    if engine not in ENGINES:
        raise SpecError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    model = SimModel.for_engine(engine)
    if recovery_json is not None:
        model = with_overrides(model, load_recovery_json(recovery_json, engine))
    model = with_overrides(
        model,
        {
            "step_time_s": step_time,
            "checkpoint_every": checkpoint_every,
            "checkpoint_cost_s": checkpoint_cost,
            "notice_recovery_s": notice_recovery,
            "hard_recovery_s": hard_recovery,
            "join_pause_s": join_pause,
            "provision_s": provision,
            "job_start_s": job_start,
            "teardown_s": teardown,
            "restart_retry_s": restart_retry,
            "reconcile_interval_s": reconcile_interval,
            "notice_fraction": notice_fraction,
            "spot_price": spot_price,
            "on_demand_price": on_demand_price,
        },
    )
    prices = resolve_prices(
        model, tr.prices, instance_type or tr.instance_type, region or tr.region
    )
    from spotctl.simulate import simulate

    result = simulate(
        tr,
        model,
        prices,
        policies,
        nodes=nodes,
        gpus_per_node=gpus_per_node or tr.gpus_per_node or 1,
        target_steps=target_steps,
    )
    data = result.to_json()
    if plot is not None:
        from spotctl.simulate.plot import write_plot

        write_plot(result, plot)
        data["plot"] = str(plot)
    if as_json:
        print_json(data)
        return
    con = console()
    con.print(build_table(data, con.width))
    if plot is not None:
        con.print(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
