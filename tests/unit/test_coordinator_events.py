"""What the head journals when a worker group forms, as whole events: `train-start`,
`rescale` (every field `report` and `status` read) and `regroup`, and which workers'
reports may form a group at all. Driven by scripted heartbeats and a fake clock, as
tests/unit/test_coordinator.py."""

from __future__ import annotations

from typing import Any

from spotctl.head.coordinator import Coordinator
from tests.unit.test_coordinator import Clock, hb, training, w


def body(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k not in ("seq", "ts")}


def of(c: Coordinator, type_: str) -> list[dict[str, Any]]:
    return [body(e) for e in c.events if e["type"] == type_]


FORMED = ("train-start", "rescale", "regroup")
STARTUP = {"imports": 0.5, "process_group": 0.25, "restore": 0.125, "first_step": 0.1}


def notice_then_reform(
    startup_at: float | None, first_after: float = 8.0, **kw: Any
) -> tuple[Clock, Coordinator]:
    """Three torchrun nodes at step 50; b gets a notice at t0 = clock + 1, all drain at 52,
    b leaves, a's new group of two reports (first without its first step, then with it at
    t0 + `first_after`). a's rank 0 reports its start-up with started_at t0 + startup_at."""
    clk, c = training(["a", "b", "c"], "inc1", 50, **kw)
    clk.t += 1
    t0 = clk.t
    hb(c, "b", workers=[w(1, "inc1", 51)], notice={"id": "x", "deadline": clk.t + 120})
    for i, n in enumerate(["a", "b", "c"]):
        hb(c, n, workers=[w(i, "inc1", 52, phase="drained", drain_step=52)], drain_gen=1)
    hb(c, "b", state="left", drain_gen=1)
    st = None if startup_at is None else {**STARTUP, "started_at": t0 + startup_at}
    clk.t += 2
    # the new group's rank 0 reports before its first step: nothing is journaled yet
    hb(c, "a", workers=[w(0, "inc2", 52, ws=2, resume=52, startup=st)])
    assert of(c, "rescale") == []
    clk.t = t0 + first_after
    hb(c, "a", workers=[w(0, "inc2", 53, ws=2, resume=52, first=clk.t, startup=st)])
    return clk, c


def test_a_notice_rescale_event_whole() -> None:
    clk, c = notice_then_reform(startup_at=3.0)
    assert of(c, "rescale") == [{
        "type": "rescale", "incarnation": "inc2", "from_world_size": 3, "to_world_size": 2,
        "reason": "notice", "cause_seen": True, "checkpoint_step": 52, "resume_step": 52, "lost_steps": 0,
        "engine": "torchrun", "notice_to_resume_s": 8.0,
        "worker_start": {**STARTUP, "started_at": 1004.0},  # the notice at 1001, + 3 s
        "worker_spawned_after_s": 3.0,
    }]  # fmt: skip
    # more reports of the same group journal no more of it
    clk.t += 1
    hb(c, "a", workers=[w(0, "inc2", 60, ws=2, resume=52, first=clk.t)])
    hb(c, "c", workers=[w(1, "inc2", 60, ws=2, resume=52, first=clk.t)])
    assert [e["type"] for e in c.events if e["type"] in FORMED] == ["train-start", "rescale"]


def test_spawn_time_kept_when_zero_or_small_dropped_when_negative() -> None:
    _, c = notice_then_reform(startup_at=0.0)
    ev = of(c, "rescale")[0]
    assert ev["worker_spawned_after_s"] == 0.0 and ev["worker_start"] is not None
    _, c = notice_then_reform(startup_at=0.25)
    assert of(c, "rescale")[0]["worker_spawned_after_s"] == 0.25
    _, c = notice_then_reform(startup_at=0.0004)  # rounded to the millisecond
    assert of(c, "rescale")[0]["worker_spawned_after_s"] == 0.0
    # started before the notice: these workers were not started for this rescale
    _, c = notice_then_reform(startup_at=-1.0)
    ev = of(c, "rescale")[0]
    assert ev["worker_spawned_after_s"] is None and ev["worker_start"] is None
    # no start-up reported
    _, c = notice_then_reform(startup_at=None)
    ev = of(c, "rescale")[0]
    assert ev["worker_spawned_after_s"] is None and ev["worker_start"] is None
    # a first step at the notice's own instant: a pause of 0, not unknown
    _, c = notice_then_reform(startup_at=None, first_after=0.0)
    assert of(c, "rescale")[0]["notice_to_resume_s"] == 0.0
    _, c = notice_then_reform(startup_at=None, first_after=0.0004)
    assert of(c, "rescale")[0]["notice_to_resume_s"] == 0.0


