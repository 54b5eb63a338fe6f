"""The goodput table: every shipped trace and the synthetic ones (Poisson and bursty
departures, seeds 1 and 2) replayed under one engine's model, each as goodput against the
oracle and the shares of the oracle lost to each cause. `scripts/sim-goodput` prints it;
`scripts/docs-figures` renders the benchmarks page's goodput table from it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spotctl.simulate.engine import GAP_KEYS, simulate
from spotctl.simulate.model import SimModel, resolve_prices, with_overrides
from spotctl.simulate.traces import Trace, bursty_trace, poisson_trace, read_trace

TRACES_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"
SEEDS = (1, 2)


def traces(only: Iterable[str] | None = None) -> list[Trace]:
    """The shipped traces (sorted by file name), then Poisson and bursty ones of 8 nodes
    over 48 h for each seed; `only`: just the traces of those names."""
    out = [read_trace(p) for p in sorted(TRACES_DIR.glob("*")) if p.suffix in (".json", ".csv")]
    for seed in SEEDS:
        out.append(poisson_trace(nodes=8, hours=48, seed=seed))
        out.append(bursty_trace(nodes=8, hours=48, seed=seed))
    if only is not None:
        want = set(only)
        out = [t for t in out if t.name in want]
    return out


def model_for(engine: str, overrides: Mapping[str, float] | None = None) -> SimModel:
    """The engine's model with `overrides` (SimModel field -> value) applied."""
    model = SimModel.for_engine(engine)
    if overrides:
        model = with_overrides(model, dict(overrides))
    return model


def goodput_rows(
    model: SimModel,
    *,
    blind: bool = False,
    only: Iterable[str] | None = None,
    digits: int = 4,
) -> list[dict[str, Any]]:
    """One row per trace: its name, nodes, goodput (progress / oracle steps) and each
    cause's share of the oracle (`GAP_KEYS`), rounded to `digits`."""
    rows = []
    for tr in traces(only):
        prices = resolve_prices(model, tr.prices, tr.instance_type, tr.region)
        res = simulate(tr, model, prices, ("spotctl",), blind_offers=blind)
        r = res.results[0]
        o = res.oracle_steps or 1.0
        rows.append(
            {
                "trace": tr.name,
                "nodes": res.nodes,
                "goodput_vs_oracle": round(r.progress_steps / o, digits),
                "gap_share": {k: round(r.gap[k] / o, digits) for k in GAP_KEYS},
            }
        )
    return rows
