"""Event-triggered reconcile: `spotctl rebalance --watch`.

The head knows of a notice, a departure or a rescale before cron's next minute. The
watcher runs on the controller (the machine that runs cron and holds the state DB and
the provider credentials), polls the head's event feed every `poll_s`, and runs the
same reconcile as `spotctl rebalance`:

- at once when a trigger event arrives (notice, leave, rescale, node-unresponsive,
  capacity-reclaim, drain-end), and
- every `interval_s` regardless (capacity that comes back raises no event).

It takes the same non-blocking "rebalance" lock as the cron line, so cron and the
watcher never both act: whichever holds the lock acts, the other steps aside (the
watcher retries at its next poll, so a trigger is never dropped). Works the same for
local clusters (the head is a local process) and clouds (through the SSH tunnel).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spotctl.control import reconcile
from spotctl.errors import LockHeld, NotFoundError, SpotctlError
from spotctl.head.client import HeadUnavailable
from spotctl.spec import ClusterSpec
from spotctl.state import Store

TRIGGERS = frozenset(
    {"notice", "leave", "rescale", "node-unresponsive", "capacity-reclaim", "drain-end"}
)


def rebalance_once(store: Store, name: str, spec: ClusterSpec) -> dict[str, Any]:
    """One `spotctl rebalance`: import the head's events, then reconcile under the lock.
    Returns the result's JSON, or `{"skipped": True, "reason": ...}` when another run
    (cron, a watcher, `up`) holds the lock."""
    reconcile.sync_events(store, name)
    try:
        with store.cluster_dir(name).lock("rebalance", wait=False):
            return reconcile.reconcile(store, spec, create=False).to_json()
    except LockHeld as err:
        return {"cluster": name, "skipped": True, "reason": str(err)}


def _head_events(store: Store, name: str, since: int) -> list[dict[str, Any]] | None:
    try:
        return reconcile.head_client(store, name, timeout_s=3).events(since)
    except (HeadUnavailable, NotFoundError):
        return None


def watch(
    store: Store,
    name: str,
    spec_of: Callable[[], ClusterSpec],
    *,
    interval_s: float = 60.0,
    poll_s: float = 1.0,
    duration_s: float | None = None,
    on_run: Callable[[dict[str, Any]], None] = lambda r: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Reconcile on trigger events and every `interval_s` until `duration_s` passes (None:
    forever) or the cluster is down. `on_run` gets each run's JSON with `trigger` (the
    event types that caused it, or ["interval"]). Returns the number of runs."""
    start = clock()
    evs = _head_events(store, name, 0) or []
    since = max((int(e["seq"]) for e in evs), default=0)  # old events trigger nothing
    last_run = -float("inf")
    pending: list[str] = []
    runs = 0
    while duration_s is None or clock() - start < duration_s:
        if store.get_cluster(name).state == "down":
            break
        new = _head_events(store, name, since)
        if new is not None:
            for e in new:
                since = max(since, int(e["seq"]))
                if e["type"] in TRIGGERS and e["type"] not in pending:
                    pending.append(e["type"])
        if pending or clock() - last_run >= interval_s:
            try:
                out = rebalance_once(store, name, spec_of())
            except SpotctlError as e:
                if store.get_cluster(name).state == "down":
                    break  # `down` ran while this run waited for the cluster's lock
                # a failed run (a cloud API error, a lost head) ends nothing: the next
                # trigger or interval tries again
                out = {"cluster": name, "error": str(e), "actions": []}
            out["trigger"] = list(pending) or ["interval"]
            on_run(out)
            if not out.get("skipped"):
                pending = []
                last_run = clock()
                runs += 1
        sleep(poll_s)
    return runs
