"""Cluster status: one snapshot dict from the journal, the provider and the head, and a
pure renderer to a rich renderable (the same rows feed `--json`)."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Group
from rich.text import Text

from spotctl.control.reconcile import head_client, journal_nodes, provider_for, sync_events
from spotctl.control.tables import Col, fit_line, fit_table
from spotctl.head.client import HeadUnavailable
from spotctl.spec import ClusterSpec
from spotctl.state import Store


def _synced(store: Store, name: str) -> None:
    """The head's events into the journal (a NotFoundError for an unknown cluster)."""
    store.get_cluster(name)
    sync_events(store, name)


def _as_json(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))  # what --json prints


def status_json(store: Store, name: str, all_runs: bool = False) -> dict[str, Any]:
    """What `spotctl status --json` prints: one snapshot after the sync."""
    _synced(store, name)
    return dict(_as_json(collect(store, name, all_runs=all_runs)))


def run_start(store: Store, name: str, state: str) -> float:
    """When the cluster's current run began (its last `down` before it; 0: the first run).
    A cluster that is down shows the run that `down` ended."""
    downs = [e["ts"] for e in store.events(name, "down")]
    if state == "down":
        downs = downs[:-1]
    return downs[-1] if downs else 0.0


def events_json(store: Store, name: str, type_: str | None = None) -> list[dict[str, Any]]:
    """What `spotctl events --json` prints: the journal's events after the sync."""
    _synced(store, name)
    return list(_as_json(store.events(name, type_)))


def collect(store: Store, name: str, now: float | None = None,
            all_runs: bool = False) -> dict[str, Any]:
    """The snapshot; its nodes are the current run's (since the last `down`), every node the
    cluster ever had with `all_runs`."""
    now = now or time.time()
    row = store.get_cluster(name)
    since = 0.0 if all_runs else run_start(store, name, row.state)
    spec = ClusterSpec.model_validate(row.spec)
    head: dict[str, Any] = {}
    head_error = None
    if row.state != "down":
        try:
            head = head_client(store, name, timeout_s=2).status()
        except HeadUnavailable as e:
            head_error = str(e)
    live_ids: set[str] = set()
    if row.state != "down":
        try:
            provider = provider_for(store, spec)
            live = provider.list(name)
            live_ids = {i.id for i in live}
            if spec.head_rebalances and spec.provider != "local":
                # the head's own loop replaces nodes: what it launched and what left
                # reach this machine's journal from the cloud's list
                journal_nodes(store, spec, provider, [i for i in live if i.role == "worker"])
        except Exception as e:  # status must render even when the cloud API fails
            head_error = head_error or f"provider: {e}"
    hnodes = head.get("nodes", {})
    nodes = []
    for n in store.nodes(name):
        if n.launched_at < since:
            continue
        h = hnodes.get(n.id, {})
        ended = n.ended_at is not None or (row.state != "down" and n.id not in live_ids)
        if ended:
            state = n.state if n.state in ("preempted", "terminated", "lost") else "lost"
            if n.ended_at is None:
                state = "lost"
        else:
            hs = h.get("state")
            state = {
                None: "booting", "waiting": "joining", "running": "running",
                "leaving": "draining", "left": "left", "unresponsive": "unresponsive",
                "finished": "finished",
            }.get(hs, hs or "booting")
            if state == "running" and h.get("workers") and all(
                w.get("phase") in ("drained", "draining") for w in h["workers"]
            ):
                state = "draining"
        end = n.ended_at or now
        nodes.append({
            "id": n.id, "provider": n.provider, "zone": n.zone,
            "instance_type": n.instance_type, "gpus": n.gpus, "state": state,
            "uptime_s": round(max(0.0, end - n.launched_at), 1),
            "heartbeat_age_s": h.get("heartbeat_age_s"), "step": h.get("step"),
            "price": n.price, "notice": bool(h.get("notice")),
            # which worker group this node's workers belong to (one per formation)
            "incarnations": sorted({w.get("incarnation") for w in h.get("workers", [])
                                    if w.get("incarnation")}),
            "world_size": h.get("world_size"),
            # torchft with nodes_per_replica > 1: the replica group the head placed it in
            "group": h.get("group"),
            # torchft: its replica's dense index (SPOTCTL_FT_REPLICA_INDEX, torchtitan's
            # replica id); None on torchrun or before the head gave one
            "replica_index": h.get("replica_index"),
            # the network the node was launched with (aws: efaN / ena; gcp: gvnic-compact,
            # gvnic, virtio); None where the provider does not say
            "network": n.meta.get("network") or None,
            # what the node's agent found (interfaces, RDMA devices, EFA / aws-ofi-nccl /
            # TCPX installed) and the transport its workers' NCCL named at the first
            # collective ("gloo" on a CPU node); None until the agent said
            "net": _net(h.get("net")),
            "nccl_transport": (h.get("net") or {}).get("nccl_transport"),
            # its workers' last error line when they failed again and again (its agent
            # stopped restarting them: state "crashed")
            "error": h.get("error"),
        })
    live = [x for x in nodes if x["state"] not in ("lost", "preempted", "terminated", "left")]
    cost = None
    try:
        from spotctl.control import cost as cost_mod

        cost = cost_mod.cluster_cost(store, name, now).to_json()
    except Exception:
        cost = None
    return {
        "cluster": name,
        "provider": row.provider,
        "state": row.state,
        "gpus": {"now": sum(x["gpus"] for x in live), "min": spec.gpus.min, "max": spec.gpus.max},
        # what runs: the head's engine (a plain script moves torchft onto torchrun)
        "engine": head.get("engine") or spec.train.engine,
        "route": head.get("route"),
        "restarts": head.get("restarts", 0),
        "world_size": head.get("world_size", 0),
        "step": head.get("step", 0),
        "last_checkpoint_step": head.get("last_checkpoint_step", 0),
        "loss": head.get("loss"),
        "throughput": head.get("throughput"),
        "cost_per_hour": round(sum(x["price"] for x in live), 6),
        "cost": cost,
        "drain": head.get("drain"),
        "rebalancer": _rebalancer(head.get("rebalancer"), now),
        "head_error": head_error,
        "nodes": nodes,
    }


