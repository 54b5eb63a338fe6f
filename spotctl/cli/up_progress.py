"""Where `spotctl up` is: launching (per offer), bootstrapping (per node), booting, joining,
first step. Phases are dicts; a terminal gets a live line naming the slowest node, a pipe
gets one plain line per phase, `--json` gets one JSON line per phase on stderr (stdout keeps
the single result object)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from spotctl.control.reconcile import heartbeat_fresh
from spotctl.errors import SpotctlError
from spotctl.state import Store

Emit = Callable[[dict[str, Any]], None]

_LAUNCH = re.compile(r"launching (\d+) x (\S+) in (\S+)")
_BOOTSTRAPPING = re.compile(r"bootstrapping (\d+) node")
_BOOTSTRAPPED = re.compile(
    r"bootstrapped (\S+) in ([\d.]+)s(?:, sent ([\d.]+ (?:MiB|B)))? \((\d+)/(\d+), (.*)\)"
)


def reconcile_phase(msg: str, frac: float | None = None) -> dict[str, Any]:
    """A reconcile progress message as a phase."""
    if m := _LAUNCH.match(msg):
        return {"phase": "launching", "count": int(m[1]), "instance_type": m[2], "zone": m[3]}
    if m := _BOOTSTRAPPING.match(msg):
        return {"phase": "bootstrapping", "nodes": int(m[1])}
    if m := _BOOTSTRAPPED.match(msg):
        state, _, note = m[6].partition("; ")  # "ok", "ok; <note>", "failed: <reason>"
        out = {"phase": "bootstrapped", "node": m[1], "seconds": float(m[2]),
               "done": int(m[4]), "total": int(m[5]), "ok": state == "ok"}
        return out | ({"sent": m[3]} if m[3] else {}) | (
            {"note": note} if note and state == "ok" else {})
    if msg.startswith("starting the head"):
        return {"phase": "head"}
    if msg.startswith("checking the head"):
        return {"phase": "head", "running": True}
    if msg.startswith("preparing"):
        return {"phase": "preparing"}
    return {"phase": "reconcile", "message": msg}


def describe(p: dict[str, Any]) -> str:
    """One line for people."""
    ph = p["phase"]
    if ph == "launching":
        return f"launching {p['count']} x {p['instance_type']} in {p['zone']}"
    if ph == "bootstrapping":
        return f"bootstrapping {p['nodes']} node(s)"
    if ph == "bootstrapped":
        sent = f", sent {p['sent']}" if p.get("sent") else ""
        return (f"bootstrapped {p['node']} in {p['seconds']:.1f}s{sent} ({p['done']}/{p['total']}"
                + ("" if p["ok"] else ", failed") + ")"
                + (f": {p['note']}" if p.get("note") else ""))
    if ph == "bootstrap-done":
        sl = p["slowest"]
        return (f"bootstrapped {p['nodes']} node(s)"
                + (f", {p['failed']} failed" if p["failed"] else "")
                + f"; slowest {sl['node']} ({sl['seconds']:.1f}s)")
    if ph == "head":
        return "checking the head" if p.get("running") else "starting the head"
    if ph == "preparing":
        return "preparing cluster resources"
    if ph == "nodes":
        parts = [f"{k} {','.join(v)}" for k, v in p["by_phase"].items() if v]
        slow = p.get("slowest")
        return ("; ".join(parts) or "no nodes") + (
            f"  (slowest: {slow['node']}, {slow['phase']} {slow['for_s']:.0f}s)" if slow else "")
    if ph == "first-step":
        from spotctl.control.status import route_line

        return (f"training: step {p['step']} at world size {p['world_size']}"
                + (f"; {route_line(p['route'], p.get('engine'))}" if p.get("route") else ""))
    if ph == "waiting":
        return p.get("message", "waiting")
    if ph == "finished":
        return "the job already ran to its end"
    if ph == "crashed":
        return f"{p['node']}: its workers keep failing the same way; not restarted"
    return str(p.get("message", ph))


NODE_PHASES = ("booting", "joining", "training")


class JobCrashed(SpotctlError):
    """A node's workers failed the same way again and again; its agent stopped restarting
    them (agent state "crashed", spotctl.agent.crashloop). `up` exits with this."""


def crash_line(node: str, error: str | None) -> str:
    """The one line `up` exits with when `node`'s workers crash-looped."""
    return (f"{node}: the training script failed repeatedly with the same error, not "
            f"restarted: {error or '(no error line in its log)'} (`spotctl logs {node}`; "
            "`spotctl down` stops the cluster)")


