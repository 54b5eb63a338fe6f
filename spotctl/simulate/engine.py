"""Discrete-event replay of a spot trace under three policies, with the real planner.

- spotctl: elastic. Survivors keep training at the reduced size; a preemption with a
  notice loses no step, one without loses the steps since the last committed checkpoint
  (torchrun engine: every worker restarts from it) or only the step in flight (torchft:
  the survivors keep their state in memory; `SimModel.engine`). The reconciler asks the real planner
  (`spotctl.control.planner.plan`) for replacements right after a notice and every
  `reconcile_interval_s`, with the zone cool-downs and back-offs that
  `spotctl.control.cooldown.zone_cooldowns` derives from the simulated journal
  (preempted / launch / capacity-error events, as the live reconciler journals them):
  only the clock and the provider are simulated. Offers show the trace's free capacity
  (as the local provider's do); with `blind_offers` they do not (as a cloud's), and a
  launch beyond it fails whole with a capacity error, which the journal turns into a
  back-off exactly as live. Every plan action is logged (`plan_actions`) so a replay can
  be compared with a live run's `plan-*` events.
- restart: what managed-job tools do today. Any preemption tears the whole job down and
  it restarts from the last checkpoint once the full target size can be launched again
  (gang launch through the same planner with min = max).
- ondemand: never preempted, billed at the on-demand price.

The oracle is ideal progress on all available capacity (capped at the target size) with
no overhead at all; `goodput_vs_oracle` divides by it, and `gap` says where the rest
went (in full-size steps): provisioning (nodes booting), rescale pauses (recovery, joins,
cold starts), checkpoints (blocking saves), cool-downs (free capacity not launched in
because its zone backs off), reconcile waits (free capacity waiting for the next
reconcile) and lost steps (rollbacks after losses without notice). Every policy starts at the trace
start with the nodes the trace allows already running (the job was launched before).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from spotctl.control.cooldown import zone_cooldowns
from spotctl.control.planner import Observed, ObservedNode, plan
from spotctl.providers.base import Offer
from spotctl.simulate.model import Prices, SimModel
from spotctl.simulate.traces import Trace
from spotctl.spec import ClusterSpec, GpuRange, LocalSpec, RebalanceSpec

POLICIES = ("spotctl", "restart", "ondemand")
GAP_KEYS = (
    "provisioning",
    "rescale_pauses",
    "checkpoints",
    "cool_downs",
    "reconcile_waits",
    "lost_steps",
)
MAX_FAILOVERS = 20  # as the live reconciler: re-plans after a capacity error
_EPS = 1e-9


class PriceCurve:
    """A step function of USD per node-hour over time, integrated in O(log n)."""

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        pts = sorted(points) or [(0.0, 0.0)]
        if pts[0][0] > 0:
            pts.insert(0, (0.0, pts[0][1]))
        self._t = [t for t, _ in pts]
        self._p = [p for _, p in pts]
        self._cum = [0.0]  # USD per node from 0 to each change point
        for i in range(1, len(pts)):
            self._cum.append(self._cum[-1] + self._p[i - 1] * (self._t[i] - self._t[i - 1]) / 3600)

    def at(self, t: float) -> float:
        return self._p[max(0, bisect.bisect_right(self._t, t) - 1)]

    def _cumulative(self, t: float) -> float:
        i = max(0, bisect.bisect_right(self._t, t) - 1)
        return self._cum[i] + self._p[i] * (t - self._t[i]) / 3600

    def cost(self, start: float, end: float) -> float:
        """USD for one node held over [start, end]."""
        return self._cumulative(end) - self._cumulative(start) if end > start else 0.0


@dataclass
class Job:
    """Training progress of one job: stepping, checkpoint cycles, pauses and rollbacks.

    Progress is in steps at the full target size (a step on k of N nodes counts k/N).
    """

    model: SimModel
    target_nodes: int  # N: the size a full step refers to
    target_steps: float | None  # when progress first reaches this, the job is finished
    world: int = 0  # nodes in the process group now
    progress: float = 0.0  # current training position (drops on a hard loss)
    committed: float = 0.0  # last committed checkpoint (never drops)
    cycle_pos: float = 0.0  # seconds stepped since the last checkpoint began
    ckpt_left: float = 0.0  # seconds of the blocking save still to go
    ckpt_value: float = 0.0  # progress the save in flight will commit
    resume_at: float = 0.0  # no stepping before this time (recovery, join, start)
    finished_at: float | None = None
    lost_steps: float = 0.0  # progress thrown away by rollbacks
    ckpt_node_s: float = 0.0  # node-seconds blocked in checkpoint saves

    def __post_init__(self) -> None:
        if self.target_steps is not None and self.target_steps <= 0:
            self.finished_at = 0.0

    def _gain(self, t: float, seconds: float, rate: float) -> None:
        gained = seconds * rate
        if (
            self.finished_at is None
            and self.target_steps is not None
            and self.progress + gained >= self.target_steps - _EPS * max(1.0, self.target_steps)
        ):
            need = max(0.0, self.target_steps - self.progress)
            self.finished_at = t + min(seconds, need / rate)
        self.progress += gained

    def advance(self, t0: float, t1: float) -> None:
        """Run from t0 to t1 at the current world size."""
        if self.world <= 0 or t1 <= t0:
            return
        m = self.model
        period = m.checkpoint_every * m.step_time_s
        rate = self.world / self.target_nodes / m.step_time_s
        t = max(t0, self.resume_at)
        while t < t1 - _EPS:
            if self.ckpt_left > 0:
                d = min(self.ckpt_left, t1 - t)
                self.ckpt_node_s += d * self.world
                self.ckpt_left -= d
                t += d
                if self.ckpt_left <= _EPS:
                    self.ckpt_left = 0.0
                    self.committed = max(self.committed, self.ckpt_value)
                continue
            if self.cycle_pos <= _EPS:
                # Whole checkpoint cycles at once; stop short of the target so the slow
                # path below finds the exact finishing time.
                n = math.floor((t1 - t) / m.cycle_s)
                if self.finished_at is None and self.target_steps is not None:
                    left = (self.target_steps - self.progress) / (period * rate)
                    n = min(n, max(0, math.floor(left) - 1))
                if n > 0:
                    self.ckpt_node_s += n * m.checkpoint_cost_s * self.world
                    self.progress += n * period * rate
                    self.committed = self.progress
                    t += n * m.cycle_s
                    continue
            d = min(period - self.cycle_pos, t1 - t)
            self._gain(t, d, rate)
            self.cycle_pos += d
            t += d
            if self.cycle_pos >= period - _EPS:
                self.cycle_pos = 0.0
                self.ckpt_value = self.progress
                if m.checkpoint_cost_s > 0:
                    self.ckpt_left = m.checkpoint_cost_s
                else:
                    self.committed = self.progress

    def drain(self, t: float, pause: float) -> None:
        """All ranks stop at the current step and commit it (notice or join): no loss."""
        self.committed = self.progress
        self.cycle_pos = 0.0
        self.ckpt_left = 0.0
        self.resume_at = max(self.resume_at, t + pause)

    def rollback(self, t: float, pause: float) -> None:
        """A node vanished: everyone resumes from the last committed checkpoint."""
        self.lost_steps += self.progress - self.committed
        self.progress = self.committed
        self.cycle_pos = 0.0
        self.ckpt_left = 0.0
        self.resume_at = max(self.resume_at, t + pause)

    def regroup(self, t: float, pause: float, lost: float = 0.0) -> None:
        """torchft: the survivors regroup with their state in memory (no checkpoint is
        written, the checkpoint cycle goes on); `lost`: progress of the step in flight,
        which failed and is run again."""
        lost = min(lost, max(0.0, self.progress - self.committed))
        self.lost_steps += lost
        self.progress -= lost
        self.resume_at = max(self.resume_at, t + pause)


@dataclass(frozen=True)
class Sample:
    """The state of one policy right after an event (for the plot)."""

    t_s: float
    world: int  # nodes training
    held: int  # nodes billed (includes booting and tearing-down ones)
    progress: float  # current training position in full-size steps
    committed: float  # last committed checkpoint


@dataclass
class PolicyResult:
    policy: str
    cost_usd: float
    progress_steps: float
    committed_steps: float
    lost_steps: float
    node_hours: float
    preemptions: int  # held nodes the trace took away (booting ones included)
    notices: int  # of those, drained gracefully (spotctl only)
    finished_at_s: float | None
    samples: list[Sample] = field(default_factory=list)
    # where progress short of the oracle went, in full-size steps (GAP_KEYS)
    gap: dict[str, float] = field(default_factory=dict)
    # every plan action the policy took: {"t_s", "type", "zone", "count", "reason"}
    plan_actions: list[dict[str, Any]] = field(default_factory=list)


class _Capacity:
    """Which trace nodes exist now and which of them the simulated job holds."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.held: set[str] = set()

    @staticmethod
    def _key(name: str) -> tuple[str, int, str]:
        head = name.rstrip("0123456789")
        tail = name[len(head) :]
        return (head, int(tail) if tail else -1, name)

    def free(self) -> int:
        return len(self.present - self.held)

    def acquire(self, count: int) -> list[str]:
        # Lowest slots first: count traces remove the highest slots first.
        got = sorted(self.present - self.held, key=self._key)[: max(0, count)]
        self.held.update(got)
        return got

    def release(self, name: str) -> None:
        self.held.discard(name)


