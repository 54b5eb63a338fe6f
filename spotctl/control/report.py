"""`spotctl report`: a picture and the totals of a real run, running or finished.

Everything comes from what the run left behind: the journal (launches, ends, the head's
events: notices, rescales, joins, drains) and the head's `samples.jsonl` (world size, step
and throughput every few seconds, see spotctl.head.samples). The plot has the look of
`spotctl simulate --plot`, so a real run can be held beside a simulated one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spotctl.errors import NotFoundError, SpecError
from spotctl.head.samples import SAMPLES_FILE, read_samples
from spotctl.state import NodeRow, Store

# the events the plot marks, by kind
MARK_KINDS = ("notice", "hard-loss", "rescale", "join")
_HARD = ("node-unresponsive", "node-gone")


@dataclass
class Totals:
    hours: float = 0.0
    steps: int = 0
    lost_steps: int = 0
    pauses: int = 0
    pause_s: float = 0.0
    pauses_unmeasured: int = 0  # rescales whose pause the head could not measure
    notices: int = 0
    hard_losses: int = 0
    spent_usd: float = 0.0
    on_demand_usd: float = 0.0
    gpu_hours_offered: float = 0.0
    gpu_hours_training: float = 0.0
    goodput_pct: float | None = None  # training GPU-hours / offered GPU-hours


@dataclass
class Report:
    cluster: str
    provider: str
    state: str
    start: float
    end: float
    totals: Totals
    world: list[tuple[float, int]] = field(default_factory=list)  # (ts, world size), steps
    offered: list[tuple[float, int]] = field(default_factory=list)  # (ts, GPUs launched)
    usd_per_hour: list[tuple[float, float]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _step_series(nodes: list[NodeRow], end: float, value: Any) -> list[tuple[float, Any]]:
    """A step function of the live nodes' summed `value` over time."""
    deltas: list[tuple[float, Any]] = []
    for n in nodes:
        deltas.append((n.launched_at, value(n)))
        if n.ended_at is not None and n.ended_at < end:
            deltas.append((n.ended_at, -value(n)))  # still there at the end: no drop
    deltas.sort(key=lambda d: d[0])
    out: list[tuple[float, Any]] = []
    cur: Any = 0
    for ts, d in deltas:
        cur += d
        if out and out[-1][0] == ts:
            out[-1] = (ts, cur)
        else:
            out.append((ts, cur))
    return [(ts, round(v, 6) if isinstance(v, float) else v) for ts, v in out]


def _integral(series: list[tuple[float, float]], end: float) -> float:
    """Seconds x value under a step function."""
    total = 0.0
    for i, (ts, v) in enumerate(series):
        nxt = series[i + 1][0] if i + 1 < len(series) else end
        total += max(0.0, nxt - ts) * v
    return total