def test_only_rank_0_of_a_training_group_forms_it_and_old_groups_never_come_back() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    # rank 1 of a new group, or a rank 0 that is not training yet, forms nothing
    hb(c, "b", workers=[w(1, "inc2", 11, ws=2, resume=10, first=clk.t)])
    hb(c, "a", workers=[w(0, "inc2", 11, ws=2, resume=10, first=clk.t, phase="init")])
    hb(c, "a", workers=[w(0, "", 11, ws=2, resume=10, first=clk.t)])
    assert c.status()["incarnation"] == "inc1"
    for phase in ("train", "drained", "done"):
        clk2, c2 = training(["a", "b"], "inc1", 10)
        hb(c2, "a", workers=[w(0, "inc2", 11, ws=2, resume=10, first=clk2.t + 1, phase=phase)])
        assert c2.status()["incarnation"] == "inc2", phase
    hb(c, "a", workers=[w(0, "inc2", 11, ws=2, resume=10, first=clk.t)])
    hb(c, "a", workers=[w(0, "inc3", 12, ws=2, resume=11, first=clk.t)])
    assert c.status()["incarnation"] == "inc3"
    # a late report of either older group changes nothing
    formed = [e for e in c.events if e["type"] in FORMED]
    hb(c, "b", workers=[w(0, "inc1", 99, ws=2, resume=10, first=clk.t)])
    hb(c, "b", workers=[w(0, "inc2", 99, ws=2, resume=10, first=clk.t)])
    assert c.status()["incarnation"] == "inc3"
    assert [e for e in c.events if e["type"] in FORMED] == formed


def test_train_start_events_whole() -> None:
    clk = Clock()
    c = Coordinator(clk)
    clk.t += 1
    hb(c, "a", workers=[w(0, "inc1", 0, ws=1, resume=0)])  # no first step yet
    assert of(c, "train-start") == []
    hb(c, "a", workers=[w(0, "inc1", 1, ws=1, resume=0, first=clk.t)])
    assert of(c, "train-start") == [{"type": "train-start", "world_size": 1, "resume_step": 0}]
    # a first step at the head's own start is not before it: not adopted
    clk2 = Clock()
    c2 = Coordinator(clk2)
    hb(c2, "a", workers=[w(0, "inc1", 7, ws=1, resume=3, first=clk2.t)])
    assert of(c2, "train-start") == [{"type": "train-start", "world_size": 1, "resume_step": 3}]
    c3 = Coordinator(clk2, engine="torchft")
    hb(c3, "a", workers=[w(0, "ft-q1", 40, ws=2, resume=5, first=clk2.t - 0.5)])
    assert of(c3, "train-start") == [
        {"type": "train-start", "world_size": 2, "resume_step": 40, "adopted": True}
    ]


def test_regroup_event_whole() -> None:
    clk, c = training(["a", "b"], "ft-q1", 10, engine="torchft")
    clk.t += 1
    hb(c, "a", workers=[w(0, "ft-q2", 12, ws=2, resume=11, first=clk.t)])
    assert of(c, "regroup") == [{"type": "regroup", "world_size": 2, "resume_step": 11,
                                 "reason": "same-members", "lost_steps": None,
                                 "engine": "torchft"}]  # fmt: skip
    # a notice pending while the same replicas regroup: still a regroup
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q2", 13, ws=2)], notice={"id": "n", "deadline": clk.t + 30})
    hb(c, "a", workers=[w(0, "ft-q3", 14, ws=2, resume=13, first=clk.t)])
    assert [e["resume_step"] for e in of(c, "regroup")] == [11, 13]
    assert of(c, "rescale") == []