@dataclass
class _Node:
    sim_id: str
    trace_node: str
    launched_at: float
    state: str  # "pending" | "running"


class _Replay:
    """Shared event loop: trace events, timed policy events, billing and sampling."""

    def __init__(
        self,
        trace: Trace,
        model: SimModel,
        prices: Prices,
        nodes: int,
        gpus_per_node: int,
        target_steps: float | None,
        policy: str,
        blind_offers: bool = False,
    ) -> None:
        self.trace = trace
        self.blind = blind_offers
        self.journal: list[dict[str, Any]] = []  # events, as the live reconciler's
        self.plan_actions: list[dict[str, Any]] = []
        self.gap_node_s = dict.fromkeys(GAP_KEYS, 0.0)
        self.no_launch_until = -math.inf  # zone back-off in force (cool-down accounting)
        self.model = model
        self.nodes = nodes
        self.gpn = gpus_per_node
        self.policy = policy
        self.curve = PriceCurve(prices.spot)
        self.od_price = prices.on_demand
        self.job = Job(model, nodes, target_steps)
        self.cap = _Capacity()
        self.held: dict[str, _Node] = {}  # trace node -> node we hold
        self.cost = 0.0
        self.node_seconds = 0.0
        self.preemptions = 0
        self.notices = 0
        self.now = 0.0
        self.samples: list[Sample] = []
        self._queue: list[tuple[float, int, int, Callable[[float], None]]] = []
        self._seq = 0
        self._ids = 0

    # -- events -------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[float], None], prio: int = 1) -> None:
        """Queue fn at time t; trace events (prio 0) go before policy events."""
        if t <= self.trace.span_s:
            self._seq += 1
            heapq.heappush(self._queue, (t, prio, self._seq, fn))

    def run(self) -> PolicyResult:
        for e in self.trace.events:
            if e.t_s <= 0:
                # What exists at the start is there before the job (warm start).
                (self.cap.present.add if e.kind == "add" else self.cap.present.discard)(e.node)
            elif e.kind == "add":
                self.at(e.t_s, partial(self._added, e.node), 0)
            else:
                self.at(e.t_s, partial(self._removed, e.node), 0)
        self.start()
        self.sample()
        while self._queue:
            t, _, _, fn = heapq.heappop(self._queue)
            self.account(self.now, t)
            self.job.advance(self.now, t)
            self.now = t
            fn(t)
            self.sample()
        end = self.trace.span_s
        self.account(self.now, end)
        self.job.advance(self.now, end)
        self.now = end
        for node in list(self.held.values()):
            self.release(node, end)
        self.sample()
        return PolicyResult(
            policy=self.policy,
            cost_usd=self.cost,
            progress_steps=self.job.progress,
            committed_steps=self.job.committed,
            lost_steps=self.job.lost_steps,
            node_hours=self.node_seconds / 3600,
            preemptions=self.preemptions,
            notices=self.notices,
            finished_at_s=self.job.finished_at,
            samples=self.samples,
            gap=self.gap(),
            plan_actions=self.plan_actions,
        )

    def account(self, t0: float, t1: float) -> None:
        """Where node-seconds of available capacity go over [t0, t1] (state is constant
        between events; the job's own checkpoint time is counted by Job)."""
        d = t1 - t0
        if d <= 0:
            return
        g = self.gap_node_s
        g["provisioning"] += d * sum(1 for n in self.held.values() if n.state == "pending")
        if self.job.world > 0 and self.job.resume_at > t0:
            g["rescale_pauses"] += (min(t1, self.job.resume_at) - t0) * self.job.world
        idle = max(0, min(len(self.cap.present), self.nodes) - len(self.held))
        if idle:
            cool = max(0.0, min(t1, self.no_launch_until) - t0)
            g["cool_downs"] += cool * idle
            g["reconcile_waits"] += (d - cool) * idle

    def gap(self) -> dict[str, float]:
        per_step = self.nodes * self.model.step_time_s
        out = {k: v / per_step for k, v in self.gap_node_s.items()}
        out["checkpoints"] = self.job.ckpt_node_s / per_step
        out["lost_steps"] = self.job.lost_steps
        return out

    def sample(self) -> None:
        s = Sample(self.now, self.job.world, len(self.held), self.job.progress, self.job.committed)
        if self.samples and self.samples[-1].t_s == s.t_s:
            self.samples[-1] = s
        else:
            self.samples.append(s)

    # -- nodes and money ----------------------------------------------------------------
    def take(self, t: float, count: int, state: str) -> list[_Node]:
        out = []
        for name in self.cap.acquire(count):
            self._ids += 1
            node = _Node(f"{self.policy}-{self._ids}", name, t, state)
            self.held[name] = node
            out.append(node)
        return out

    def release(self, node: _Node, end: float) -> None:
        self.cap.release(node.trace_node)
        self.held.pop(node.trace_node, None)
        self.bill(node.launched_at, end)

    def bill(self, start: float, end: float) -> None:
        self.cost += self.curve.cost(start, end)
        self.node_seconds += max(0.0, end - start)

    def _added(self, name: str, t: float) -> None:
        self.cap.present.add(name)

    def _removed(self, name: str, t: float) -> None:
        self.cap.present.discard(name)
        node = self.held.get(name)
        if node is not None:
            self.preemptions += 1
            self.preempted(t, node)

    # -- the planner --------------------------------------------------------------------
    def offers(self, t: float) -> list[Offer]:
        return [
            Offer(
                provider="local",
                region=self.trace.region or "sim",
                zone=self.trace.zone or "sim-a",
                instance_type=self.trace.instance_type or "sim",
                gpus=self.gpn,
                gpu_name="sim",
                spot_price=self.curve.at(t),
                on_demand_price=self.od_price,
                available=None if self.blind else self.cap.free(),
            )
        ]

    def observed(self) -> Observed:
        return Observed(
            nodes=tuple(
                ObservedNode(
                    id=n.sim_id,
                    zone=self.trace.zone or "sim-a",
                    region=self.trace.region or "sim",
                    instance_type=self.trace.instance_type or "sim",
                    gpus=self.gpn,
                    price=self.curve.at(n.launched_at),
                    state=n.state,
                )
                for n in self.held.values()
            )
        )

    def spec(self, min_nodes: int) -> ClusterSpec:
        return ClusterSpec(
            name="sim",
            provider="local",
            gpus=GpuRange(min=min_nodes * self.gpn, max=self.nodes * self.gpn),
            local=LocalSpec(gpus_per_node=self.gpn),
            rebalance=RebalanceSpec(cooldown_s=self.model.cooldown_s),
        )

    @property
    def zone(self) -> str:
        return self.trace.zone or "sim-a"

    # -- policy hooks -------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def preempted(self, t: float, node: _Node) -> None:
        raise NotImplementedError


