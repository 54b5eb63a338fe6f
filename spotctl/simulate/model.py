"""The simulator's cost model: how long things take and what they cost.

Every default below is an assumption stated with where it comes from; each can be
overridden by a flag, and the recovery times by the numbers `scripts/bench` measures
(`--recovery-json FILE`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from spotctl.errors import SpecError


@dataclass(frozen=True)
class SimModel:
    """Timings and prices of one simulated training job. Progress is counted in steps at
    the full target size: a step on k of N nodes moves the job k/N of a step forward
    (data parallel, fixed per-GPU batch, linear scaling assumed)."""

    # Seconds per training step, the same at any world size (per-GPU batch is fixed).
    # Assumed: a mid-size data-parallel model; only ratios to the other times matter.
    step_time_s: float = 2.0
    # Steps between committed checkpoints: 300 x 2 s = one every 10 minutes, a usual
    # choice for long jobs (a hard kill loses 5 minutes on average).
    checkpoint_every: int = 300
    # Seconds training is blocked per checkpoint. spotctl.elastic saves asynchronously,
    # so only the snapshot blocks; 2 s assumed until `scripts/bench` measures it.
    checkpoint_cost_s: float = 2.0
    # spotctl, graceful notice -> survivors' first step at the new size. DESIGN.md: ~10 s
    # with tuned rendezvous timeouts (default ones take ~46 s). Loses no step.
    notice_recovery_s: float = 10.0
    # spotctl, node lost without notice -> survivors step again from the last checkpoint:
    # keep-alive detection (a few seconds) + re-form (~10 s) + checkpoint load. Assumed 30 s.
    hard_recovery_s: float = 30.0
    # spotctl, a replacement joins: drain + checkpoint + re-form, no step lost (DESIGN.md
    # cycle step 6); taken equal to the notice path.
    join_pause_s: float = 10.0
    # Launch request -> node booted and bootstrapped (agent running). Assumed 2 minutes
    # for a GPU VM from a prepared image.
    provision_s: float = 120.0
    # A job started on fresh nodes: setup, torch init, checkpoint load, first step.
    # Used by every cold start (restart policy; spotctl when all nodes were lost).
    job_start_s: float = 60.0
    # restart policy: tearing down the surviving nodes before relaunching (they stay
    # billed meanwhile). Assumed 1 minute.
    teardown_s: float = 60.0
    # restart policy: wait between failed launch attempts. SkyPilot's managed-job
    # StrategyExecutor starts its backoff at 60 s (RETRY_INIT_GAP_SECONDS).
    restart_retry_s: float = 60.0
    # spotctl: the reconciler runs `rebalance` this often (DESIGN.md: cron */5) and also
    # right after a notice, so replacements are asked for at these moments.
    reconcile_interval_s: float = 300.0
    # Share of preemptions whose notice arrives early enough to drain. AWS sends a 2-min
    # instance-action and GCP a 30-s preemption notice, but some losses come without one
    # (host failure, a notice lost in flight). Assumed 0.9; spread evenly, not random.
    notice_fraction: float = 0.9
    # spotctl: a zone that preempted or refused a launch is tried last for this long;
    # capacity errors back it off from 60 s doubling up to it. The spec's default
    # (`rebalance.cooldown_s`); the decisions come from spotctl.control.cooldown.
    cooldown_s: float = 900.0
    # Spot USD per node-hour; None: from the catalog, then the trace's prices.
    spot_price: float | None = None
    # On-demand USD per node-hour; None: from the catalog.
    on_demand_price: float | None = None
    # The training engine (`[train] engine`). The defaults above are torchrun's: every
    # rescale restarts the workers, and a loss without notice sends everyone back to the
    # last committed checkpoint. On torchft (`for_engine`) the survivors keep their state:
    # a loss without notice costs only the step in flight, and no notice or join writes a
    # checkpoint (the periodic ones matter only when every node is lost).
    engine: str = "torchrun"

    @classmethod
    def for_engine(cls, engine: str, **kw: Any) -> SimModel:
        """The model of `engine` with its own pauses (fields in `kw` win)."""
        return cls(**{**ENGINE_DEFAULTS.get(engine, {}), "engine": engine, **kw})

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_DEFAULTS:
            raise SpecError(f"engine: must be one of {', '.join(ENGINE_DEFAULTS)}, got {self.engine!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or f.name == "engine":
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
                raise SpecError(f"model.{f.name}: must be a number, got {v!r}")
            if v < 0:
                raise SpecError(f"model.{f.name}: must not be negative, got {v}")
        if self.step_time_s <= 0:
            raise SpecError("model.step_time_s: must be positive")
        if self.checkpoint_every < 1:
            raise SpecError("model.checkpoint_every: must be at least 1 step")
        if self.reconcile_interval_s <= 0 or self.restart_retry_s <= 0:
            raise SpecError("model: reconcile_interval_s and restart_retry_s must be positive")
        if self.notice_fraction > 1:
            raise SpecError(
                f"model.notice_fraction: must be within 0..1, got {self.notice_fraction}"
            )

    @property
    def cycle_s(self) -> float:
        """One checkpoint interval of stepping plus its blocking save."""
        return self.checkpoint_every * self.step_time_s + self.checkpoint_cost_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# Each engine's pauses, where they differ from the dataclass's (torchrun's) defaults.
ENGINE_DEFAULTS: dict[str, dict[str, float]] = {
    "torchrun": {},
    # torchft, the goals of issue 17, which `scripts/bench recovery lost join` met on CPU
    # and gloo (4 nodes: medians 0.14 s at a notice, 0.17 s after a SIGKILL, 0.05 s at a
    # join). Not measured with NCCL on GPUs.
    "torchft": {
        "notice_recovery_s": 0.3,
        "join_pause_s": 0.2,
        # A preempted VM without notice vanishes: no RST closes its sockets (a SIGKILL
        # does, hence the bench's 0.17 s). Cut off mid-collective, the survivors give the
        # collective up once its heartbeats are 2 s stale (spotctl.elastic.ftwatch):
        # measured 2.47-2.48 s with a netns link taken down under a compute-bound step
        # (`scripts/ft-partition --compute-bound --join-timeout-ms 2000`); cut off between
        # collectives, the next quorum leaves it out (0.01-0.21 s). With a GPU's gradient
        # all-reduce spread over most of the step, the first is the usual case.
        "hard_recovery_s": 2.5,
    },
}
MODEL_FIELDS = tuple(f.name for f in fields(SimModel) if f.name != "engine")


def load_recovery_json(path: str | Path, engine: str | None = None) -> dict[str, float]:
    """Measured timings from `scripts/bench`: a JSON object whose keys are SimModel field
    names (top level, or under "sim_model"), and per engine under the engine's name
    (`{"checkpoint_cost_s": 1.2, "torchft": {"notice_recovery_s": 0.14}}`): those of
    `engine` win over the shared ones, another engine's are ignored. Other keys are
    ignored."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"--recovery-json {p}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--recovery-json {p}: not valid JSON ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("sim_model"), dict):
        doc = doc["sim_model"]
    if not isinstance(doc, dict):
        raise SpecError(f"--recovery-json {p}: expected a JSON object of model fields")
    out = _model_fields(doc, p, "")
    if engine is not None and isinstance(doc.get(engine), dict):
        out.update(_model_fields(doc[engine], p, f"{engine}."))
    if not out:
        raise SpecError(
            f"--recovery-json {p}: no known field"
            + (f" for the {engine} engine" if engine else "")
            + f" (expected some of: {', '.join(MODEL_FIELDS)})"
        )
    return out


