"""Honest cost accounting for a cluster, from the journal alone.

Money: each node costs the hours it ran (launch to end, or to `now` while it runs) times
the price it was launched at. On-demand is what the same hours would have cost at the
node's on-demand price; nodes whose on-demand price is unknown (0) are left out of the
on-demand and saved figures (and counted), rather than counted as free.

GPU-hours lost to preemptions, from the head's "rescale" events whose reason is a
preemption ("notice" for a graceful one, "failure" for a hard loss):
- replayed work: lost_steps x step time x from_world_size (the work thrown away was done
  by the old world; one rank per GPU);
- downtime: notice_to_resume_s x to_world_size (the surviving GPUs, paid for, waiting
  from the notice or failure until the first step of the new world).
Step time is taken from the event when it carries `step_time_s`, else estimated per
incarnation from the journal (time from its first step until the next cause, divided by
the steps it made), else the caller's `step_time_s`; with none, replay is counted 0 and
`step_time_s` is None in the report.
The head VM (on-demand, not in the nodes table) is not included.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from spotctl.state import NodeRow, Store

PREEMPTION_REASONS = ("notice", "failure", "preempt", "lost", "interrupt")
PREEMPTION_EVENTS = ("preempted", "node-lost")


@dataclass
class NodeCost:
    id: str
    provider: str
    zone: str
    instance_type: str
    gpus: int
    state: str
    price: float  # USD/h it was launched at
    on_demand_price: float  # USD/h on demand; 0 = unknown
    hours: float
    gpu_hours: float
    spent_usd: float
    on_demand_usd: float | None  # None when the on-demand price is unknown
    saved_usd: float | None
    running: bool  # still billing (no end time yet)


@dataclass
class CostReport:
    cluster: str
    now: float
    nodes: list[NodeCost] = field(default_factory=list)
    spent_usd: float = 0.0
    on_demand_usd: float = 0.0  # over nodes whose on-demand price is known
    saved_usd: float = 0.0  # on_demand_usd minus what those same nodes cost
    saved_pct: float | None = None
    on_demand_unknown_nodes: int = 0
    usd_per_hour: float = 0.0  # what the nodes still running cost now
    gpu_hours: float = 0.0
    preemptions: int = 0  # distinct nodes preempted or lost
    preemption_rescales: int = 0
    lost_steps: int = 0
    replay_gpu_hours: float = 0.0
    downtime_gpu_hours: float = 0.0
    gpu_hours_lost: float = 0.0  # replay + downtime
    step_time_s: float | None = None  # mean step time used for replay (None: unknown)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in list(d.items()):
            if isinstance(v, float):
                d[k] = round(v, 6)
        d["nodes"] = [
            {k: round(v, 6) if isinstance(v, float) else v for k, v in n.items()}
            for n in d["nodes"]
        ]
        return d

    def header(self) -> str:
        """One line for `status`: money first, then what preemptions cost in GPU-hours."""
        pct = f" ({self.saved_pct:.0f}%)" if self.saved_pct is not None else ""
        unknown = (
            f" [{self.on_demand_unknown_nodes} node(s) without on-demand price]"
            if self.on_demand_unknown_nodes
            else ""
        )
        return (
            f"spent ${self.spent_usd:.2f}  on-demand ${self.on_demand_usd:.2f}  "
            f"saved ${self.saved_usd:.2f}{pct}{unknown}  "
            f"lost to preemptions {self.gpu_hours_lost:.3f} GPU-h "
            f"({self.preemptions} preempted, {self.lost_steps} steps replayed)"
        )


def node_cost(n: NodeRow, now: float) -> NodeCost:
    end = n.ended_at if n.ended_at is not None else now
    hours = max(0.0, end - n.launched_at) / 3600.0
    spent = hours * n.price
    od = hours * n.on_demand_price if n.on_demand_price > 0 else None
    return NodeCost(
        id=n.id,
        provider=n.provider,
        zone=n.zone,
        instance_type=n.instance_type,
        gpus=n.gpus,
        state=n.state,
        price=n.price,
        on_demand_price=n.on_demand_price,
        hours=hours,
        gpu_hours=hours * n.gpus,
        spent_usd=spent,
        on_demand_usd=od,
        saved_usd=None if od is None else od - spent,
        running=n.ended_at is None,
    )


def _is_preemption(reason: Any) -> bool:
    r = str(reason or "").lower()
    return any(p in r for p in PREEMPTION_REASONS)


def _num(v: Any, default: float = 0.0) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return default
    return x if math.isfinite(x) else default


def preemption_losses(
    events: list[dict[str, Any]], step_time_s: float | None = None
) -> tuple[int, int, float, float, float | None]:
    """(preemption rescales, lost steps, replay GPU-h, downtime GPU-h, step time used).

    `events` in journal order. Incarnations start at "train-start" and "rescale" events;
    an incarnation's step time is (next cause time - its first step) / steps it made,
    where the next cause time is the next rescale's ts minus its notice_to_resume_s and
    the steps made are the next rescale's (resume_step + lost_steps) - this resume_step.
    """
    starts = [e for e in events if e.get("type") in ("train-start", "rescale")]
    count, lost_total, replay, down = 0, 0, 0.0, 0.0
    used: list[float] = []
    for i, e in enumerate(starts):
        if e.get("type") != "rescale" or not _is_preemption(e.get("reason")):
            continue
        count += 1
        lost = int(_num(e.get("lost_steps")))
        lost_total += lost
        wait = max(0.0, _num(e.get("notice_to_resume_s")))
        down += wait * _num(e.get("to_world_size")) / 3600.0
        st = _num(e.get("step_time_s"), 0.0) or None
        if st is None and i > 0:
            prev = starts[i - 1]
            made = _num(e.get("resume_step")) + lost - _num(prev.get("resume_step"))
            ran = (_num(e.get("ts")) - wait) - _num(prev.get("ts"))
            if made > 0 and ran > 0:
                st = ran / made
        if st is None:
            st = step_time_s
        if st is not None and lost > 0:
            used.append(st)
            replay += lost * st * _num(e.get("from_world_size")) / 3600.0
    mean = sum(used) / len(used) if used else step_time_s
    return count, lost_total, replay, down, mean


def cluster_cost(
    store: Store, cluster: str, now: float, step_time_s: float | None = None
) -> CostReport:
    """The cost report of `cluster` at time `now` (NotFoundError if there is none)."""
    store.get_cluster(cluster)
    rows = store.nodes(cluster)
    r = CostReport(cluster=cluster, now=now, nodes=[node_cost(n, now) for n in rows])
    for n in r.nodes:
        r.spent_usd += n.spent_usd
        r.gpu_hours += n.gpu_hours
        if n.on_demand_usd is None:
            r.on_demand_unknown_nodes += 1
        else:
            r.on_demand_usd += n.on_demand_usd
            r.saved_usd += n.saved_usd or 0.0
        if n.running:
            r.usd_per_hour += n.price
    if r.on_demand_usd > 0:
        r.saved_pct = 100.0 * r.saved_usd / r.on_demand_usd
    events = store.events(cluster)
    gone = {
        str(e.get("node") or e.get("node_id") or "")
        for e in events
        if e.get("type") in PREEMPTION_EVENTS
    }
    for e in events:
        if e.get("type") in PREEMPTION_EVENTS:
            gone.update(str(x) for x in e.get("node_ids", ()) or ())
    gone.discard("")
    r.preemptions = len(gone)
    (
        r.preemption_rescales,
        r.lost_steps,
        r.replay_gpu_hours,
        r.downtime_gpu_hours,
        r.step_time_s,
    ) = preemption_losses(events, step_time_s)
    r.gpu_hours_lost = r.replay_gpu_hours + r.downtime_gpu_hours
    return r