class _Spotctl(_Replay):
    def start(self) -> None:
        self._spec = self.spec(1)
        self._losses = 0  # running nodes lost so far (indexes the notice spread)
        self.job.world = len(self.take(0.0, self.nodes, "running"))
        tick = 0.0
        while tick <= self.trace.span_s:
            self.at(tick, self.reconcile)
            tick += self.model.reconcile_interval_s

    def preempted(self, t: float, node: _Node) -> None:
        self.release(node, t)
        self.journal.append({"ts": t, "type": "preempted", "zone": self.zone})
        if node.state != "running":
            return  # lost while booting: the job never had it
        f = self.model.notice_fraction
        i = self._losses
        self._losses += 1
        # Spread notices evenly over preemptions (deterministic, no randomness).
        notice = math.ceil((i + 1) * f - _EPS) > math.ceil(i * f - _EPS)
        before = self.job.world
        self.job.world -= 1
        hot = self.model.engine == "torchft" and self.job.world > 0  # survivors keep state
        if notice:
            self.notices += 1
            if hot:
                self.job.regroup(t, self.model.notice_recovery_s)
            else:
                self.job.drain(t, self.model.notice_recovery_s)
            self.at(t, self.reconcile)  # the reconciler reacts to the notice
        elif hot:  # the step in flight at the old size fails
            self.job.regroup(t, self.model.hard_recovery_s,
                             lost=before / self.job.target_nodes)
        else:
            self.job.rollback(t, self.model.hard_recovery_s)

    def reconcile(self, t: float) -> None:
        """One live reconcile: cool-downs from the journal, the real planner, launches
        that fail whole with a capacity error when the trace lacks room (blind offers),
        and a re-plan after each such error (the zone then backs off)."""
        for _ in range(MAX_FAILOVERS):
            cd = zone_cooldowns(self.journal, self.model.cooldown_s, t)
            self.no_launch_until = cd.blocked.get(self.zone, -math.inf)
            p = plan(
                self._spec,
                self.observed(),
                cd.offers(self.offers(t)),
                cd.blocked,
                t,
                cooling=cd.cooling,
            )
            failed = False
            for action in p.launches:
                if action.count <= 0 or action.offer is None:
                    continue
                self.plan_actions.append(
                    {
                        "t_s": t,
                        "type": action.type,
                        "zone": action.offer.zone,
                        "count": action.count,
                        "reason": action.reason,
                    }
                )
                if action.count > self.cap.free():
                    self.journal.append(
                        {
                            "ts": t,
                            "type": "capacity-error",
                            "zone": self.zone,
                            "count": action.count,
                        }
                    )
                    failed = True
                    break
                for node in self.take(t, action.count, "pending"):
                    self.journal.append({"ts": t, "type": "launch", "zone": self.zone})
                    self.at(t + self.model.provision_s, partial(self.ready, node))
            if not failed:
                break
        cd = zone_cooldowns(self.journal, self.model.cooldown_s, t)
        self.no_launch_until = cd.blocked.get(self.zone, -math.inf)

    def ready(self, node: _Node, t: float) -> None:
        if self.held.get(node.trace_node) is not node:
            return  # preempted while booting
        node.state = "running"
        if self.job.world > 0 and self.model.engine == "torchft":
            self.job.regroup(t, self.model.join_pause_s)  # heals from a live peer
        elif self.job.world > 0:
            self.job.drain(t, self.model.join_pause_s)
        else:
            self.job.resume_at = t + self.model.job_start_s
            self.job.cycle_pos = 0.0
        self.job.world += 1


