"""The head's drain state machine, driven by scripted heartbeats and a fake clock."""

from __future__ import annotations

from spotctl.head.coordinator import Coordinator


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def w(rank, inc, step, phase="train", ws=3, resume=0, first=None, drain_step=None, **extra):
    return {"rank": rank, "local_rank": 0, "world_size": ws, "step": step, "phase": phase,
            "incarnation": inc, "resume_step": resume, "first_step_at": first,
            "last_ckpt": 0, "drain_step": drain_step, "pid": 1, **extra}


def hb(c, node, state="running", workers=(), drain_gen=0, notice=None):
    return c.heartbeat({"node_id": node, "agent_state": state, "workers": list(workers),
                        "drain_gen": drain_gen, "notice": notice})


def training(nodes, inc, step, **kw):
    """A coordinator (fake clock) whose `nodes` started together and train `inc` at
    `step`, one rank each."""
    clk = Clock()
    c = Coordinator(clk, **kw)
    for n in nodes:
        assert hb(c, n, "waiting")["go"]  # nothing to protect yet: all start at once
    for i, n in enumerate(nodes):
        hb(c, n, workers=[w(i, inc, step, ws=len(nodes), first=999.0)])
    return clk, c


def test_notice_drain_leave_release_and_rescale_event():
    clk = Clock()
    c = Coordinator(clk)
    for n in ["a", "b", "c"]:
        assert hb(c, n, "waiting")["go"]  # nothing to protect: start at once
    for i, n in enumerate(["a", "b", "c"]):
        hb(c, n, workers=[w(i, "inc1", 50, first=999.0)])
    assert c.status()["world_size"] == 3
    clk.t += 1
    r = hb(c, "b", workers=[w(1, "inc1", 51)], notice={"id": "x", "deadline": clk.t + 120})
    # (nodes: the next round's size, a, c)
    assert r["drain"] == {"gen": 1, "leave": True, "reason": "notice", "nodes": 2}
    assert not r["leave"]
    assert hb(c, "a", workers=[w(0, "inc1", 51)])["drain"]["leave"] is False
    # everyone drains at step 52; b may leave once its own workers are drained
    for i, n in enumerate(["a", "b", "c"]):
        r = hb(c, n, workers=[w(i, "inc1", 52, phase="drained", drain_step=52)], drain_gen=1)
    assert hb(c, "b", workers=[w(1, "inc1", 52, "drained", drain_step=52)], drain_gen=1)["leave"]
    assert c.release_gen == 0  # survivors wait until the leaver is gone
    r = hb(c, "b", state="left", drain_gen=1)
    assert c.release_gen == 1
    assert hb(c, "a", workers=[w(0, "inc1", 52, "drained", drain_step=52)])["release_gen"] == 1
    # the survivors re-form at world 2 from step 52
    clk.t += 8
    hb(c, "a", workers=[w(0, "inc2", 53, ws=2, resume=52, first=clk.t)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["from_world_size"], ev["to_world_size"], ev["reason"]) == (3, 2, "notice")
    assert ev["lost_steps"] == 0 and ev["checkpoint_step"] == 52
    assert 8.0 <= ev["notice_to_resume_s"] <= 9.0


def test_join_waits_for_drain_then_goes():
    clk, c = training(["a", "b"], "inc1", 10)
    r = hb(c, "new", "waiting")
    assert not r["go"] and c.drain is not None and c.drain.reason == "join"
    for i, n in enumerate(["a", "b"]):
        d = hb(c, n, workers=[w(i, "inc1", 11, ws=2)])["drain"]
        assert d["leave"] is False and d["nodes"] == 3  # the next round: a, b and new
    assert not hb(c, "new", "waiting")["go"]  # not before the group committed
    for i, n in enumerate(["a", "b"]):
        hb(c, n, workers=[w(i, "inc1", 12, "drained", ws=2, drain_step=12)], drain_gen=1)
    assert hb(c, "new", "waiting")["go"]
    clk.t += 10
    hb(c, "a", workers=[w(0, "inc2", 13, ws=3, resume=12, first=clk.t)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["from_world_size"], ev["to_world_size"], ev["reason"], ev["lost_steps"]) == (
        2, 3, "join", 0)
    assert c.drain is None


def test_silent_node_kills_peers_workers_once_and_failure_is_recorded():
    clk, c = training(["a", "b"], "inc1", 30, dead_after_s=4.0)
    clk.t += 2
    hb(c, "a", workers=[w(0, "inc1", 35, ws=2)])
    assert c.kill_gen == 0  # 2 s of silence is not death
    clk.t += 3
    r = hb(c, "a", workers=[w(0, "inc1", 37, ws=2)])
    assert r["kill_gen"] == 1 and r["kill_incarnation"] == "inc1"
    clk.t += 1
    hb(c, "a", workers=[w(0, "inc2", 31, ws=1, resume=30, first=clk.t)])
    assert c.kill_gen == 1  # not repeated
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert ev["reason"] == "failure" and ev["lost_steps"] == 7


def test_start_waits_until_every_node_is_at_the_gate():
    clk = Clock()
    c = Coordinator(clk)
    assert not c.heartbeat({"node_id": "b", "agent_state": "waiting", "ready": False})["go"]
    assert not c.heartbeat({"node_id": "a", "agent_state": "waiting", "ready": True})["go"]
    clk.t += 3
    r = c.heartbeat({"node_id": "b", "agent_state": "waiting", "ready": True})
    assert r["go"] and c.nodes["a"].go_at == c.nodes["b"].go_at  # one round, together
    # a node that never gets ready does not hold the others past the grace period
    c2 = Coordinator(clk)
    c2.heartbeat({"node_id": "slow", "agent_state": "waiting", "ready": False})
    c2.heartbeat({"node_id": "a", "agent_state": "waiting", "ready": True})
    for _ in range(11):  # both keep reporting; "slow" never gets to its gate
        assert not c2.nodes["a"].go_at
        clk.t += 3
        c2.heartbeat({"node_id": "slow", "agent_state": "waiting", "ready": False})
        r = c2.heartbeat({"node_id": "a", "agent_state": "waiting", "ready": True})
    assert r["go"]
    assert not c2.nodes["slow"].go_at


def test_notice_drain_broken_by_a_death_ends_when_the_survivors_reform():
    # fault scenario 4: b has a notice, c dies mid-drain. a re-forms alone (b's torchrun
    # refuses a new round); the drain must end then, not hold joins until its timeout.
    clk, c = training(["a", "b", "c"], "inc1", 40, dead_after_s=4.0)
    clk.t += 1
    hb(c, "b", workers=[w(1, "inc1", 41)], notice={"id": "x", "deadline": clk.t + 30})
    assert c.drain is not None and c.drain.leavers == ["b"]
    clk.t += 3
    hb(c, "b", workers=[w(1, "inc1", 41)], drain_gen=1)
    clk.t += 2  # c silent for 5 s: dead; b's torchrun exits and b leaves
    assert hb(c, "a", workers=[])["kill_gen"] == 1
    hb(c, "b", state="left", drain_gen=1)
    assert c.drain is not None  # a has not re-formed yet
    clk.t += 2
    hb(c, "a", workers=[w(0, "inc2", 21, ws=1, resume=20, first=clk.t)])
    assert c.drain is None and c.release_gen == 1
    ends = [e for e in c.events if e["type"] == "drain-end"]
    assert ends[-1]["why"] == "group re-formed"
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["from_world_size"], ev["to_world_size"], ev["lost_steps"]) == (3, 1, 21)
    assert ev["reason"] == "failure"  # the death, not the notice, cost the 21 steps
    # nothing else happens to the re-formed group: no second restart
    clk.t += 30
    r = hb(c, "a", workers=[w(0, "inc2", 40, ws=1, resume=20)])
    assert c.drain is None and r["release_gen"] == 1 and r["kill_gen"] == 1
    assert len([e for e in c.events if e["type"] == "rescale"]) == 1


def test_notice_for_a_node_in_a_forming_group_waits_until_it_trains_then_drains():
    # b's torchrun entered a new round before its notice came: pulling it out would fail
    # the round for everyone; drain it once the group trains instead
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    forming = [w(1, "inc2", 10, phase="init", ws=2)]
    r = hb(c, "b", workers=forming, notice={"id": "x", "deadline": clk.t + 30})
    assert not r["leave"] and c.drain is None
    hb(c, "a", workers=[w(0, "inc2", 10, phase="init", ws=2)])
    clk.t += 2
    hb(c, "a", workers=[w(0, "inc2", 11, ws=2, resume=10, first=clk.t)])
    r = hb(c, "b", workers=[w(1, "inc2", 11, ws=2, resume=10, first=clk.t)])
    assert c.drain is not None and c.drain.reason == "notice" and c.drain.leavers == ["b"]
    assert r["drain"]["leave"] and not r["leave"]  # drain first, then leave


def test_notice_close_to_its_deadline_leaves_a_forming_group_at_once():
    clk, c = training(["a", "b"], "inc1", 10)
    r = hb(c, "b", workers=[w(1, "inc2", 10, phase="init", ws=2)],
           notice={"id": "x", "deadline": clk.t + 5})
    assert r["leave"] and c.drain is None


def test_torchft_notice_join_and_kill_need_no_group_drain():
    # torchft's replicas regroup by themselves: the head drains nobody, gates no joiner,
    # kills no peer's workers, and records each new quorum as a rescale naming the engine
    clk, c = training(["a", "b", "c"], "ft-q1", 10, dead_after_s=4.0, engine="torchft")
    clk.t += 1
    r = hb(c, "c", workers=[w(2, "ft-q1", 11)], notice={"id": "x", "deadline": clk.t + 120})
    assert r["drain"] is None and c.drain is None
    assert [e["type"] for e in c.events].count("notice") == 1
    hb(c, "c", state="left")
    clk.t += 0.5  # the survivors' next quorum, from memory: nothing lost
    hb(c, "a", workers=[w(0, "ft-q2", 12, ws=2, resume=12, first=clk.t)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["to_world_size"], ev["lost_steps"], ev["engine"]) == (
        "notice", 2, 0, "torchft")
    # a joiner is not held at a gate, and no join drain starts
    assert hb(c, "d", "waiting")["go"] and c.drain is None
    # rebalance moving a node: no drain; the node is told to leave, as on a notice
    assert c.request_drain("rebalance", ["zz"]) == 0  # unknown node
    gen = c.request_drain("rebalance", ["d"])
    assert gen > 0 and c.drain is None
    assert hb(c, "d", "running")["leave"] and not hb(c, "a", workers=[w(0, "ft-q2", 13, ws=2)])[
        "leave"]
    assert not hb(c, "d", "left")["leave"]
    # b goes silent: its quorum already dropped it; nobody's workers are killed
    hb(c, "a", workers=[w(0, "ft-q2", 14, ws=2)])
    clk.t += 5
    r = hb(c, "a", workers=[w(0, "ft-q3", 15, ws=1, resume=15, first=clk.t)])
    assert r["kill_gen"] == 0
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["to_world_size"]) == ("failure", 1)
    hb(c, "a", workers=[w(0, "ft-q4", 16, ws=2, resume=16, first=clk.t + 1)])
    assert [e for e in c.events if e["type"] == "rescale"][-1]["reason"] == "join"
    # those two causes were inferred from the membership, not seen: no duration is made up
    # from them, and the quorum's first replica, training all along, was spawned for
    # neither (its start-up is from long before: not reported as this rescale's)
    for ev in [e for e in c.events if e["type"] == "rescale"][-2:]:
        assert ev["notice_to_resume_s"] is None and ev["worker_spawned_after_s"] is None, ev
        assert ev["worker_start"] is None, ev


def test_torchft_quorum_that_grows_while_a_notice_is_pending_is_not_the_notices():
    # a replica late to a quorum was left out (3 -> 2, inferred a failure) and heals back
    # in (2 -> 3) just after c's notice reached the head: that growth is a join, and the
    # notice stays pending for the quorum c leaves (3 -> 2). The CI of the last stop saw the
    # notice's reason on the 2 -> 3 healing.
    clk, c = training(["a", "b", "c"], "ft-q1", 10, engine="torchft")
    clk.t += 0.5
    hb(c, "a", workers=[w(0, "ft-q2", 11, ws=2, resume=11, first=clk.t)])
    clk.t += 0.5
    hb(c, "c", workers=[w(2, "ft-q2", 12, ws=2)], notice={"id": "x", "deadline": clk.t + 120})
    clk.t += 0.1
    hb(c, "a", workers=[w(0, "ft-q3", 12, ws=3, resume=12, first=clk.t)])
    hb(c, "c", state="left")
    clk.t += 0.3
    hb(c, "a", workers=[w(0, "ft-q4", 13, ws=2, resume=13, first=clk.t)])
    got = [(e["from_world_size"], e["to_world_size"], e["reason"])
           for e in c.events if e["type"] == "rescale"]
    assert got == [(3, 2, "failure"), (2, 3, "join"), (3, 2, "notice")], got
    notice = [e for e in c.events if e["type"] == "rescale"][-1]
    assert notice["notice_to_resume_s"] == 0.4 and notice["lost_steps"] == 0, notice


def test_torchft_group_training_before_a_restarted_head_is_adopted_at_its_step():
    # the head restarts while torchft's replicas go on from memory: the new head first sees
    # a quorum formed at step 5 that has trained to step 40 -- taken up at 40, not
    # journaled as training started at step 5
    clk = Clock()
    c = Coordinator(clk, engine="torchft")
    hb(c, "a", workers=[w(0, "ft-q1", 40, ws=2, resume=5, first=clk.t - 30)])
    hb(c, "b", workers=[w(1, "ft-q1", 40, ws=2, resume=5, first=clk.t - 30)])
    start = [e for e in c.events if e["type"] == "train-start"]
    assert len(start) == 1 and start[0]["resume_step"] == 40 and start[0]["adopted"], start
    # a group whose first step comes after the head started is a real start
    c2 = Coordinator(clk)
    hb(c2, "a", workers=[w(0, "inc1", 0, ws=1, first=clk.t + 1)])
    start = [e for e in c2.events if e["type"] == "train-start"]
    assert start[0]["resume_step"] == 0 and "adopted" not in start[0], start


def test_rescale_events_name_the_torchrun_engine_and_bad_engine_is_refused():
    import pytest

    clk = Clock()
    c = Coordinator(clk)
    hb(c, "a", "waiting")
    hb(c, "a", workers=[w(0, "inc1", 5, ws=1, first=999.0)])
    hb(c, "b", "waiting")
    hb(c, "a", workers=[w(0, "inc1", 6, ws=1, phase="drained", drain_step=6)], drain_gen=1)
    hb(c, "a", workers=[w(0, "inc2", 7, ws=2, resume=6, first=clk.t)])
    assert [e for e in c.events if e["type"] == "rescale"][-1]["engine"] == "torchrun"
    with pytest.raises(ValueError, match="engine must be one of"):
        Coordinator(clk, engine="horovod")


def test_steps_lost_at_a_restore_are_not_counted_again_at_the_next_rescale():
    # a failure restores step 20 of a group that had reached 37; the next failure comes at
    # step 25: it loses 25 - 20 = 5 steps, not 37 - 20 again
    clk, c = training(["a", "b", "c"], "inc1", 37, dead_after_s=4.0)
    clk.t += 5
    hb(c, "a", workers=[w(0, "inc1", 37)])
    hb(c, "b", workers=[w(1, "inc1", 37)])  # c silent: dead
    hb(c, "a", workers=[w(0, "inc2", 20, ws=2, resume=20, first=clk.t)])
    hb(c, "a", workers=[w(0, "inc2", 25, ws=2, resume=20)])
    clk.t += 5  # b silent: dead
    hb(c, "a", workers=[w(0, "inc3", 20, ws=1, resume=20, first=clk.t)])
    lost = [e["lost_steps"] for e in c.events if e["type"] == "rescale"]
    assert lost == [17, 5], lost
    assert c.status()["step"] == 20


def test_torchft_regroups_of_the_same_replicas_are_no_rescales_and_no_pause_is_negative():
    # the demo's sequence: two replicas train; torchft hands them new quorums of the same
    # two (a replica late to one, healed back in the same round; a failed commit vote),
    # each seen by the head after its first step. The journal said "world 2 -> 2, restart"
    # ~100 times with negative pauses and "lost 2 steps" inferred from an old report
    clk, c = training(["a", "b"], "ft-q1", 10, engine="torchft")
    step = 10
    for i in range(2, 102):
        clk.t += 0.3
        step += 2
        # b still reports the old quorum two steps ahead of the new one's resume step
        hb(c, "b", workers=[w(1, f"ft-q{i - 1}", step + 2, ws=2, failed_steps=0)])
        hb(c, "a", workers=[w(0, f"ft-q{i}", step + 1, ws=2, resume=step, first=clk.t - 0.2,
                              failed_steps=0)])
    assert not [e for e in c.events if e["type"] == "rescale"]
    regroups = [e for e in c.events if e["type"] == "regroup"]
    assert len(regroups) == 100 and all(
        (e["world_size"], e["reason"], e["lost_steps"]) == (2, "same-members", 0)
        for e in regroups), regroups[:2]
    assert all((e.get("notice_to_resume_s") or 0) >= 0 for e in c.events)


def test_torchft_lost_steps_are_the_replicas_own_failed_steps_and_every_rescale_has_a_cause():
    clk, c = training(["a", "b", "c"], "ft-q1", 10, dead_after_s=4.0, engine="torchft")
    # c is killed mid-step: the survivors' step in flight fails (each counts it), is run
    # again in the next quorum, 3 -> 2; the head saw no cause: inferred, no pause made up
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q1", 11, failed_steps=1)])
    hb(c, "a", workers=[w(0, "ft-q2", 12, ws=2, resume=11, first=clk.t, failed_steps=1)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["from_world_size"], ev["to_world_size"], ev["reason"], ev["lost_steps"],
            ev["cause_seen"], ev["notice_to_resume_s"]) == (3, 2, "failure", 1, False, None), ev
    # a failed commit vote with the same two replicas: a regroup that lost 1 step, and the
    # step already charged to the kill is not charged again
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q2", 20, ws=2, failed_steps=2)])
    hb(c, "a", workers=[w(0, "ft-q3", 21, ws=2, resume=20, first=clk.t, failed_steps=2)])
    ev = c.events[-1]
    assert (ev["type"], ev["reason"], ev["lost_steps"]) == ("regroup", "redo", 1), ev
    # a notice: its node commits and leaves; the survivor's quorum shrinks 2 -> 1, the
    # pause measured from the notice the head saw, nothing lost
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q3", 22, ws=2, failed_steps=2)],
       notice={"id": "n", "deadline": clk.t + 120})
    hb(c, "b", state="left")
    clk.t += 0.3
    hb(c, "a", workers=[w(0, "ft-q4", 23, ws=1, resume=23, first=clk.t, failed_steps=2)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["lost_steps"], ev["cause_seen"], ev["notice_to_resume_s"]) == (
        "notice", 0, True, 0.3), ev
    assert all(e.get("reason") for e in c.events if e["type"] in ("rescale", "regroup"))


def test_a_pause_that_cannot_be_measured_is_null_never_negative():
    # the notice reached the head after the survivors' first step in the smaller quorum
    # (its report came late, or the clocks of node and head differ): no negative pause
    clk, c = training(["a", "b", "c"], "ft-q1", 10, engine="torchft")
    clk.t += 1
    hb(c, "c", workers=[w(2, "ft-q1", 11)], notice={"id": "x", "deadline": clk.t + 120})
    hb(c, "a", workers=[w(0, "ft-q2", 12, ws=2, resume=12, first=clk.t - 0.5)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["notice_to_resume_s"]) == ("notice", None), ev
    # torchrun: a group that restarted with no cause the head saw ("restart") has no pause
    # either (when it began is unknown), not its first step minus when the head saw it
    clk, c = training(["a", "b"], "inc1", 10)
    clk.t += 1
    hb(c, "a", workers=[w(0, "inc2", 10, ws=2, resume=10, first=clk.t - 0.4)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["notice_to_resume_s"], ev["cause_seen"]) == (
        "restart", None, False), ev


def test_torchft_lost_steps_without_the_replicas_counts_are_unknown_or_the_resume_gap():
    # a head whose reports carry no failed-step counts: a regroup's loss is unknown (null),
    # a rescale falls back to the steps past the one the new quorum resumed at
    clk, c = training(["a", "b"], "ft-q1", 10, engine="torchft")
    clk.t += 1
    hb(c, "a", workers=[w(0, "ft-q2", 12, ws=2, resume=11, first=clk.t)])
    assert (c.events[-1]["type"], c.events[-1]["lost_steps"]) == ("regroup", None)
    clk.t += 1
    hb(c, "a", workers=[w(0, "ft-q2", 14, ws=2)])
    hb(c, "a", workers=[w(0, "ft-q3", 14, ws=1, resume=13, first=clk.t)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["lost_steps"]) == ("failure", 1), ev


def test_torchft_join_pause_is_timed_by_the_survivors():
    """A join on torchft is inferred (the replicas regroup before the head learns why), so
    the head times no pause for it; the survivors time their own (the gap between their
    last commit in the old quorum and their first in the new, less their usual step): the
    rescale carries it when a survivor reported it already, else a `pause` event does once
    one reports it, and `report` counts it as measured (issue 58: "1 not measured")."""
    from spotctl.control.report import rescale_pauses

    clk, c = training(["a", "b"], "ft-q1", 10, engine="torchft")
    clk.t += 5
    # the joiner is the new quorum's rank 0 and has no earlier quorum: nothing to time
    hb(c, "new", workers=[w(0, "ft-q2", 11, ws=3, resume=11, first=clk.t)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert (ev["reason"], ev["cause_seen"]) == ("join", False)
    assert ev["notice_to_resume_s"] is None and ev["replica_pause_s"] is None
    assert rescale_pauses(c.events)[c.events.index(ev)] is None
    hb(c, "a", workers=[w(1, "ft-q2", 11, ws=3, regroup_pause_s=0.42)])
    hb(c, "b", workers=[w(2, "ft-q2", 11, ws=3, regroup_pause_s=0.44)])
    pauses = [e for e in c.events if e["type"] == "pause"]
    assert len(pauses) == 1, pauses  # the first survivor's, once
    assert pauses[0]["incarnation"] == "ft-q2" and pauses[0]["pause_s"] == 0.42
    assert rescale_pauses(c.events)[c.events.index(ev)] == 0.42
    # a rescale whose survivor reported with its first step carries the pause itself
    clk.t += 5
    hb(c, "a", workers=[w(0, "ft-q3", 12, ws=2, resume=12, first=clk.t, regroup_pause_s=0.3)])
    ev = [e for e in c.events if e["type"] == "rescale"][-1]
    assert ev["to_world_size"] == 2 and ev["replica_pause_s"] == 0.3
    assert rescale_pauses(c.events)[c.events.index(ev)] == 0.3


def test_a_failed_diloco_sync_is_a_head_event_once_per_group_and_sync():
    """diloco/localsgd: a sync nobody applied (a group gone mid-round) makes every group
    drop its round's local steps (elastic.ft: failed_syncs, dropped_steps in the worker's
    report). The head journals each group's new failed sync once, with the steps it
    dropped and the step it went back to; the same count reported again is no new event.
    The heartbeat's validation keeps the counts and refuses a bad one in one line."""
    import pytest

    from spotctl.head import validate

    clk, c = training(["a", "b"], "ft-q1", 8, engine="torchft")
    body = {"node_id": "a", "agent_state": "running", "workers": [
        w(0, "ft-q1", 8, ws=2, sync="diloco", failed_syncs=1, dropped_steps=3)]}
    kept = validate.heartbeat(body)["workers"][0]
    assert (kept["failed_syncs"], kept["dropped_steps"]) == (1, 3)
    with pytest.raises(validate.BadInput, match="failed_syncs") as e:
        validate.heartbeat({**body, "workers": [w(0, "ft-q1", 8, failed_syncs=-1)]})
    assert "\n" not in str(e.value)
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q1", 9, ws=2, failed_syncs=0, dropped_steps=0)])
    assert not [e for e in c.events if e["type"] == "sync_failed"]
    for _ in range(2):  # reported again: still one event
        c.heartbeat({**body, "drain_gen": 0, "notice": None})
        hb(c, "b", workers=[w(1, "ft-q1", 8, ws=2, failed_syncs=1, dropped_steps=3)])
    evs = [e for e in c.events if e["type"] == "sync_failed"]
    assert [(e["node"], e["failed_syncs"], e["dropped_steps"], e["step"]) for e in evs] == [
        ("a", 1, 3, 8), ("b", 1, 3, 8)]
    # a second failed sync of group a, later: one more event, its own dropped steps
    hb(c, "a", workers=[w(0, "ft-q1", 12, ws=2, failed_syncs=2, dropped_steps=5)])
    ev = [e for e in c.events if e["type"] == "sync_failed"][-1]
    assert (ev["node"], ev["failed_syncs"], ev["dropped_steps"], ev["step"]) == ("a", 1, 2, 12)


def test_a_notice_that_drops_a_diloco_round_is_a_head_event_once():
    """diloco/localsgd, [train] on_notice: a group that left on a notice mid-round reports
    the local steps it dropped (elastic.ft: notice_dropped, drain_step = the synced step it
    left at); the head journals it once as a `notice_drop` event, however often the last
    report comes; a leave at a sync (0 dropped) is no such event."""
    from spotctl.head import validate

    clk, c = training(["a", "b"], "ft-q1", 8, engine="torchft")
    left = w(0, "ft-q1", 10, ws=2, sync="diloco", phase="drained", drain_step=8,
             notice_dropped=2)
    body = {"node_id": "a", "agent_state": "leaving", "workers": [left]}
    assert validate.heartbeat(body)["workers"][0]["notice_dropped"] == 2
    clk.t += 1
    hb(c, "b", workers=[w(1, "ft-q1", 9, ws=2, phase="drained", drain_step=8,
                          notice_dropped=0)])
    assert not [e for e in c.events if e["type"] == "notice_drop"]
    for _ in range(2):
        c.heartbeat({**body, "drain_gen": 0, "notice": None})
    evs = [e for e in c.events if e["type"] == "notice_drop"]
    assert [(e["node"], e["dropped_steps"], e["step"]) for e in evs] == [("a", 2, 8)]