def node_phase(h: dict[str, Any] | None) -> str | None:
    """booting: no heartbeat at the head yet; joining: at the head, not in a step yet;
    training: in the job. None: leaving, gone, or failed (its GPU gate closed: it will
    never train and is replaced)."""
    if not h:
        return "booting"
    st = h.get("state")
    if st in ("leaving", "left", "failed"):
        return None
    if st == "finished":  # the job already ran to its last step
        return "training"
    if st == "running" and h.get("step") is not None and heartbeat_fresh(h):
        return "training"
    return "joining"


FIRST_STEP_WAIT_S = 60.0  # after every node reports: how long to wait for a step


def first_step_wait_s(env: Any = None) -> float:
    """FIRST_STEP_WAIT_S, or SPOTCTL_UP_STEP_WAIT_S (seconds, >= 0: a script that never
    reports a step, as the launch tests' idle one, need not hold `up` a minute)."""
    from spotctl.errors import SpecError

    raw = (os.environ if env is None else env).get("SPOTCTL_UP_STEP_WAIT_S")
    if raw is None or raw == "":
        return FIRST_STEP_WAIT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not math.isfinite(v) or v < 0:
        raise SpecError(f"SPOTCTL_UP_STEP_WAIT_S must be a number of seconds >= 0, not {raw!r}")
    return v