class _Restart(_Replay):
    def start(self) -> None:
        self._spec = self.spec(self.nodes)
        self.generation = 0  # bumps on every teardown; stale events check it
        if self.cap.free() >= self.nodes:
            self.job.world = len(self.take(0.0, self.nodes, "running"))
        else:
            self.at(0.0, self.attempt)

    def attempt(self, t: float) -> None:
        if self.held:
            return
        launches = plan(self._spec, self.observed(), self.offers(t), {}, t).launches
        count = sum(a.count for a in launches)
        if count and self.cap.free() >= count:
            self.take(t, count, "pending")
            gen = self.generation
            self.at(t + self.model.provision_s, partial(self.ready, gen))
        else:
            self.at(t + self.model.restart_retry_s, self.attempt)

    def ready(self, gen: int, t: float) -> None:
        if gen != self.generation:
            return
        for node in self.held.values():
            node.state = "running"
        self.job.world = len(self.held)
        self.job.resume_at = t + self.model.job_start_s
        self.job.cycle_pos = 0.0

    def preempted(self, t: float, node: _Node) -> None:
        self.release(node, t)
        self.generation += 1
        if self.job.world > 0:
            self.job.rollback(t, 0.0)
        self.job.world = 0
        # Survivors are torn down; they stay billed until the teardown ends.
        end = min(t + self.model.teardown_s, self.trace.span_s)
        for other in list(self.held.values()):
            self.cap.release(other.trace_node)
            self.held.pop(other.trace_node)
            self.bill(other.launched_at, end)
        self.at(end, self.attempt)


