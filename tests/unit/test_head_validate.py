"""The head's input checks (spotctl.head.validate), in process: every bound at its edge and
one past it, every default, and the one line a refused value gets. The same checks behind a
real head over HTTP: tests/security/test_head_api.py and test_head_fuzz.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from spotctl.head import validate as v
from spotctl.spec import MAX_GPUS


def bad(fn: Callable[..., Any], *args: Any, **kw: Any) -> str:
    with pytest.raises(v.BadInput) as e:
        fn(*args, **kw)
    return str(e.value)


def test_strings_printable_and_bounded() -> None:
    assert v._str("a" * 256, "f") == "a" * 256
    assert v._str(" ~", "f", 2) == " ~"  # space is the first printable character
    assert v._str("", "f", 0) == ""
    msg = "f must be a printable string of at most 256 characters"
    assert bad(v._str, "a" * 257, "f") == msg
    assert bad(v._str, "a\x1f", "f") == msg
    assert bad(v._str, "\n", "f") == msg
    assert bad(v._str, 5, "f") == msg
    assert bad(v._str, "abc", "g", 2) == "g must be a printable string of at most 2 characters"


def test_integers_inclusive_bounds_no_bools_no_floats() -> None:
    assert v._int(0, "i") == 0 and v._int(1 << 62, "i") == 1 << 62
    assert bad(v._int, -1, "i") == f"i must be an integer in [0, {1 << 62}]"
    assert bad(v._int, (1 << 62) + 1, "i") == f"i must be an integer in [0, {1 << 62}]"
    assert v._int(3, "i", 3, 5) == 3 and v._int(5, "i", 3, 5) == 5
    assert bad(v._int, 2, "i", 3, 5) == "i must be an integer in [3, 5]"
    assert bad(v._int, 6, "i", 3, 5) == "i must be an integer in [3, 5]"
    assert bad(v._int, True, "i") and bad(v._int, False, "i")
    assert bad(v._int, 4.0, "i", 3, 5) and bad(v._int, "4", "i", 3, 5)
    assert bad(v._int, None, "i")


def test_numbers_finite_and_metrics_keep_nan_as_none() -> None:
    assert v._num(None, "n") is None
    assert bad(v._num, None, "n", optional=False) == "n must be a finite number"
    assert v._num(2, "n") == 2.0 and isinstance(v._num(2, "n"), float)
    assert v._num(-1.5, "n", optional=False) == -1.5
    for x in (math.nan, math.inf, -math.inf, True, "1", [1]):
        assert bad(v._num, x, "n") == "n must be a finite number"
    assert v._metric(None, "m") is None
    assert v._metric(math.nan, "m") is None and v._metric(math.inf, "m") is None
    assert v._metric(-math.inf, "m") is None
    assert v._metric(3, "m") == 3.0 and v._metric(0.25, "m") == 0.25
    assert bad(v._metric, "x", "m") == "m must be a finite number"
    assert bad(v._metric, True, "m") == "m must be a finite number"


def test_node_ids() -> None:
    assert v.node_id("n1") == "n1" and v.node_id("i-0abc.x_y") == "i-0abc.x_y"
    assert bad(v.node_id, "a/b") == "node_id must be a node id ([A-Za-z0-9._-], at most 128)"
    assert bad(v.node_id, 7, "leavers[0]") == (
        "leavers[0] must be a node id ([A-Za-z0-9._-], at most 128)"
    )


def test_notice() -> None:
    assert v.notice({}) == {"deadline": None}
    got = v.notice({"id": "x", "source": "aws", "kind": "spot", "action": "terminate",
                    "deadline": 12, "received_at": 3.5, "other": "dropped"})  # fmt: skip
    assert got == {"id": "x", "source": "aws", "kind": "spot", "action": "terminate",
                   "deadline": 12.0, "received_at": 3.5}  # fmt: skip
    assert v.notice({"id": None, "kind": "spot"}) == {"kind": "spot", "deadline": None}
    assert v.notice({"received_at": None}) == {"deadline": None, "received_at": None}
    assert bad(v.notice, []) == "notice must be an object"
    assert bad(v.notice, {"source": 1}) == (
        "notice.source must be a printable string of at most 256 characters"
    )
    assert bad(v.notice, {"action": "a" * 257}).startswith("notice.action must be")
    assert bad(v.notice, {"deadline": math.inf}) == "notice.deadline must be a finite number"
    assert bad(v.notice, {"received_at": "now"}) == ("notice.received_at must be a finite number")


def W(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"phase": "train", "world_size": 4, "rank": 1}
    base.update(kw)
    return base


def test_worker_defaults() -> None:
    assert v.worker(W(), 0) == {
        "rank": 1, "local_rank": 0, "world_size": 4, "step": 0, "phase": "train",
        "incarnation": "", "resume_step": 0, "first_step_at": None, "last_ckpt": 0,
        "loss": None, "throughput": None, "drain_step": None, "pid": 0,
    }  # fmt: skip
    # None where a count is expected is 0, as a fresh worker reports
    got = v.worker(W(incarnation=None, resume_step=None, last_ckpt=None, pid=None), 0)
    assert (got["incarnation"], got["resume_step"], got["last_ckpt"], got["pid"]) == ("", 0, 0, 0)


def test_worker_every_field_kept() -> None:
    got = v.worker(W(local_rank=63, step=1 << 53, incarnation="q" * 128, resume_step=7,
                     first_step_at=1.5, last_ckpt=6, loss=0.5, throughput=100, drain_step=0,
                     pid=1 << 31, engine="torchft", replicas=0, failed_steps=2,
                     startup={"started_at": 1.0, "forked_warm": True, "label": "x" * 64,
                              "none": None, "long": "x" * 65, "list": [1], "nan": math.nan,
                              "n": 2}), 3, max_world=4)  # fmt: skip
    assert got == {
        "rank": 1, "local_rank": 63, "world_size": 4, "step": 1 << 53, "phase": "train",
        "incarnation": "q" * 128, "resume_step": 7, "first_step_at": 1.5, "last_ckpt": 6,
        "loss": 0.5, "throughput": 100.0, "drain_step": 0, "pid": 1 << 31,
        "engine": "torchft", "replicas": 0, "failed_steps": 2,
        "startup": {"started_at": 1.0, "forked_warm": True, "label": "x" * 64, "none": None,
                    "n": 2},
    }  # fmt: skip
    assert v.worker(W(engine="torchrun", replicas=None, failed_steps=None), 0) == {
        **v.worker(W(), 0),
        "engine": "torchrun",
    }
    for phase in v.PHASES:
        assert v.worker(W(phase=phase), 0)["phase"] == phase


def test_worker_bounds() -> None:
    assert bad(v.worker, "x", 2) == "workers[2] must be an object"
    phases = "init, train, draining, drained, drain-failed, done"
    assert bad(v.worker, W(phase="run"), 1) == f"workers[1].phase must be one of {phases}"
    assert bad(v.worker, {"world_size": 1, "rank": 0}, 0).endswith(phases)
    assert v.worker(W(world_size=MAX_GPUS, rank=MAX_GPUS - 1), 0)["rank"] == MAX_GPUS - 1
    assert bad(v.worker, W(world_size=MAX_GPUS + 1), 0) == (
        f"workers[0].world_size must be an integer in [1, {MAX_GPUS}]"
    )
    assert bad(v.worker, W(world_size=5), 0, max_world=4) == (
        "workers[0].world_size must be an integer in [1, 4]"
    )
    assert bad(v.worker, W(world_size=0, rank=0), 0) == (
        f"workers[0].world_size must be an integer in [1, {MAX_GPUS}]"
    )
    assert v.worker(W(world_size=1, rank=0), 0)["world_size"] == 1
    assert bad(v.worker, W(rank=4), 0) == "workers[0].rank must be an integer in [0, 3]"
    assert bad(v.worker, W(rank=None), 0) == "workers[0].rank must be an integer in [0, 3]"
    assert bad(v.worker, W(local_rank=64), 0) == (
        "workers[0].local_rank must be an integer in [0, 63]"
    )
    top = 1 << 53
    for k in ("step", "resume_step", "last_ckpt", "drain_step", "failed_steps"):
        assert v.worker(W(**{k: top}), 0)[k] == top
        assert bad(v.worker, W(**{k: top + 1}), 0) == (
            f"workers[0].{k} must be an integer in [0, {top}]"
        )
        assert bad(v.worker, W(**{k: -1}), 0).startswith(f"workers[0].{k} must be")
    assert bad(v.worker, W(pid=(1 << 31) + 1), 0) == (
        f"workers[0].pid must be an integer in [0, {1 << 31}]"
    )
    assert bad(v.worker, W(incarnation="q" * 129), 0) == (
        "workers[0].incarnation must be a printable string of at most 128 characters"
    )
    assert bad(v.worker, W(first_step_at="t"), 0) == (
        "workers[0].first_step_at must be a finite number"
    )
    assert bad(v.worker, W(loss="low"), 0) == "workers[0].loss must be a finite number"
    assert bad(v.worker, W(throughput=[]), 0) == "workers[0].throughput must be a finite number"
    assert bad(v.worker, W(engine="ddp"), 0) == "workers[0].engine must be torchrun or torchft"
    assert v.worker(W(replicas=4), 0, max_world=4)["replicas"] == 4
    assert bad(v.worker, W(replicas=5), 0, max_world=4) == (
        "workers[0].replicas must be an integer in [0, 4]"
    )


def test_worker_startup() -> None:
    many = {f"k{i}": 1 for i in range(32)} | {"started_at": 1.0}
    msg = "workers[0].startup must be an object of at most 32 numbers"
    assert bad(v.worker, W(startup=many), 0) == msg
    ok = {f"k{i}": 1 for i in range(31)} | {"started_at": 1.0}
    assert len(v.worker(W(startup=ok), 0)["startup"]) == 32
    assert bad(v.worker, W(startup=[1]), 0) == msg
    assert bad(v.worker, W(startup={"imports": 1.0}), 0) == (
        "workers[0].startup.started_at must be a finite number"
    )
    assert bad(v.worker, W(startup={"started_at": None}), 0) == (
        "workers[0].startup.started_at must be a finite number"
    )
    assert bad(v.worker, W(startup={"started_at": 1.0, "k" * 65: 1}), 0) == (
        "workers[0].startup key must be a printable string of at most 64 characters"
    )


def test_fields_named_in_one_line() -> None:
    v.fields({"a": 1}, ("a", "b"), ("a",))
    assert bad(v.fields, {"a": 1, "zz": 2}, ("a", "b")) == ("unexpected field 'zz' (allowed: a, b)")
    assert bad(v.fields, {"x" * 100: 1}, ("a",)) == (f"unexpected field {'x' * 40!r} (allowed: a)")
    assert bad(v.fields, {"a": 1}, ("a", "b", "c"), ("b", "c")) == "b missing"


def test_net() -> None:
    assert v.net({}) == {"interfaces": [], "rdma": [], "efa": 0, "libfabric": False,
                         "ofi_nccl": False, "tcpx": False, "nccl_transport": None}  # fmt: skip
    got = v.net({"interfaces": [{"name": "eth0", "kind": "ena", "driver": "d" * 32}],
                 "rdma": [{"name": "efa0"}], "efa": 64, "libfabric": True, "tcpx": True,
                 "nccl_transport": "t" * 64})  # fmt: skip
    assert got == {"interfaces": [{"name": "eth0", "kind": "ena", "driver": "d" * 32}],
                   "rdma": [{"name": "efa0", "kind": "", "driver": ""}], "efa": 64,
                   "libfabric": True, "ofi_nccl": False, "tcpx": True,
                   "nccl_transport": "t" * 64}  # fmt: skip
    assert bad(v.net, []) == "net must be an object"
    assert bad(v.net, {"gpus": 1}).startswith("unexpected field 'gpus' (allowed: interfaces, ")
    assert bad(v.net, {"efa": 65}) == "net.efa must be an integer in [0, 64]"
    assert bad(v.net, {"ofi_nccl": 1}) == "net.ofi_nccl must be true or false"
    assert bad(v.net, {"nccl_transport": "t" * 65}) == (
        "net.nccl_transport must be a printable string of at most 64 characters"
    )
    dev = {"name": "e"}
    assert len(v.net({"rdma": [dev] * 64})["rdma"]) == 64
    assert bad(v.net, {"rdma": [dev] * 65}) == "net.rdma must be a list of at most 64"
    assert bad(v.net, {"interfaces": "eth0"}) == "net.interfaces must be a list of at most 64"
    shape = "must be an object of name, kind, driver"
    assert bad(v.net, {"rdma": [dev, {"kind": "x"}]}) == f"net.rdma[1] {shape}"
    assert bad(v.net, {"rdma": [{"name": "e", "speed": 1}]}) == f"net.rdma[0] {shape}"
    assert bad(v.net, {"interfaces": ["eth0"]}) == f"net.interfaces[0] {shape}"
    assert bad(v.net, {"rdma": [{"name": "e" * 33}]}) == (
        "net.rdma[0].name must be a printable string of at most 32 characters"
    )


def test_group() -> None:
    assert v.group({"size": 1, "port": 1}) == {"size": 1, "port": 1}
    full = {"size": 64, "port": 65535, "id": "g123456", "gen": 1 << 40, "slot": 63}
    assert v.group(full) == {**full, "broken": False}
    assert v.group({**full, "broken": True})["broken"] is True
    assert bad(v.group, 1) == "group must be an object"
    assert bad(v.group, {"size": 2}) == "port missing"
    assert bad(v.group, {"size": 65, "port": 1}) == "group.size must be an integer in [1, 64]"
    assert bad(v.group, {"size": 0, "port": 1}) == "group.size must be an integer in [1, 64]"
    assert bad(v.group, {"size": 2, "port": 0}) == "group.port must be an integer in [1, 65535]"
    assert bad(v.group, {"size": 2, "port": 65536}).startswith("group.port must be")
    gid = "group.id must be g followed by digits"
    for x in ("g", "g1234567", "h1", "g1a", "g١"):
        assert bad(v.group, {"size": 2, "port": 1, "id": x, "gen": 0, "slot": 0}) == gid, x
    assert bad(v.group, {"size": 2, "port": 1, "id": "g" * 17}) == (
        "group.id must be a printable string of at most 16 characters"
    )
    assert bad(v.group, {**full, "gen": (1 << 40) + 1}) == (
        f"group.gen must be an integer in [0, {1 << 40}]"
    )
    assert bad(v.group, {**full, "gen": None}).startswith("group.gen must be")
    assert bad(v.group, {**full, "slot": 64}) == "group.slot must be an integer in [0, 63]"
    assert bad(v.group, {**full, "size": 2, "slot": 2}) == (
        "group.slot must be an integer in [0, 1]"
    )
    assert bad(v.group, {**full, "broken": 1}) == "group.broken must be true or false"
    assert bad(v.group, {"size": 2, "port": 1, "broken": True}) == (
        "group.broken needs the group's id, gen and slot"
    )
    assert bad(v.group, {"size": 2, "port": 1, "id": None, "broken": False}) == (
        "group.broken needs the group's id, gen and slot"
    )


def test_heartbeat() -> None:
    assert v.heartbeat({"node_id": "n1"}) == {
        "node_id": "n1",
        "agent_state": "waiting",
        "workers": [],
        "ready": True,
    }
    got = v.heartbeat({"node_id": "n1", "agent_state": "running", "addr": "a" * 128,
                       "workers": [W()], "drain_gen": 1 << 40, "notice": {"kind": "spot"},
                       "ready": False, "net": {}, "group": {"size": 1, "port": 9}})  # fmt: skip
    assert got == {"node_id": "n1", "agent_state": "running", "addr": "a" * 128,
                   "workers": [v.worker(W(), 0)], "drain_gen": 1 << 40,
                   "notice": {"kind": "spot", "deadline": None}, "ready": False,
                   "net": v.net({}), "group": {"size": 1, "port": 9}}  # fmt: skip
    for s in v.AGENT_STATES:
        assert v.heartbeat({"node_id": "n", "agent_state": s})["agent_state"] == s
    # absent and null mean the same for the optional objects
    assert v.heartbeat({"node_id": "n", "notice": None, "net": None, "group": None}) == (
        v.heartbeat({"node_id": "n"})
    )
    assert bad(v.heartbeat, {}) == "node_id missing"
    assert bad(v.heartbeat, {"node_id": "n", "gpu": 1}).startswith(
        "unexpected field 'gpu' (allowed: node_id, agent_state, addr, workers, "
    )
    assert bad(v.heartbeat, {"node_id": "n", "agent_state": "up"}) == (
        "agent_state must be one of waiting, running, leaving, left, finished, failed, crashed"
    )
    assert bad(v.heartbeat, {"node_id": "n", "addr": "a" * 129}) == (
        "addr must be a printable string of at most 128 characters"
    )
    # a crash-looping node's last error line (issue 62): one printable, bounded line
    assert v.heartbeat({"node_id": "n", "error": "ValueError: x"})["error"] == "ValueError: x"
    for err in ("a\nb", "e" * 401, 7):
        assert bad(v.heartbeat, {"node_id": "n", "error": err}) == (
            "error must be a printable string of at most 400 characters")
    assert len(v.heartbeat({"node_id": "n", "workers": [W()] * 64})["workers"]) == 64
    assert bad(v.heartbeat, {"node_id": "n", "workers": [W()] * 65}) == (
        "workers must be a list of at most 64"
    )
    assert bad(v.heartbeat, {"node_id": "n", "workers": {}}) == (
        "workers must be a list of at most 64"
    )
    assert (
        bad(v.heartbeat, {"node_id": "n", "workers": [W(), W(world_size=9)]}, max_world=8)
        == "workers[1].world_size must be an integer in [1, 8]"
    )
    assert bad(v.heartbeat, {"node_id": "n", "drain_gen": -1}) == (
        f"drain_gen must be an integer in [0, {1 << 40}]"
    )
    assert bad(v.heartbeat, {"node_id": "n", "ready": "yes"}) == "ready must be true or false"
    assert bad(v.heartbeat, {"node_id": "n", "notice": 1}) == "notice must be an object"
    assert bad(v.heartbeat, {"node_id": "n", "net": 1}) == "net must be an object"
    assert bad(v.heartbeat, {"node_id": "n", "group": 1}) == "group must be an object"


def test_drain_and_node_lists() -> None:
    assert v.drain({"reason": "rebalance", "leavers": ["n1", "n2"]}) == ("rebalance", ["n1", "n2"])
    assert v.drain({"reason": "rebalance", "leavers": []}) == ("rebalance", [])
    assert bad(v.drain, {"reason": "notice", "leavers": []}) == "reason must be 'rebalance'"
    assert bad(v.drain, {"reason": "rebalance"}) == "leavers missing"
    assert bad(v.drain, {"reason": "rebalance", "leavers": ["n1", "a b"]}) == (
        "leavers[1] must be a node id ([A-Za-z0-9._-], at most 128)"
    )
    assert len(v.node_list(["n"] * 1024, "x")) == 1024
    assert bad(v.node_list, ["n"] * 1025, "x") == "x must be a list of node ids"
    assert bad(v.node_list, ["n"] * 3, "x", max_len=2) == "x must be a list of node ids"
    assert bad(v.node_list, "n1", "x") == "x must be a list of node ids"


def test_events() -> None:
    assert v.event({"type": "note", "message": "m" * 1024, "node": "n1"}) == (
        "note",
        {"message": "m" * 1024, "node": "n1"},
    )
    assert v.event({"type": "gpu-gate-failed", "node": "n2", "reason": "no driver"}) == (
        "gpu-gate-failed",
        {"node": "n2", "reason": "no driver"},
    )
    assert v.event({"type": "rebalance-recommendation"}) == ("rebalance-recommendation", {})
    types = "rebalance-recommendation, gpu-gate-failed, note"
    assert bad(v.event, {"type": "rescale"}) == f"event type must be one of {types}"
    assert bad(v.event, {}) == f"event type must be one of {types}"
    assert bad(v.event, {"type": ["note"]}) == f"event type must be one of {types}"
    assert bad(v.event, {"type": "note", "seq": 1}) == "event field 'seq' is not allowed for note"
    assert bad(v.event, {"type": "note", "message": "m" * 1025}) == (
        "message must be a printable string of at most 1024 characters"
    )
    assert bad(v.event, {"type": "note", "node": "../x"}) == (
        "node must be a node id ([A-Za-z0-9._-], at most 128)"
    )
    assert v.NODE_EVENTS == ("rebalance-recommendation", "gpu-gate-failed")


def test_worker_and_heartbeat_fields_added_since_the_last_triage() -> None:
    """The route, regroup pause, failed syncs, dropped steps and the replica index, each at
    its edges and one past (kills the 72 mutmut survivors of validate.py at 461ae6c, all
    in these fields: their bounds, their messages, their keys)."""
    top = 1 << 53
    for route in ("plain", "elastic"):
        assert v.worker(W(route=route), 0)["route"] == route
    assert "route" not in v.worker(W(route=None), 0)
    for x in ("ddp", "", 1):
        assert bad(v.worker, W(route=x), 2) == "workers[2].route must be plain or elastic"
    for pause in (0, 0.25, 1e6):
        got = v.worker(W(regroup_pause_s=pause), 0)["regroup_pause_s"]
        assert got == pause and isinstance(got, float)
    assert "regroup_pause_s" not in v.worker(W(regroup_pause_s=None), 0)
    for pause in (-1e-9, 1e6 + 1):
        assert bad(v.worker, W(regroup_pause_s=pause), 1) == (
            "workers[1].regroup_pause_s must be seconds in [0, 1e6]")
    assert bad(v.worker, W(regroup_pause_s="1"), 1) == (
        "workers[1].regroup_pause_s must be a finite number")
    for k in ("failed_syncs", "dropped_steps", "notice_dropped"):
        assert v.worker(W(**{k: 0}), 0)[k] == 0
        assert v.worker(W(**{k: top}), 0)[k] == top
        assert k not in v.worker(W(**{k: None}), 0)
        assert bad(v.worker, W(**{k: top + 1}), 3) == (
            f"workers[3].{k} must be an integer in [0, {top}]")
        assert bad(v.worker, W(**{k: -1}), 3) == f"workers[3].{k} must be an integer in [0, {top}]"
    both = v.worker(W(failed_syncs=2, dropped_steps=7), 0)
    assert (both["failed_syncs"], both["dropped_steps"]) == (2, 7)
    hb = {"node_id": "n1"}
    assert "replica_index" not in v.heartbeat(hb)
    assert "replica_index" not in v.heartbeat({**hb, "replica_index": None})
    assert v.heartbeat({**hb, "replica_index": 0})["replica_index"] == 0
    assert v.heartbeat({**hb, "replica_index": MAX_GPUS})["replica_index"] == MAX_GPUS
    for x in (-1, MAX_GPUS + 1, "0", 1.0, True):
        assert bad(v.heartbeat, {**hb, "replica_index": x}) == (
            f"replica_index must be an integer in [0, {MAX_GPUS}]")
