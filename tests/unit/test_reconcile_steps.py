"""The steps of a reconcile that decide what is launched and what is stopped, run in this
process with a stand-in cloud (mutmut follows only in-process calls; the end-to-end path
runs them through `spotctl up` in subprocesses): a launch journals its intent before the
provider is called and clears it after; an interrupted launch is replayed with the same
request id; a node still in the job drains through the head, one already out is
terminated at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotctl.control import reconcile
from spotctl.control.planner import Action, Plan
from spotctl.errors import CapacityError, SpotctlError
from spotctl.head.client import HeadUnavailable
from spotctl.providers.base import Instance, Offer
from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store

OFFER = Offer(provider="local", region="local", zone="z2", instance_type="t4", gpus=2,
              gpu_name="cpu", spot_price=0.5, on_demand_price=1.5, placement="group-2")


def _inst(nid: str, req: str) -> Instance:
    return Instance(id=nid, cluster="c", role="worker", zone="z2", instance_type="t4", gpus=2,
                    state="pending", request_id=req, price=0.5, on_demand_price=1.5,
                    launched_at=100.0, address="10.0.0.9")


class Cloud:
    """A provider's launch and terminate, answered as a cloud would: a launch names its
    request id on every instance (the idempotency key); `refuse` raises what the cloud
    raises when the zone has no capacity, `fail` any other provider error."""

    def __init__(self, intent: Path | None = None, refuse: bool = False,
                 fail: bool = False) -> None:
        self.intent, self.refuse, self.fail = intent, refuse, fail
        self.launches: list[tuple[Offer, int, str, Any]] = []
        self.terminated: list[str] = []

    def launch(self, offer: Offer, count: int, req: str) -> list[Instance]:
        on_disk = json.loads(self.intent.read_text()) if self.intent and \
            self.intent.exists() else None
        self.launches.append((offer, count, req, on_disk))
        if self.refuse:
            raise CapacityError(f"no capacity for {offer.instance_type} in {offer.zone}")
        if self.fail:
            raise SpotctlError("launch: throttled")
        return [_inst(f"{req}-{i}", req) for i in range(count)]

    def terminate(self, ids: list[str]) -> None:
        self.terminated += ids


def _store(tmp_path: Path) -> tuple[Store, ClusterSpec, Path]:
    spec = ClusterSpec.model_validate({"name": "c", "provider": "local", "gpus": "1..4"})
    s = Store(tmp_path)
    s.upsert_cluster("c", "local", spec.model_dump(mode="json"), "starting")
    s.cluster_dir("c").token(create=True)  # makes the cluster's directory, as `up` does
    return s, spec, s.cluster_dir("c").path / "launch-intent.json"


def test_a_launch_journals_its_intent_first_and_its_nodes_after(tmp_path: Path) -> None:
    """kills: the intent not written before the provider is called (or written with
    another count, offer or reason), the nodes not journaled, the intent left behind."""
    s, spec, intent = _store(tmp_path)
    cloud, res = Cloud(intent), reconcile.ReconcileResult("c", Plan())
    act = Action("launch", "below min", offer=OFFER, count=2)
    assert reconcile._launch(s, spec, cloud, act, None, res, reconcile._noop) is True
    [(offer, count, req, on_disk)] = cloud.launches
    assert (offer, count) == (OFFER, 2) and req.startswith("c-") and len(req) == 12
    assert on_disk == {"request_id": req, "offer": OFFER.__dict__ | {"placements": []},
                       "count": 2, "reason": "below min"}
    assert not intent.exists()
    assert [i.id for i in res.launched] == [f"{req}-0", f"{req}-1"]
    rows = {n.id: n for n in s.nodes("c")}
    assert sorted(rows) == [f"{req}-0", f"{req}-1"]
    assert all((n.request_id, n.zone, n.price, n.address) == (req, "z2", 0.5, "10.0.0.9")
               for n in rows.values())
    evs = s.events("c", "launch")
    assert [(e["node"], e["request_id"], e["reason"], e["placement"]) for e in evs] == [
        (f"{req}-0", req, "below min", "group-2"), (f"{req}-1", req, "below min", "group-2")]


def test_a_capacity_error_clears_the_intent_and_says_where(tmp_path: Path) -> None:
    """kills: a refused launch taken as done (True), its intent kept (the next run would
    replay a launch the cloud refused), its event without the zone or placement."""
    s, spec, intent = _store(tmp_path)
    cloud, res = Cloud(intent, refuse=True), reconcile.ReconcileResult("c", Plan())
    act = Action("launch", "below min", offer=OFFER, count=3)
    assert reconcile._launch(s, spec, cloud, act, None, res, reconcile._noop) is False
    assert not intent.exists() and s.nodes("c") == [] and res.launched == []
    [ev] = s.events("c", "capacity-error")
    assert {k: ev[k] for k in ("zone", "instance_type", "count", "placement")} == {
        "zone": "z2", "instance_type": "t4", "count": 3, "placement": "group-2"}
    assert res.errors == ["no capacity for t4 in z2"]


def test_an_interrupted_launch_is_replayed_with_its_own_request_id(tmp_path: Path) -> None:
    """kills: the replay under another request id or count (the cloud would launch
    twice), its nodes not journaled, the intent kept (replayed at every run)."""
    s, spec, intent = _store(tmp_path)
    intent.write_text(json.dumps({"request_id": "c-0123456789", "count": 2,
                                  "reason": "replace", "offer": OFFER.__dict__
                                  | {"placements": ["group-2", "none"]}}))
    cloud, res = Cloud(), reconcile.ReconcileResult("c", Plan())
    reconcile._resume_intent(s, spec, cloud, res)
    [(offer, count, req, _)] = cloud.launches
    assert (offer.zone, offer.placement, offer.placements, count, req) == (
        "z2", "group-2", ("group-2", "none"), 2, "c-0123456789")
    assert not intent.exists()
    assert sorted(n.id for n in s.nodes("c")) == ["c-0123456789-0", "c-0123456789-1"]
    assert {(e["request_id"], e["reason"], e["placement"]) for e in s.events("c", "launch")} \
        == {("c-0123456789", "replace", "group-2")}
    assert len(res.launched) == 2 and res.errors == []
    reconcile._resume_intent(s, spec, cloud, res)  # done: nothing is replayed again
    assert len(cloud.launches) == 1


@pytest.mark.parametrize("count", [0, -1])
def test_an_intent_for_no_node_is_set_aside_not_replayed(tmp_path: Path, count: int) -> None:
    """kills: `int(intent["count"]) < 1` loosened (a count of 0 replayed)."""
    s, spec, intent = _store(tmp_path)
    intent.write_text(json.dumps({"request_id": "c-1", "count": count, "offer": OFFER.__dict__}))
    cloud, res = Cloud(), reconcile.ReconcileResult("c", Plan())
    reconcile._resume_intent(s, spec, cloud, res)
    assert cloud.launches == [] and not intent.exists()
    assert [e["file"] for e in s.events("c", "launch-intent-corrupt")] == [
        p.name for p in intent.parent.glob("launch-intent.corrupt-*.json")]


def test_a_replay_the_provider_refuses_is_an_error_and_is_not_retried(tmp_path: Path) -> None:
    s, spec, intent = _store(tmp_path)
    intent.write_text(json.dumps({"request_id": "c-2", "count": 1, "offer": OFFER.__dict__}))
    cloud, res = Cloud(fail=True), reconcile.ReconcileResult("c", Plan())
    reconcile._resume_intent(s, spec, cloud, res)
    assert len(cloud.launches) == 1 and not intent.exists() and s.nodes("c") == []
    assert res.errors == ["replaying interrupted launch: launch: throttled"]


class Head:
    """The head's answers _stop_nodes uses: each node's state, forget and drain (as
    spotctl.head.client.HeadClient has them); `down` raises what the client raises when
    the head does not answer."""

    def __init__(self, states: dict[str, str], down: bool = False) -> None:
        self.states, self.down = states, down
        self.forgot: list[str] = []
        self.drains: list[tuple[str, list[str]]] = []

    def status(self) -> dict[str, Any]:
        return {"nodes": {n: {"state": st} for n, st in self.states.items()}}

    def forget(self, ids: list[str]) -> None:
        self.forgot += ids

    def drain(self, reason: str, ids: list[str]) -> int:
        if self.down:
            raise HeadUnavailable("head: connection refused")
        self.drains.append((reason, ids))
        return 7


def _with_nodes(tmp_path: Path, ids: list[str]) -> tuple[Store, ClusterSpec]:
    s, spec, _ = _store(tmp_path)
    for nid in ids:
        s.upsert_node(NodeRow(id=nid, cluster="c", provider="local", zone="z", instance_type="t",
                              gpus=1, state="running", price=0.5, on_demand_price=1.0,
                              launched_at=1.0, ended_at=None, request_id="r", address="a"))
    return s, spec


IDS = ["run", "left", "unresp", "wait", "fin", "unknown"]
STATES = {"run": "running", "left": "left", "unresp": "unresponsive", "wait": "waiting",
          "fin": "finished"}


def test_a_node_in_the_job_drains_and_one_out_of_it_is_terminated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kills: any of the out-of-the-job states dropped from the list (that node would
    wait for a drain that never comes, billing), a running node terminated under its
    ranks, the terminated nodes not forgotten by the head or left live in the journal."""
    s, spec = _with_nodes(tmp_path, IDS)
    head, cloud = Head(STATES), Cloud()
    monkeypatch.setattr(reconcile, "head_client", lambda *a, **kw: head)
    reconcile._stop_nodes(s, spec, cloud, list(IDS), True, "rebalance")
    out = ["left", "unresp", "wait", "fin", "unknown"]
    assert cloud.terminated == out and head.forgot == out
    assert head.drains == [("rebalance", ["run"])]
    assert [n.id for n in s.nodes("c", include_ended=False)] == ["run"]
    assert [e["node"] for e in s.events("c", "terminate")] == out
    assert {e["reason"] for e in s.events("c", "terminate")} == {"rebalance"}
    [ev] = s.events("c", "drain-requested")
    assert (ev["nodes"], ev["gen"], ev["reason"]) == (["run"], 7, "rebalance")