def _ondemand(
    trace: Trace, model: SimModel, prices: Prices, nodes: int, target: float | None
) -> PolicyResult:
    job = Job(model, nodes, target, world=nodes)
    job.advance(0.0, trace.span_s)
    return PolicyResult(
        policy="ondemand",
        cost_usd=nodes * prices.on_demand * trace.span_s / 3600,
        progress_steps=job.progress,
        committed_steps=job.committed,
        lost_steps=0.0,
        node_hours=nodes * trace.span_s / 3600,
        preemptions=0,
        notices=0,
        finished_at_s=job.finished_at,
        samples=[
            Sample(0.0, nodes, nodes, 0.0, 0.0),
            Sample(trace.span_s, nodes, nodes, job.progress, job.committed),
        ],
    )


def oracle_steps(trace: Trace, model: SimModel, nodes: int) -> float:
    """Ideal progress: every available node (up to the target) steps, nothing else costs."""
    return trace.node_seconds(cap=nodes) / nodes / model.step_time_s


def run_policy(
    policy: str,
    trace: Trace,
    model: SimModel,
    prices: Prices,
    nodes: int,
    gpus_per_node: int = 1,
    target_steps: float | None = None,
    blind_offers: bool = False,
) -> PolicyResult:
    if policy == "ondemand":
        return _ondemand(trace, model, prices, nodes, target_steps)
    cls = {"spotctl": _Spotctl, "restart": _Restart}.get(policy)
    if cls is None:
        raise ValueError(f"unknown policy {policy!r}")
    return cls(trace, model, prices, nodes, gpus_per_node, target_steps, policy, blind_offers).run()


