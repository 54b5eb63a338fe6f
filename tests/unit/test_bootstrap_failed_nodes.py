"""A node whose bootstrap failed never runs an agent and would bill until `down`: the
reconcile that bootstrapped it terminates it at once and journals why (issue 30, 6)."""

from __future__ import annotations

from typing import Any

from spotctl.control.planner import Plan
from spotctl.control.reconcile import ReconcileResult, _bootstrap
from spotctl.errors import AuthError
from spotctl.remote.bootstrap import HostResult
from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store


class Cloud:
    """The two calls _bootstrap makes of a provider, answered as a cloud would: node n2's
    bootstrap fails; terminate records what it was asked (or is refused)."""

    def __init__(self, refuse: bool = False) -> None:
        self.terminated: list[str] = []
        self.refuse = refuse

    def bootstrap(self, insts: list[Any]) -> list[HostResult]:
        return [HostResult("n1", True, "", True, 1.0),
                HostResult("n2", False, "python3 -m venv failed", False, 2.0)]

    def terminate(self, ids: list[str]) -> None:
        if self.refuse:
            raise AuthError("aws: terminate: UnauthorizedOperation")
        self.terminated += ids


def _store(tmp_path: Any) -> tuple[Store, ClusterSpec]:
    spec = ClusterSpec.model_validate({"name": "c", "provider": "local", "gpus": "1..2"})
    s = Store(tmp_path)
    s.upsert_cluster("c", "local", spec.model_dump(), "starting")
    for nid in ("n1", "n2"):
        s.upsert_node(NodeRow(id=nid, cluster="c", provider="aws", zone="z", instance_type="t",
                              gpus=1, state="pending", price=0.5, on_demand_price=1.0,
                              launched_at=1.0, ended_at=None, request_id="r", address="a"))
    return s, spec


def test_node_whose_bootstrap_failed_is_terminated_and_journaled(tmp_path: Any) -> None:
    s, spec = _store(tmp_path)
    cloud, res = Cloud(), ReconcileResult("c", Plan())
    _bootstrap(s, spec, cloud, [], None, res)
    assert cloud.terminated == ["n2"]
    assert [n.id for n in s.nodes("c", include_ended=False)] == ["n1"]
    assert [n.state for n in s.nodes("c") if n.id == "n2"] == ["terminated"]
    [ev] = s.events("c", "terminate")
    assert (ev["node"], ev["reason"]) == ("n2", "bootstrap failed")
    assert [e["node"] for e in s.events("c", "bootstrap-failed")] == ["n2"]
    assert res.errors == ["n2: python3 -m venv failed"] and res.bootstrap_failed == ["n2"]


def test_a_refused_terminate_is_an_error_and_the_node_stays_live(tmp_path: Any) -> None:
    s, spec = _store(tmp_path)
    res = ReconcileResult("c", Plan())
    _bootstrap(s, spec, Cloud(refuse=True), [], None, res)
    assert sorted(n.id for n in s.nodes("c", include_ended=False)) == ["n1", "n2"]
    assert any("terminating node(s) whose bootstrap failed" in e for e in res.errors), res.errors