def test_without_drain_every_node_is_terminated(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    s, spec = _with_nodes(tmp_path, IDS)
    head, cloud = Head(STATES), Cloud()
    monkeypatch.setattr(reconcile, "head_client", lambda *a, **kw: head)
    reconcile._stop_nodes(s, spec, cloud, list(IDS), False, "down")
    assert cloud.terminated == IDS and head.drains == [] and s.nodes("c", False) == []


def test_with_no_head_a_drain_cannot_be_asked_and_nodes_are_terminated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No head to ask: no node is known to be in the job, so none waits for a drain."""
    s, spec = _with_nodes(tmp_path, ["a", "b"])
    cloud = Cloud()

    def unavailable(*a: Any, **kw: Any) -> Any:
        raise HeadUnavailable("cluster c has no head recorded")

    monkeypatch.setattr(reconcile, "head_client", unavailable)
    reconcile._stop_nodes(s, spec, cloud, ["a", "b"], True, "rebalance")
    assert cloud.terminated == ["a", "b"] and s.nodes("c", False) == []


def test_a_drain_the_head_does_not_take_is_journaled(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    s, spec = _with_nodes(tmp_path, ["run"])
    head, cloud = Head({"run": "running"}, down=True), Cloud()
    monkeypatch.setattr(reconcile, "head_client", lambda *a, **kw: head)
    reconcile._stop_nodes(s, spec, cloud, ["run"], True, "rebalance")
    assert cloud.terminated == [] and [n.id for n in s.nodes("c", False)] == ["run"]
    [ev] = s.events("c", "drain-failed")
    assert ev["nodes"] == ["run"] and "connection refused" in ev["error"]
    assert s.events("c", "drain-requested") == []