def test_last_checkpoint_is_the_newest_any_worker_reported() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    hb(c, "a", workers=[w(0, "inc1", 12, last_ckpt=10)])
    hb(c, "b", workers=[w(1, "inc1", 12, last_ckpt=5)])
    assert c.status()["last_checkpoint_step"] == 10


DRAIN = ("drain-start", "drain-committed", "drain-release", "drain-end")


def drains(c: Coordinator) -> list[dict[str, Any]]:
    return [body(e) for e in c.events if e["type"] in DRAIN]


def test_a_notice_drains_events_whole_and_its_deadline_is_the_notices_less_2_s() -> None:
    clk, c = training(["a", "b", "c"], "inc1", 50)
    clk.t += 1
    t0 = clk.t
    hb(c, "b", workers=[w(1, "inc1", 51)], notice={"id": "x", "deadline": t0 + 10})
    assert c.drain is not None and c.drain.deadline == t0 + 8.0  # the notice's, less 2 s
    assert drains(c) == [{"type": "drain-start", "gen": 1, "reason": "notice",
                          "members": ["a", "b", "c"], "leavers": ["b"], "joiners": []}]  # fmt: skip
    # a member whose agent has not taken the drain (its drain_gen is older) is not drained
    # yet, whatever its workers say
    hb(c, "a", workers=[w(0, "inc1", 52, phase="drained", drain_step=52)], drain_gen=0)
    assert len(drains(c)) == 1
    # the drained step is each node's drain step, or its step where none is given
    hb(c, "a", workers=[w(0, "inc1", 52, phase="drained", drain_step=52)], drain_gen=1)
    hb(c, "b", workers=[w(1, "inc1", 53, phase="drained")], drain_gen=1)
    hb(c, "c", workers=[w(2, "inc1", 52, phase="drained", drain_step=52)], drain_gen=1)
    assert drains(c)[1:] == [{"type": "drain-committed", "gen": 1, "step": 53}]
    hb(c, "b", state="left", drain_gen=1)
    assert drains(c)[2:] == [{"type": "drain-release", "gen": 1, "why": "leavers gone"},
                             {"type": "drain-end", "gen": 1, "why": "leavers gone"}]  # fmt: skip
    assert c.release_gen == 1 and c.drain is None


def test_a_drain_times_out_at_its_deadline_not_before() -> None:
    clk, c = training(["a", "b", "c"], "inc1", 50)
    clk.t += 1
    t0 = clk.t
    hb(c, "b", workers=[w(1, "inc1", 51)], notice={"id": "x", "deadline": t0 + 600})
    assert c.drain is not None and c.drain.deadline == t0 + 20.0  # DRAIN_TIMEOUT_S

    def beats() -> None:  # a drained; b and c still at their step (alive, not drained)
        hb(c, "b", workers=[w(1, "inc1", 52)], drain_gen=1)
        hb(c, "c", workers=[w(2, "inc1", 52)], drain_gen=1)
        hb(c, "a", workers=[w(0, "inc1", 52, phase="drained", drain_step=52)], drain_gen=1)

    for t in (3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 19.99):
        clk.t = t0 + t
        beats()
    assert c.drain is not None and len(drains(c)) == 1
    clk.t = t0 + 20.0
    beats()
    assert drains(c)[-2:] == [{"type": "drain-release", "gen": 1, "why": "timed out"},
                              {"type": "drain-end", "gen": 1, "why": "timed out"}]  # fmt: skip
    # a notice without a usable deadline gets the full DRAIN_TIMEOUT_S
    for dl in (None, float("inf"), "soon"):
        clk2, c2 = training(["a", "b"], "inc1", 5)
        hb(c2, "b", workers=[w(1, "inc1", 6, ws=2)], notice={"id": "x", "deadline": dl})
        assert c2.drain is not None and c2.drain.deadline == clk2.t + 20.0, dl


