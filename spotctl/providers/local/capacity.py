"""The local "cloud" reclaiming capacity: when spec.local.capacity says fewer nodes exist
than run, the newest nodes get a preemption notice (GCP style: 30 s to the hard stop, or
spec.local.reclaim_notice_s), exactly as a cloud would. Run by the head process of a local
cluster once a second.

capacity.json in the cluster dir is what both the head (reclaiming) and the provider
(offers, launches) read: `{"created_at", "schedule": [{"at_s", "nodes"}], "notice_s",
"override"?}`.
`set_capacity` pins the capacity to a number from the moment it is called (tests and
demos change capacity at a moment they choose instead of racing a wall-clock schedule);
`prepare` keeps the override."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotctl.agent import proctree
from spotctl.head.client import urlopen_direct

log = logging.getLogger("spotctl.head")


def capacity_at(schedule: list[dict[str, float]], created_at: float, now: float,
                override: int | None = None) -> int | None:
    if override is not None:
        return int(override)
    cap = None
    for step in schedule:
        if step["at_s"] <= now - created_at:
            cap = int(step["nodes"])
    if cap is None and schedule:
        cap = int(schedule[0]["nodes"])
    return cap


def read_config(cluster_dir: Path) -> dict[str, Any] | None:
    """capacity.json, or None when the cluster has no capacity limit (or it is unreadable)."""
    try:
        cfg = json.loads((cluster_dir / "capacity.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def current(cluster_dir: Path, now: float | None = None) -> int | None:
    """Nodes the local "cloud" holds now (None = unlimited)."""
    return _capacity(read_config(cluster_dir), now)


def _capacity(cfg: dict[str, Any] | None, now: float | None) -> int | None:
    if cfg is None:
        return None
    return capacity_at(cfg.get("schedule", []), float(cfg.get("created_at", 0.0)),
                       now or time.time(), cfg.get("override"))


def set_capacity(cluster_dir: Path, nodes: int | None) -> None:
    """Pin the capacity to `nodes` from now on (None: back to the schedule)."""
    if nodes is not None and nodes < 0:
        raise ValueError(f"capacity must be >= 0 nodes, got {nodes}")
    cfg = read_config(cluster_dir) or {"created_at": time.time(), "schedule": []}
    if nodes is None:
        cfg.pop("override", None)
    else:
        cfg["override"] = int(nodes)
    tmp = cluster_dir / "capacity.json.tmp"
    tmp.write_text(json.dumps(cfg))
    tmp.replace(cluster_dir / "capacity.json")


def enforce(cluster_dir: Path, now: float | None = None) -> list[str]:
    """Send notices to the newest nodes above capacity; returns the node ids notified."""
    cfg = read_config(cluster_dir)
    cap = _capacity(cfg, now)
    if cfg is None or cap is None:
        return []
    live = []
    for vm_path in (cluster_dir / "nodes").glob("*/vm.json"):
        try:
            vm = json.loads(vm_path.read_text())
        except ValueError:
            continue
        if vm.get("state") == "running" and proctree.alive(int(vm.get("pid") or 0)):
            live.append(vm)
    keep = [vm for vm in live if not vm.get("reclaim_sent")]
    excess = len(keep) - cap
    if excess <= 0:
        return []
    token = (cluster_dir / "token").read_text().strip()
    # the hard stop: the spec's reclaim_notice_s, else the emulator's gcp default (30 s)
    body = {"style": "gcp"} | ({"in_s": cfg["notice_s"]} if "notice_s" in cfg else {})
    sent = []
    for vm in sorted(keep, key=lambda v: v["launched_at"], reverse=True)[:excess]:
        req = urllib.request.Request(
            vm["metadata_url"] + "/_spotctl/preempt", method="POST",
            data=json.dumps(body).encode(),
        )
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Content-Type", "application/json")
        try:
            urlopen_direct(req, timeout=3).read()
        except OSError as e:
            log.warning("capacity: could not notify %s: %s", vm["node_id"], e)
            continue
        vm_path = cluster_dir / "nodes" / vm["node_id"] / "vm.json"
        cur = json.loads(vm_path.read_text())
        cur["reclaim_sent"] = time.time()
        tmp = vm_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cur))
        tmp.replace(vm_path)
        sent.append(vm["node_id"])
        log.info("capacity %d: reclaiming %s", cap, vm["node_id"])
    return sent


def reclaim_hook(cluster_dir: Path) -> Callable[[], list[str]]:
    """What the head calls once a second: enforce this cluster's schedule, if it has one
    (capacity.json is written only by the local provider)."""
    return lambda: enforce(cluster_dir)