def _rebalancer(r: Any, now: float) -> dict[str, Any] | None:
    """The head's reconcile loop as the head reports it (None: the head runs none)."""
    if not isinstance(r, dict):
        return None
    last = r.get("last_run") if isinstance(r.get("last_run"), dict) else None
    at = last.get("at") if last else None
    return {
        "running": bool(r.get("running")),
        "restarts": r.get("restarts") if isinstance(r.get("restarts"), int) else 0,
        "last_run_age_s": round(now - at, 1) if isinstance(at, int | float) else None,
        "last_actions": _strs(last.get("actions")) if last else [],
        "last_errors": _strs(last.get("errors")) if last else [],
    }


def _strs(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def rebalancer_line(r: dict[str, Any] | None) -> str:
    """One line on who replaces lost nodes: the head's loop, or nothing on the head."""
    if r is None:
        return ""
    if not r["running"]:
        return "replacements: the head's reconcile loop is not running (see head/rebalance.log)"
    age = r["last_run_age_s"]
    last = "no run yet" if age is None else f"last run {_age(age)} ago: " + (
        "; ".join(r["last_errors"] or r["last_actions"]) or "nothing to do")
    return f"replacements: by the head ({last})"


def _net(net: dict[str, Any] | None) -> dict[str, Any] | None:
    if not net:
        return None
    return {k: v for k, v in net.items() if k != "nccl_transport"}


def net_summary(n: dict[str, Any]) -> str:
    """One short cell: the transport NCCL uses, else what the probe found."""
    if n.get("nccl_transport"):
        return str(n["nccl_transport"])
    net = n.get("net")
    if not net:
        return "-"
    if net.get("efa"):
        return f"efa x{net['efa']}"
    kinds = sorted({i["kind"] for i in net.get("interfaces", [])})
    return ",".join(kinds) or "-"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


STATE_STYLE = {"crashed": "red", "running": "green", "joining": "cyan", "draining": "yellow", "lost": "red",
               "preempted": "magenta", "unresponsive": "red", "left": "dim"}


NODE_COLS = (
    Col("node"), Col("provider", drop=9), Col("zone", drop=5), Col("type", drop=6),
    Col("GPUs", right=True), Col("state"), Col("uptime", right=True, drop=4),
    Col("heartbeat", right=True, drop=3, short="hb"), Col("step", right=True, drop=2),
    Col("net", drop=10),
)


def route_line(route: str, engine: str | None) -> str:
    """Which kind of script runs, and how (one line in `up` and `status`)."""
    if route == "plain":
        return "route: plain torchrun script, one torchrun job across the nodes (restart cycle)"
    return f"route: spotctl.elastic ({engine or '?'} engine)"


def render(snap: dict[str, Any], show_ended: bool = True, width: int = 80) -> Group:
    """The snapshot as lines and a node table, none wider than `width`."""
    g = snap["gpus"]
    tput = snap.get("throughput")

    def kv(k: str, v: str) -> Text:
        return Text.assemble((k + " ", "bold"), v)

    head = fit_line([
        kv("cluster", snap["cluster"]), kv("provider", snap["provider"]),
        kv("GPUs", f"{g['now']} (min {g['min']}, max {g['max']})"),
        kv("world", str(snap["world_size"])), kv("step", str(snap["step"])),
        kv("checkpoint", str(snap["last_checkpoint_step"])),
        kv("samples/s", f"{tput:.0f}" if tput else "-"),
        kv("$/h", f"{snap['cost_per_hour']:.4f}"),
    ], width)
    parts: list[Any] = [head]
    if snap.get("route"):
        parts.append(Text(f"{route_line(snap['route'], snap.get('engine'))}; "
                          f"restarts {snap.get('restarts', 0)}"))
    c = snap.get("cost")
    if c:
        parts.append(fit_line([
            f"spent ${c.get('spent_usd', 0):.4f}", f"on-demand ${c.get('on_demand_usd', 0):.4f}",
            f"saved ${c.get('saved_usd', 0):.4f}",
        ], width))
    if snap.get("drain"):
        d = snap["drain"]
        parts.append(Text(f"drain in progress: {d['reason']} (gen {d['gen']})", style="yellow"))
    line = rebalancer_line(snap.get("rebalancer"))
    if len(line) > width:
        line = line[:width - 1] + "…"
    if line:
        parts.append(Text(line, style="" if snap["rebalancer"]["running"] else "yellow"))
    if snap.get("head_error"):
        parts.append(Text(snap["head_error"], style="red"))
    rows = []
    for n in snap["nodes"]:
        if not show_ended and n["state"] in ("lost", "preempted", "terminated"):
            continue
        rows.append((
            # a node of a replica group of several nodes shows its group (torchft)
            n["id"] + (f" {n['group']}" if n.get("group") else ""), n["provider"], n["zone"], n["instance_type"], str(n["gpus"]),
            Text(n["state"] + ("*" if n["notice"] else ""),
                 style=STATE_STYLE.get(n["state"], "")),
            _age(n["uptime_s"]), _age(n["heartbeat_age_s"]),
            "-" if n["step"] is None else str(n["step"]),
            net_summary(n),
        ))
    parts.append(fit_table(NODE_COLS, rows, width))
    if any(n["notice"] for n in snap["nodes"]):
        parts.append(Text("* got a preemption notice"))
    for n in snap["nodes"]:
        if n.get("error"):  # whole, however narrow the table: it is what to fix
            parts.append(Text(f"{n['id']} error: {n['error']}", style="red"))
    return Group(*parts)