def marks_of(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The events the plot marks. A hard loss is a node lost without a notice: one that
    went unresponsive and never came back, or that the provider no longer lists."""
    noticed: set[str] = set()
    pauses = rescale_pauses(events)
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in MARK_KINDS}
    for i, e in enumerate(events):
        t = e.get("type")
        node = e.get("node")
        if t == "notice":
            noticed.add(str(node))
            out["notice"].append({"ts": e["ts"], "node": node})
        elif t == "node-unresponsive" and any(
            later.get("type") == "node-back" and later.get("node") == node
            for later in events[i + 1:]
        ):
            continue  # slow, not lost: it came back
        elif t in _HARD and str(node) not in noticed:
            out["hard-loss"].append({"ts": e["ts"], "node": node, "why": t})
        elif t == "rescale":
            out["rescale"].append({
                "ts": e["ts"], "from": e.get("from_world_size"), "to": e.get("to_world_size"),
                "reason": e.get("reason"), "lost_steps": e.get("lost_steps"),
                "pause_s": pauses.get(i),
            })
        elif t == "join":
            out["join"].append({"ts": e["ts"], "node": node})
    return out


def rescale_pauses(events: list[dict[str, Any]]) -> dict[int, float | None]:
    """Each rescale's pause (by its index in `events`): the head's own timing (notice_to_resume_s) when
    it saw the cause, else the survivors' measure of their regroup (torchft: a join, or a
    loss the head learnt of late), journaled with the rescale or in a later `pause` event
    for the same incarnation; None when neither was measured."""
    later = {e.get("incarnation"): e.get("pause_s") for e in events if e.get("type") == "pause"}
    out: dict[int, float | None] = {}
    for i, e in enumerate(events):
        if e.get("type") != "rescale":
            continue
        got = None
        for p in (e.get("notice_to_resume_s"), e.get("replica_pause_s"),
                  later.get(e.get("incarnation")) if e.get("incarnation") else None):
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p >= 0:
                got = float(p)
                break
        out[i] = got
    return out


def fetch_samples(store: Store, name: str) -> int:
    """A cloud head keeps its samples on its VM: copy them next to the journal, so the
    report of a finished cluster still has them. Local heads write there already.
    Returns the samples copied (0 when the head is not reachable)."""
    from spotctl.control.reconcile import head_client
    from spotctl.head.client import HeadUnavailable

    row = store.get_cluster(name)
    if row.provider == "local" or row.state == "down":
        return 0
    try:
        got = head_client(store, name, timeout_s=5).samples()
    except (HeadUnavailable, NotFoundError):
        return 0
    head_dir = store.cluster_dir(name).head_dir
    head_dir.mkdir(parents=True, exist_ok=True)
    tmp = head_dir / (SAMPLES_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in got))
    os.replace(tmp, head_dir / SAMPLES_FILE)
    return len(got)


def build(store: Store, name: str, now: float | None = None) -> Report:
    """The report of cluster `name` from its journal and samples (pure reading)."""
    now = now or time.time()
    row = store.get_cluster(name)
    events = store.events(name)
    nodes = store.nodes(name)
    downs = [e["ts"] for e in events if e["type"] == "down"]
    end = downs[-1] if row.state == "down" and downs else now
    starts = [n.launched_at for n in nodes] + [e["ts"] for e in events]
    start = min(starts) if starts else row.created_at
    samples = [s for s in read_samples(store.cluster_dir(name).head_dir / SAMPLES_FILE)
               if start <= s["ts"] <= end]

    pauses = rescale_pauses(events)
    world: list[tuple[float, int]] = []
    for i, e in enumerate(events):
        if e["type"] == "train-start":
            world.append((e["ts"], int(e.get("world_size") or 0)))
        elif e["type"] == "rescale":
            pause = pauses.get(i) or 0.0
            if world and pause > 0 and e["ts"] - pause > world[-1][0]:
                world.append((e["ts"] - pause, 0))  # no step ran while the group re-formed
            world.append((e["ts"], int(e.get("to_world_size") or 0)))
    if world and row.state == "down":
        world.append((end, 0))
    offered = _step_series(nodes, end, lambda n: n.gpus)
    usd = _step_series(nodes, end, lambda n: float(n.price))
    marks = marks_of(events)

    tot = Totals(hours=round((end - start) / 3600, 4))
    rescales = [e for e in events if e["type"] == "rescale"]
    # steps thrown away at rescales and at torchft's regroups of the same replicas (a
    # failed commit vote); a pause that could not be measured (null) is none, not 0 s
    tot.lost_steps = sum(int(e.get("lost_steps") or 0) for e in events
                         if e["type"] in ("rescale", "regroup"))
    tot.pauses = len(rescales)
    # (a negative one, written by an older head, measured nothing either)
    measured = [p for p in pauses.values() if p is not None]
    tot.pause_s = round(sum(measured), 3)
    tot.pauses_unmeasured = len(rescales) - len(measured)
    tot.notices = len(marks["notice"])
    tot.hard_losses = len(marks["hard-loss"])
    steps = [int(s.get("step") or 0) for s in samples]
    steps += [int(e.get("step") or 0) for e in events if e["type"] == "drain-committed"]
    steps += [int(e.get("resume_step") or 0) for e in events if e["type"] in
              ("rescale", "train-start")]
    tot.steps = max(steps, default=0)
    try:
        from spotctl.control.cost import cluster_cost

        c = cluster_cost(store, name, end)
        tot.spent_usd, tot.on_demand_usd = round(c.spent_usd, 6), round(c.on_demand_usd, 6)
    except Exception:  # a report still draws when cost accounting cannot
        tot.spent_usd = round(_integral([(t, v) for t, v in usd], end) / 3600, 6)
    tot.gpu_hours_offered = round(_integral([(t, float(v)) for t, v in offered], end) / 3600, 6)
    # GPU-time that trained: with samples, intervals in which the step advanced; without,
    # the world-size step function (pauses already cut out)
    if len(samples) >= 2:
        trained = 0.0
        for a, b in zip(samples, samples[1:], strict=False):
            if int(b.get("step") or 0) > int(a.get("step") or 0):
                t0, w = a["ts"], int(a.get("world_size") or 0)
                if not w:
                    # no group yet at the first sample: training began inside the interval,
                    # at the journal's last start in it, with the size of the second sample
                    w = int(b.get("world_size") or 0)
                    t0 = max((t for t, v in world if a["ts"] <= t <= b["ts"] and v > 0),
                             default=a["ts"])
                trained += (b["ts"] - t0) * w
    else:
        trained = _integral([(t, float(v)) for t, v in world], end)
    # world size counts GPUs (one rank per GPU), as the offered series does
    tot.gpu_hours_training = round(trained / 3600, 6)
    if tot.gpu_hours_offered > 0:
        tot.goodput_pct = round(100 * min(1.0, tot.gpu_hours_training / tot.gpu_hours_offered), 1)
    return Report(cluster=name, provider=row.provider, state=row.state, start=start, end=end,
                  totals=tot, world=world, offered=offered, usd_per_hour=usd,
                  samples=samples, marks=marks)


MARK_STYLE = {  # kind: (colour, line style, label)
    "notice": ("tab:orange", "--", "notice"),
    "hard-loss": ("tab:red", "-", "hard loss"),
    "rescale": ("tab:purple", ":", "rescale"),
    "join": ("tab:blue", "-.", "join"),
}


def write_plot(rep: Report, path: str | Path) -> dict[str, list[float]]:
    """Draw and save the run; returns the x (seconds since start) of each drawn mark,
    read back from the figure. Raises SpecError when matplotlib is missing or the path is
    unwritable."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--plot needs matplotlib (pip install 'spotctl[sim]')") from None
    out = Path(path)
    span = max(1.0, rep.end - rep.start)
    unit, div = ("hours", 3600.0) if span > 7200 else ("minutes", 60.0)

    def x(ts: float) -> float:
        return (ts - rep.start) / div

    fig, (ax_n, ax_p, ax_c) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 3, 1.4]})
    drawn: dict[str, list[float]] = {k: [] for k in MARK_KINDS}
    try:
        if rep.offered:
            xs = [x(t) for t, _ in rep.offered] + [x(rep.end)]
            ys = [v for _, v in rep.offered] + [rep.offered[-1][1]]
            ax_n.fill_between(xs, ys, step="post", color="0.85", label="GPUs offered")
        if rep.world:
            xs = [x(t) for t, _ in rep.world] + [x(rep.end)]
            ys = [v for _, v in rep.world] + [rep.world[-1][1]]
            ax_n.step(xs, ys, where="post", color="tab:green", linewidth=1.4,
                      label="spotctl training (world size)")
        for kind in MARK_KINDS:
            color, style, label = MARK_STYLE[kind]
            for i, m in enumerate(rep.marks.get(kind, [])):
                ln = ax_n.axvline(x(m["ts"]), color=color, linestyle=style, linewidth=1.1,
                                  label=label if i == 0 else None)
                ln.set_gid(kind)
                for ax in (ax_p, ax_c):
                    ax.axvline(x(m["ts"]), color=color, linestyle=style, linewidth=0.8,
                               alpha=0.6)
        ax_n.set_ylabel("GPUs")
        ax_n.yaxis.get_major_locator().set_params(integer=True)
        top = max([v for _, v in rep.offered] + [v for _, v in rep.world] + [1])
        ax_n.set_ylim(0, top * 1.35)  # headroom for the legend
        ax_n.set_title(f"{rep.cluster} ({rep.provider}): {rep.totals.steps} steps in "
                       f"{span / div:.1f} {unit}")
        ax_n.legend(loc="upper center", fontsize="small", ncol=6, frameon=False)

        if rep.samples:
            sx = [x(s["ts"]) for s in rep.samples]
            ax_p.plot(sx, [s.get("step") or 0 for s in rep.samples], color="tab:green",
                      label="step")
            ax_t = ax_p.twinx()
            ax_t.plot(sx, [s.get("throughput") or 0 for s in rep.samples], color="0.45",
                      linewidth=0.9, label="samples/s")
            ax_t.set_ylabel("samples/s")
            ax_t.set_ylim(bottom=0)
            ax_t.legend(loc="lower right", fontsize="small")
        else:
            ax_p.text(0.5, 0.5, "no samples yet",
                      transform=ax_p.transAxes, ha="center", color="0.4")
        ax_p.set_ylabel("step")
        ax_p.legend(loc="upper left", fontsize="small")

        if rep.usd_per_hour:
            xs = [x(t) for t, _ in rep.usd_per_hour] + [x(rep.end)]
            usd = [v for _, v in rep.usd_per_hour] + [rep.usd_per_hour[-1][1]]
            ax_c.step(xs, usd, where="post", color="tab:blue")
        if not any(v for _, v in rep.usd_per_hour):
            ax_c.text(0.5, 0.5, "$0/h: these nodes cost nothing", transform=ax_c.transAxes,
                      ha="center", va="center", color="0.4")
        ax_c.set_ylabel("$/h")
        ax_c.set_ylim(bottom=0)
        ax_c.set_xlabel(f"{unit} since the first launch")
        fig.tight_layout()
        for ln in ax_n.lines:
            gid = ln.get_gid()
            if gid in drawn:
                drawn[gid].append(round(float(ln.get_xdata()[0]) * div, 3))  # type: ignore[index]
        try:
            fig.savefig(out, format="png", dpi=90)
        except OSError as e:
            raise SpecError(f"--plot {out}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
    return drawn