def watch(store: Store, name: str, timeout_s: float, emit: Emit, min_gpus: int = 0,
          status: Callable[[], dict[str, Any]] | None = None,
          clock: Callable[[], float] = time.monotonic) -> tuple[int, int, bool]:
    """Follow every live node through booting -> joining -> training until all report and
    the job takes a step, or `timeout_s`. Emits a "nodes" phase on each change and one
    "first-step". Once every node reports, it waits for a step only when their GPUs reach
    `min_gpus`, and at most first_step_wait_s(). Returns (reporting, expected, training)."""
    from spotctl.control.reconcile import head_client
    from spotctl.head.client import HeadUnavailable

    def head_status() -> dict[str, Any]:
        return head_client(store, name, timeout_s=2).status()

    status = status or head_status
    step_wait = first_step_wait_s()
    start = clock()
    deadline = start + timeout_s
    since: dict[tuple[str, str], float] = {}
    last: tuple[Any, ...] | None = None
    seen = want = 0
    reported_at: float | None = None
    while True:
        try:
            st = status()
        except HeadUnavailable:
            st = {"nodes": {}}
        hn = st.get("nodes", {})
        by: dict[str, list[str]] = {k: [] for k in NODE_PHASES}
        now = clock()
        live = store.nodes(name, include_ended=False)
        crashed = [n.id for n in live if (hn.get(n.id) or {}).get("state") == "crashed"]
        if crashed:
            emit({"phase": "crashed", "node": crashed[0],
                  "error": (hn.get(crashed[0]) or {}).get("error")})
            raise JobCrashed(crash_line(crashed[0], (hn.get(crashed[0]) or {}).get("error")))
        for n in live:
            ph = node_phase(hn.get(n.id))
            if ph is None:
                continue
            by[ph].append(n.id)
            since.setdefault((n.id, ph), now)
        want = sum(len(v) for v in by.values())
        seen = sum(1 for nid in by["joining"] + by["training"] if heartbeat_fresh(hn.get(nid)))
        behind = [(since[(nid, ph)], nid, ph) for ph in ("booting", "joining") for nid in by[ph]]
        slowest = None
        if behind:
            t0, nid, ph = min(behind)
            slowest = {"node": nid, "phase": ph, "for_s": round(now - t0, 1)}
        key = tuple(tuple(v) for v in by.values())
        nodes_phase = {"phase": "nodes", "by_phase": by, "slowest": slowest,
                       "reporting": seen, "expected": want}
        if key != last:
            last = key
            emit(nodes_phase)
        else:  # the same phases, for a live line whose "for N s" moves
            emit(nodes_phase | {"repeat": True})
        settled = not (by["booting"] or by["joining"])
        # a plain script's step is known only if it reports it: its group formed is enough
        training = settled and bool(st.get("world_size")) and (
            (st.get("step") or 0) > 0 or st.get("route") == "plain")
        finished = settled and bool(by["training"]) and all(
            (hn.get(nid) or {}).get("state") == "finished" for nid in by["training"])
        if finished and not training:  # a short job ran to its end before a step was seen
            emit({"phase": "finished", "after_s": round(now - start, 1)})
            return seen, want, True
        if training:
            emit({"phase": "first-step", "step": st.get("step"), "world_size": st.get("world_size"),
                  "route": st.get("route"), "engine": st.get("engine"),
                  "after_s": round(now - start, 1)})
            return seen, want, True
        if now >= deadline:
            return seen, want, False
        if seen >= want:
            gpus = sum(n.gpus for n in store.nodes(name, include_ended=False)
                       if n.id in by["joining"] or n.id in by["training"])
            if want == 0:
                return seen, want, False
            if gpus < min_gpus:
                emit({"phase": "waiting", "message": f"{gpus} GPU(s) reporting, below the "
                      f"minimum {min_gpus}: training starts when capacity comes"})
                return seen, want, False
            reported_at = reported_at or now
            if now - reported_at >= step_wait:
                emit({"phase": "waiting", "message": f"every node reports; no step after "
                      f"{step_wait:.0f}s (`spotctl logs --all`)"})
                return seen, want, False
        time.sleep(0.3)


class Reporter:
    """Shows phases: a rich live line (terminal), plain lines (pipe) or JSON lines."""

    def __init__(self, json_lines: bool, live: Callable[[str], None] | None = None,
                 note: Callable[[str], None] | None = None):
        self.booted: list[dict[str, Any]] = []
        self.json_lines = json_lines
        self.live = live  # the line that changes (node phases)
        self.note = note  # lines that stay (launches, bootstraps, the first step)
        self.last_line = ""

    def __call__(self, p: dict[str, Any]) -> None:
        if p.get("repeat"):  # only a live line shows the time passing
            if self.live is not None and not self.json_lines:
                self.live(describe(p))
            return
        if self.json_lines:
            sys.stderr.write(json.dumps(p, separators=(",", ":")) + "\n")
            sys.stderr.flush()
            return
        line = describe(p)
        if self.live is not None:
            self.live(line)
            if self.note is not None and p["phase"] not in ("nodes", "bootstrapping"):
                self.note(line)
        elif line != self.last_line:
            sys.stderr.write(f"up: {line}\n")
            sys.stderr.flush()
        self.last_line = line

    def reconcile(self, msg: str, frac: float | None = None) -> None:
        p = reconcile_phase(msg, frac)
        self(p)
        if p["phase"] == "bootstrapping":
            self.booted = []
        elif p["phase"] == "bootstrapped":
            self.booted.append(p)
            if p["done"] >= p["total"]:
                slow = max(self.booted, key=lambda b: b["seconds"])
                self({"phase": "bootstrap-done", "nodes": len(self.booted),
                      "failed": sum(1 for b in self.booted if not b["ok"]),
                      "slowest": {"node": slow["node"], "seconds": slow["seconds"]}})