def _model_fields(doc: dict[str, Any], p: Path, where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in doc.items():
        if k not in MODEL_FIELDS:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise SpecError(f"--recovery-json {p}: {where}{k} must be a number, got {v!r}")
        out[k] = float(v) if k != "checkpoint_every" else int(v)
    return out


def with_overrides(model: SimModel, overrides: dict[str, Any]) -> SimModel:
    return replace(model, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Prices:
    """Resolved prices per node-hour and where each came from."""

    spot: tuple[tuple[float, float], ...]  # (t_s, USD/h) change points, first at 0
    on_demand: float  # USD/h
    spot_source: str  # "flag" | "catalog:<type>@<region>" | "trace" | "default"
    on_demand_source: str

    def to_json(self) -> dict[str, Any]:
        return {
            "spot_usd_per_node_hour": self.spot[0][1]
            if len(self.spot) == 1
            else {
                "first": self.spot[0][1],
                "min": min(p for _, p in self.spot),
                "max": max(p for _, p in self.spot),
            },
            "on_demand_usd_per_node_hour": self.on_demand,
            "spot_source": self.spot_source,
            "on_demand_source": self.on_demand_source,
        }


# Last resort when neither flags, the catalog nor the trace say: p3.2xlarge (V100) in
# us-east-1, the on-demand list price, and the spot price the V100 spot-traces record.
DEFAULT_ON_DEMAND = 3.06
DEFAULT_SPOT = 0.918


def _catalog_prices(instance_type: str, region: str) -> tuple[float | None, float | None]:
    """(median spot, on-demand) from the shipped AWS catalog, (None, None) if unavailable.

    Imported lazily: the catalog module is optional for the simulator. The catalog's zones
    are AZ ids that cannot be matched to a trace's zone name, so the region's median
    spot price stands in for the zone's.
    """
    if not instance_type or not region:
        return None, None
    try:
        from spotctl.providers.aws import catalog as catalog_aws  # type: ignore[attr-defined]
    except ImportError:
        return None, None
    spot: float | None = None
    od: float | None = None
    try:
        offers = [o for o in catalog_aws.load_offers(region) if o.instance_type == instance_type]
        sp = sorted(o.spot_price for o in offers if o.spot_price and o.spot_price > 0)
        if sp:
            spot = sp[len(sp) // 2]
        od = catalog_aws.on_demand_price(instance_type, region)
        if od is None:
            ods = [o.on_demand_price for o in offers if o.on_demand_price]
            od = ods[0] if ods else None
    except Exception:  # a catalog problem must not break a simulation; fall back
        return spot, od
    return spot, (float(od) if od else None)


def resolve_prices(
    model: SimModel,
    trace_prices: tuple[tuple[float, float], ...],
    instance_type: str,
    region: str,
) -> Prices:
    """Flags first, then the shipped AWS catalog, then the trace's own spot prices."""
    cat_spot, cat_od = _catalog_prices(instance_type, region)
    where = f"catalog:{instance_type}@{region}"
    if model.spot_price is not None:
        spot: tuple[tuple[float, float], ...] = ((0.0, float(model.spot_price)),)
        spot_src = "flag"
    elif cat_spot is not None:
        spot, spot_src = ((0.0, cat_spot),), where
    elif trace_prices:
        spot, spot_src = trace_prices, "trace"
    else:
        spot, spot_src = ((0.0, DEFAULT_SPOT),), "default (p3.2xlarge us-east-1)"
    if model.on_demand_price is not None:
        od, od_src = float(model.on_demand_price), "flag"
    elif cat_od is not None:
        od, od_src = cat_od, where
    else:
        od, od_src = DEFAULT_ON_DEMAND, "default (p3.2xlarge us-east-1)"
    return Prices(spot=spot, on_demand=od, spot_source=spot_src, on_demand_source=od_src)