@dataclass
class SimResult:
    trace: Trace
    model: SimModel
    prices: Prices
    nodes: int
    gpus_per_node: int
    target_steps: float
    oracle_steps: float
    results: list[PolicyResult]
    reference: PolicyResult  # on-demand run, the baseline for cost per progress

    def policy_rows(self) -> list[dict[str, Any]]:
        ref = self.reference
        ref_cpp = ref.cost_usd / ref.progress_steps if ref.progress_steps > 0 else None
        rows = []
        for r in self.results:
            cpp = r.cost_usd / r.progress_steps if r.progress_steps > 0 else None
            rows.append(
                {
                    "policy": r.policy,
                    "cost_usd": round(r.cost_usd, 4),
                    "progress_steps": round(r.progress_steps, 2),
                    "cost_per_progress_vs_on_demand": round(cpp / ref_cpp, 4)
                    if cpp is not None and ref_cpp
                    else None,
                    "goodput_vs_oracle": round(r.progress_steps / self.oracle_steps, 4)
                    if self.oracle_steps > 0
                    else None,
                    "time_to_finish_h": None
                    if r.finished_at_s is None
                    else round(r.finished_at_s / 3600, 4),
                    "lost_steps": round(r.lost_steps, 2),
                    "node_hours": round(r.node_hours, 4),
                    "preemptions": r.preemptions,
                    "notices": r.notices,
                    "gap_steps": {k: round(v, 2) for k, v in r.gap.items()},
                    "plan_actions": [
                        {k: (round(v, 3) if k == "t_s" else v) for k, v in a.items()}
                        for a in r.plan_actions
                    ],
                }
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        model = self.model.to_json()
        model.update(self.prices.to_json())
        model.update(
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            target_steps=round(self.target_steps, 2),
            oracle_steps=round(self.oracle_steps, 2),
        )
        return {"policies": self.policy_rows(), "trace": self.trace.summary(), "model": model}


def simulate(
    trace: Trace,
    model: SimModel,
    prices: Prices,
    policies: Sequence[str] = POLICIES,
    nodes: int | None = None,
    gpus_per_node: int = 1,
    target_steps: float | None = None,
    blind_offers: bool = False,
) -> SimResult:
    """Replay `trace` under each policy. The default target is what on-demand does in the
    trace's span (so on-demand finishes exactly at the end)."""
    n = nodes if nodes is not None else max(1, trace.max_nodes)
    reference = _ondemand(trace, model, prices, n, None)
    target = reference.progress_steps if target_steps is None else target_steps
    results = [
        run_policy(p, trace, model, prices, n, gpus_per_node, target, blind_offers)
        for p in policies
    ]
    for r in results:
        if r.policy == "ondemand":
            reference = r
    return SimResult(
        trace=trace,
        model=model,
        prices=prices,
        nodes=n,
        gpus_per_node=gpus_per_node,
        target_steps=target,
        oracle_steps=oracle_steps(trace, model, n),
        results=results,
        reference=reference,
    )
