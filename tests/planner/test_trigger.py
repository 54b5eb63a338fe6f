"""`spotctl rebalance --watch` (issue 19): runs on head events and on its interval, and
shares cron's lock, so the two never both act."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotctl.control import trigger
from spotctl.spec import ClusterSpec
from spotctl.state import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "home")
    s.upsert_cluster("w", "local", {"name": "w", "provider": "local", "gpus": "1..2"}, "running")
    return s


def test_rebalance_once_steps_aside_while_cron_holds_the_lock(store: Store) -> None:
    spec = ClusterSpec.model_validate({"name": "w", "provider": "local", "gpus": "1..2"})
    with store.cluster_dir("w").lock("rebalance", wait=False):
        out = trigger.rebalance_once(store, "w", spec)
    assert out["skipped"] is True and "another rebalance is running" in out["reason"]


def test_watch_runs_on_trigger_events_and_interval(store: Store, monkeypatch) -> None:
    t = [0.0]
    feed: dict[float, list[dict[str, Any]]] = {
        0.0: [{"seq": 1, "type": "notice"}],  # old: triggers nothing
        3.0: [{"seq": 2, "type": "heartbeat-ish"}],
        5.0: [{"seq": 3, "type": "notice"}, {"seq": 4, "type": "rescale"}],
    }
    busy = {6.0}  # cron holds the lock at t=6: the watcher retries at the next poll
    runs: list[tuple[float, list[str]]] = []

    def head_events(store: Store, name: str, since: int) -> list[dict[str, Any]]:
        return [e for e in feed.get(t[0], []) if e["seq"] > since]

    def once(store: Store, name: str, spec: Any) -> dict[str, Any]:
        return {"skipped": True} if t[0] in busy else {"actions": []}

    monkeypatch.setattr(trigger, "_head_events", head_events)
    monkeypatch.setattr(trigger, "rebalance_once", once)

    def sleep(s: float) -> None:
        t[0] += s

    n = trigger.watch(store, "w", lambda: None, interval_s=10, poll_s=1, duration_s=16,  # type: ignore[arg-type, return-value]
                      on_run=lambda o: runs.append((t[0], o["trigger"])) if not o.get("skipped") else None,
                      clock=lambda: t[0], sleep=sleep)
    # t=0 first interval run; t=5 the notice+rescale (one run); the interval counts from
    # the last run: t=15
    assert runs == [(0.0, ["interval"]), (5.0, ["notice", "rescale"]), (15.0, ["interval"])]
    assert n == 3
    # a trigger while the lock is held is not dropped: it runs at the next poll
    runs.clear()
    t[0] = 0.0
    feed[6.0] = [{"seq": 5, "type": "leave"}]
    busy.clear()
    busy.add(6.0)
    trigger.watch(store, "w", lambda: None, interval_s=100, poll_s=1, duration_s=9,  # type: ignore[arg-type, return-value]
                  on_run=lambda o: runs.append((t[0], o["trigger"])) if not o.get("skipped") else None,
                  clock=lambda: t[0], sleep=sleep)
    assert runs == [(0.0, ["interval"]), (5.0, ["notice", "rescale"]), (7.0, ["leave"])]


def test_watch_stops_when_the_cluster_is_down(store: Store, monkeypatch) -> None:
    monkeypatch.setattr(trigger, "_head_events", lambda *a: [])
    monkeypatch.setattr(trigger, "rebalance_once", lambda *a: {"actions": []})
    store.set_cluster_state("w", "down")
    assert trigger.watch(store, "w", lambda: None, sleep=lambda s: None) == 0  # type: ignore[arg-type, return-value]


def test_watch_goes_on_after_a_failed_run_and_ends_when_down_came_during_one(
    store: Store, monkeypatch
) -> None:  # fmt: skip
    """The head's loop runs unattended: a run that fails (a cloud API error) is reported
    and the next interval tries again; a run that finds the cluster down (`down` held the
    lock meanwhile) ends the watch instead of failing it."""
    from spotctl.errors import ProviderError, StateError

    t = [0.0]
    outcomes: list[Any] = [ProviderError("aws: throttled"), {"actions": []}]
    runs: list[dict[str, Any]] = []

    def once(store: Store, name: str, spec: Any) -> dict[str, Any]:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(trigger, "_head_events", lambda *a: [])
    monkeypatch.setattr(trigger, "rebalance_once", once)

    def sleep(s: float) -> None:
        t[0] += s

    n = trigger.watch(store, "w", lambda: None, interval_s=10, poll_s=1, duration_s=15,  # type: ignore[arg-type, return-value]
                      on_run=runs.append, clock=lambda: t[0], sleep=sleep)
    assert n == 2 and "error" not in runs[1], runs
    assert runs[0] == {"cluster": "w", "error": "aws: throttled", "actions": [],
                       "trigger": ["interval"]}, runs

    def down_meanwhile(store: Store, name: str, spec: Any) -> dict[str, Any]:
        store.set_cluster_state("w", "down")
        raise StateError("cluster w is down; `spotctl up` starts it again")

    monkeypatch.setattr(trigger, "rebalance_once", down_meanwhile)
    store.set_cluster_state("w", "running")
    assert trigger.watch(store, "w", lambda: None, sleep=sleep) == 0  # type: ignore[arg-type, return-value]
    # any other failure of the store itself still ends it with the error
    store.set_cluster_state("w", "running")
    monkeypatch.setattr(trigger, "rebalance_once", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError):
        trigger.watch(store, "w", lambda: None, sleep=sleep)  # type: ignore[arg-type, return-value]