def test_a_join_drain_commits_lets_the_joiner_go_and_ends_when_the_group_reformed() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    hb(c, "n", "waiting")
    assert drains(c) == [{"type": "drain-start", "gen": 1, "reason": "join",
                          "members": ["a", "b"], "leavers": [], "joiners": ["n"]}]  # fmt: skip
    assert c.cause is not None and (c.cause.reason, c.cause.at) == ("join", clk.t)
    for i, n in enumerate(["a", "b"]):
        hb(c, n, workers=[w(i, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
    assert drains(c)[1:] == [{"type": "drain-committed", "gen": 1, "step": 12}]
    assert hb(c, "n", "waiting")["go"]
    clk.t += 3
    hb(c, "a", workers=[w(0, "inc2", 13, ws=3, resume=12, first=clk.t)])
    assert drains(c)[2:] == [{"type": "drain-end", "gen": 1, "why": "reformed"}]
    ev = of(c, "rescale")[-1]
    assert (ev["reason"], ev["notice_to_resume_s"], ev["from_world_size"]) == ("join", 3.0, 2)


def test_a_join_drain_keeps_a_failure_as_the_cause() -> None:
    """A join while a failure is being recovered from: the rescale that follows is the
    failure's, timed from it."""
    from spotctl.head.coordinator import Cause

    clk, c = training(["a", "b"], "inc1", 10)
    c.cause = Cause("failure", clk.t)
    clk.t += 1
    hb(c, "n", "waiting")
    assert c.cause.reason == "failure" and c.cause.at == clk.t - 1
    c2 = training(["a", "b"], "inc1", 10)[1]
    c2.cause = Cause("restart", 5.0)
    hb(c2, "n", "waiting")
    assert c2.cause.reason == "join"


def test_a_notice_for_a_node_that_is_not_training_makes_it_leave_without_a_drain() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    hb(c, "x", "waiting")  # a join drain starts for x
    for i, n in enumerate(["a", "b"]):
        hb(c, n, workers=[w(i, "inc1", 11, "drained", ws=2, drain_step=11)], drain_gen=1)
    clk.t += 100  # long past forming: x never trained
    hb(c, "x", "waiting", notice={"id": "n", "deadline": clk.t + 120})
    c.tick()
    assert c.status()["nodes"]["x"]["state"] == "leaving"
    assert [d for d in drains(c) if d["type"] == "drain-start" and d["reason"] == "notice"] == []


NODE = ("register", "join-request", "join", "leave", "node-unresponsive", "node-back")


def lifecycle(c: Coordinator) -> list[dict[str, Any]]:
    return [body(e) for e in c.events if e["type"] in NODE]


def test_a_nodes_life_as_journaled_and_shown() -> None:
    clk = Clock()
    c = Coordinator(clk, dead_after_s=4.0)
    c.heartbeat({"node_id": "a"})  # no state: waiting
    assert c.status()["nodes"]["a"]["state"] == "waiting"
    c.heartbeat({"node_id": "a", "agent_state": "running", "addr": "10.0.0.1",
                 "net": {"efa": 0}, "workers": [w(0, "inc1", 1, ws=1, first=clk.t)]})  # fmt: skip
    c.heartbeat({"node_id": "a", "agent_state": "running",
                 "workers": [w(0, "inc1", 2, ws=1)]})  # fmt: skip
    st = c.status()["nodes"]["a"]
    assert (st["state"], st["addr"], st["net"]) == ("running", "10.0.0.1", {"efa": 0})
    # a second node while a group trains asks to join
    hb(c, "b", "waiting")
    assert lifecycle(c) == [{"type": "register", "node": "a"}, {"type": "join", "node": "a"},
                            {"type": "join-request", "node": "b"}]  # fmt: skip
    # silent past dead_after_s (not at it), then back
    clk.t += 4.0
    hb(c, "b", "waiting")
    c.tick()
    assert lifecycle(c)[3:] == []
    clk.t += 0.5
    c.tick()
    assert lifecycle(c)[3:] == [{"type": "node-unresponsive", "node": "a", "silent_s": 4.5}]
    assert c.status()["nodes"]["a"]["state"] == "unresponsive"
    hb(c, "a", workers=[w(0, "inc1", 3, ws=1)])
    assert lifecycle(c)[4:] == [{"type": "node-back", "node": "a"}]
    assert c.status()["nodes"]["a"]["state"] == "running"
    # it leaves once; a left node's later reports change nothing but a fresh start
    hb(c, "a", "left")
    hb(c, "a", "left")
    hb(c, "a", "running")
    assert lifecycle(c)[5:] == [{"type": "leave", "node": "a"}]
    assert c.status()["nodes"]["a"]["state"] == "left"
    hb(c, "a", "waiting")
    assert c.status()["nodes"]["a"]["state"] == "waiting"


def test_a_rebalance_drain_on_request() -> None:
    clk, c = training(["a", "b", "c"], "inc1", 10)
    assert c.request_drain(leavers=["c"]) == 1
    assert drains(c) == [{"type": "drain-start", "gen": 1, "reason": "rebalance",
                          "members": ["a", "b", "c"], "leavers": ["c"], "joiners": []}]  # fmt: skip
    assert c.request_drain(leavers=["b"]) == 0  # busy: one drain at a time
    assert len(drains(c)) == 1
    idle = Coordinator(Clock())
    hb(idle, "a", "waiting")
    assert idle.request_drain(leavers=["a"]) == 0  # nothing trains: nothing to drain


def test_torchft_leave_on_request_names_known_nodes_only() -> None:
    clk, c = training(["a", "b"], "ft-q1", 10, engine="torchft")
    assert c.request_drain(leavers=["zz"]) == 0 and c.request_drain() == 0
    assert of(c, "leave-requested") == []
    gen = c.request_drain(leavers=["b", "zz"])
    assert gen > 0 and of(c, "leave-requested") == [
        {"type": "leave-requested", "gen": gen, "reason": "rebalance", "nodes": ["b"]}
    ]
    assert hb(c, "b", workers=[w(1, "ft-q1", 11, ws=2)])["leave"]
    assert not hb(c, "a", workers=[w(0, "ft-q1", 11, ws=2)])["leave"]
    assert c.drain is None


def test_notices_journaled_once_and_timed_from_the_first() -> None:
    clk, c = training(["a", "b", "c"], "inc1", 10)
    clk.t += 1
    c.notice("b", {"id": "x", "deadline": clk.t + 120, "node": "spoofed", "kind": "spot"})
    assert of(c, "notice") == [{"type": "notice", "node": "b", "id": "x",
                                "deadline": clk.t + 120, "kind": "spot"}]  # fmt: skip
    c.notice("b", {"id": "y", "deadline": clk.t + 60})  # the same node again: nothing
    assert len(of(c, "notice")) == 1
    first = clk.t
    clk.t += 1
    c.notice("c", {"id": "z", "deadline": clk.t + 120})
    assert c.cause is not None and (c.cause.reason, c.cause.at) == ("notice", first)
    # a notice after a failure: the notice is the cause from then on
    from spotctl.head.coordinator import Cause

    clk2, c2 = training(["a", "b"], "inc1", 10)
    c2.cause = Cause("failure", clk2.t - 5)
    c2.notice("a", {"id": "n"})
    assert (c2.cause.reason, c2.cause.at) == ("notice", clk2.t)
    # a notice for a node the head has not heard of yet
    c2.notice("new", {"id": "m"})
    assert c2.status()["nodes"]["new"]["notice"] == {"id": "m"}
    assert c2.nodes["new"].node_id == "new" and c2.nodes["new"].registered_at == clk2.t


def test_a_dead_member_on_torchrun_kills_its_peers_workers_each_time() -> None:
    clk, c = training(["a", "b", "c"], "inc1", 10, dead_after_s=4.0)
    last = clk.t
    clk.t += 3
    hb(c, "a", workers=[w(0, "inc1", 11)])
    hb(c, "c", workers=[w(2, "inc1", 11)])
    clk.t += 2  # b silent for 5 s
    hb(c, "a", workers=[w(0, "inc1", 11)])
    assert (c.kill_gen, c.kill_incarnation) == (1, "inc1")
    assert c.cause is not None and (c.cause.reason, c.cause.at) == ("failure", last)
    clk.t += 3
    hb(c, "a", workers=[w(0, "inc1", 11)])  # c silent for 5 s now: a second kill
    assert c.kill_gen == 2
    # a node that was not in the group dies: nobody is killed
    clk2, c2 = training(["a", "b"], "inc1", 10, dead_after_s=4.0)
    hb(c2, "x", "waiting")
    clk2.t += 3
    hb(c2, "a", workers=[w(0, "inc1", 11, ws=2)])
    hb(c2, "b", workers=[w(1, "inc1", 11, ws=2)])
    clk2.t += 2
    hb(c2, "a", workers=[w(0, "inc1", 11, ws=2)])
    assert c2.status()["nodes"]["x"]["state"] == "unresponsive" and c2.kill_gen == 0
    # on torchft the quorum has dropped it already: nobody is killed
    clk3, c3 = training(["a", "b"], "ft-q1", 10, dead_after_s=4.0, engine="torchft")
    clk3.t += 5
    hb(c3, "a", workers=[w(0, "ft-q1", 11, ws=2)])
    assert c3.kill_gen == 0 and c3.status()["nodes"]["b"]["state"] == "unresponsive"


def test_status_whole() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1.5
    hb(c, "a", workers=[w(0, "inc1", 12, ws=2, loss=0.5, throughput=300.0, last_ckpt=10)])
    clk.t += 0.25
    st = c.status()
    nodes = st.pop("nodes")
    assert st == {"engine": "torchrun", "world_size": 2, "step": 12, "last_checkpoint_step": 10,
                  "loss": 0.5, "throughput": 300.0, "incarnation": "inc1", "drain": None,
                  "route": "elastic", "restarts": 0}  # fmt: skip
    a = dict(nodes["a"])
    workers = a.pop("workers")
    assert a == {"state": "running", "last_heartbeat": 1001.5, "heartbeat_age_s": 0.25,
                 "addr": "", "notice": None, "step": 12, "world_size": 2, "net": None,
                 "group": None, "replica_index": None, "error": None}  # fmt: skip
    assert [(x["rank"], x["step"], x["loss"]) for x in workers] == [(0, 12, 0.5)]
    assert (nodes["b"]["step"], nodes["b"]["heartbeat_age_s"]) == (10, 1.75)
    # during a drain, and for a node known only from a notice
    c.request_drain(leavers=["b"])
    c.notice("z", {"id": "n"})
    st = c.status()
    assert st["drain"] == {"gen": 1, "reason": "rebalance", "members": ["a", "b"],
                           "leavers": ["b"], "joiners": []}  # fmt: skip
    z = st["nodes"]["z"]
    assert (z["heartbeat_age_s"], z["step"], z["world_size"], z["workers"]) == (
        None,
        None,
        None,
        [],
    )
    # nothing training: world 0, no loss
    idle = Coordinator(Clock())
    hb(idle, "a", "waiting")
    st = idle.status()
    assert (st["world_size"], st["loss"], st["throughput"], st["incarnation"]) == (
        0,
        None,
        None,
        None,
    )


def test_a_drain_whose_leaver_never_leaves_is_released_as_timed_out() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    t0 = clk.t
    hb(c, "b", workers=[w(1, "inc1", 11, ws=2)], notice={"id": "x", "deadline": t0 + 600})
    for t in (0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 20.0):
        clk.t = t0 + t
        for i, n in enumerate(["a", "b"]):  # both drained; b never says it left
            hb(c, n, workers=[w(i, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
    assert drains(c)[1:] == [{"type": "drain-committed", "gen": 1, "step": 12},
                             {"type": "drain-release", "gen": 1, "why": "timed out"},
                             {"type": "drain-end", "gen": 1, "why": "timed out"}]  # fmt: skip


def join_committed() -> tuple[Clock, Coordinator, float]:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    hb(c, "n", "waiting")
    for i, n in enumerate(["a", "b"]):
        hb(c, n, workers=[w(i, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
    assert hb(c, "n", "waiting")["go"]
    return clk, c, clk.t


def test_a_join_that_never_reforms_is_released_after_its_go_timeout() -> None:
    clk, c, go = join_committed()
    for t in (5.0, 10.0, 15.0, 20.0, 25.0):  # at 25 s exactly: still waiting for the re-form
        clk.t = go + t
        for i, n in enumerate(["a", "b"]):
            hb(c, n, workers=[w(i, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
        hb(c, "n", "waiting")
    assert c.drain is not None
    clk.t = go + 25.5
    hb(c, "a", workers=[w(0, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
    assert drains(c)[-2:] == [{"type": "drain-release", "gen": 1, "why": "join timed out"},
                              {"type": "drain-end", "gen": 1, "why": "join timed out"}]  # fmt: skip
    assert c.nodes["n"].go_at == go  # its go stays the one it was given


def test_a_join_whose_group_never_drains_lets_the_joiner_go_at_the_deadline() -> None:
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    t0 = clk.t
    hb(c, "n", "waiting")
    for t in (3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 20.0):
        clk.t = t0 + t
        for i, n in enumerate(["a", "b"]):
            hb(c, n, workers=[w(i, "inc1", 12, ws=2)], drain_gen=1)  # never drained
        hb(c, "n", "waiting")
    assert drains(c)[1:] == [{"type": "drain-release", "gen": 1, "why": "join timed out"},
                             {"type": "drain-end", "gen": 1, "why": "join timed out"}]  # fmt: skip
    assert c.nodes["n"].go_at == t0 + 20.0


def test_a_death_turns_an_uncommitted_notice_drain_into_a_failure_only() -> None:
    from spotctl.head.coordinator import Cause

    def dying(cause: Cause, drained: bool) -> Coordinator:
        clk, c = training(["a", "b", "c"], "inc1", 10, dead_after_s=4.0)
        if cause.reason == "notice":
            hb(c, "b", workers=[w(1, "inc1", 11)], notice={"id": "x", "deadline": clk.t + 120})
        else:
            hb(c, "n", "waiting")  # a join drain
        c.cause = cause
        if drained:
            for i, n in enumerate(["a", "b", "c"]):
                hb(c, n, workers=[w(i, "inc1", 12, "drained", drain_step=12)], drain_gen=1)
        clk.t += 3
        hb(c, "a", workers=[w(0, "inc1", 12, "drained" if drained else "train",
                              drain_step=12 if drained else None)], drain_gen=1)  # fmt: skip
        hb(c, "b", workers=[w(1, "inc1", 12)], drain_gen=1)
        if cause.reason == "join":
            hb(c, "n", "waiting")
        clk.t += 2  # c silent for 5 s
        hb(c, "a", workers=[w(0, "inc1", 12)], drain_gen=1)
        return c

    c = dying(Cause("notice", 1000.0), drained=False)
    assert c.cause is not None and (c.cause.reason, c.cause.at) == ("failure", 1000.0)
    c = dying(Cause("notice", 1000.0), drained=True)  # committed: still the notice's
    assert c.cause is not None and c.cause.reason == "notice"
    c = dying(Cause("join", 1000.0), drained=False)
    assert c.cause is not None and c.cause.reason == "join"


def test_a_finished_or_failed_node_leaves_its_replica_group() -> None:
    from tests.unit.test_replica_groups import beat, started

    for state in ("finished", "failed", "left"):
        clk = Clock()
        c, _ = started(clk, ["n1", "n2"])
        assert c.status()["nodes"]["n2"]["group"] == "g0"
        beat(c, "n2", state)
        c.tick()
        assert c.status()["nodes"]["n2"]["group"] is None, state
        assert c.status()["nodes"]["n1"]["group"] == "g0"
