"""Dense replica indexes on the torchft engine, one node per replica (the head's
spotctl.head.groups.ReplicaIndexes, through the coordinator's heartbeats): each replica
gets the lowest free index, keeps it while it lives, and a gone replica's index goes to
the next newcomer. The agent exports it as SPOTCTL_FT_REPLICA_INDEX, torchtitan's
`--fault_tolerance.replica_id` (spotctl.integrations.torchtitan), which is the replica's
torchft identity and data shard: two live replicas must never hold one. Driven by
scripted heartbeats and a fake clock, as test_replica_groups."""

from __future__ import annotations

import pytest

from spotctl.head import validate
from spotctl.head.coordinator import Coordinator
from tests.unit.test_coordinator import Clock


def beat(c: Coordinator, node: str, state: str = "waiting", index: int | None = None,
         notice: dict | None = None) -> int | None:
    """One heartbeat of `node` (its workers running with `index`, as its agent reports
    it); the index the head gives it."""
    body = {"node_id": node, "agent_state": state, "addr": "127.0.0.1", "workers": [],
            "notice": notice, "replica_index": index}
    reply = c.heartbeat(validate.heartbeat(body))
    assert "replica_index" in reply  # a torchft head always says (None: not yet)
    return reply["replica_index"]


def held(c: Coordinator) -> dict[str, int]:
    """The indexes of the nodes the head counts alive, from its status; never two on one."""
    st = c.status()["nodes"]
    out = {n: v["replica_index"] for n, v in st.items()
           if v["replica_index"] is not None and v["state"] not in ("left", "unresponsive")}
    assert len(set(out.values())) == len(out), out
    return out


def test_lowest_free_index_through_notice_leave_replacement_and_loss() -> None:
    clk = Clock()
    c = Coordinator(clk, engine="torchft", dead_after_s=4.0)
    clk.t += 5  # past the settling time of a head that just started
    assert [beat(c, n) for n in ("n1", "n2", "n3")] == [0, 1, 2]
    for n, i in (("n1", 0), ("n2", 1), ("n3", 2)):
        assert beat(c, n, "running", index=i) == i
    # n2's notice: its replica leaves the quorum after the step in flight and keeps its
    # index until it has left; a node joining meanwhile gets the next one, not n2's
    notice = {"id": "x", "deadline": clk.t + 120}
    assert beat(c, "n2", "leaving", index=1, notice=notice) == 1
    assert beat(c, "n4") == 3
    assert held(c) == {"n1": 0, "n2": 1, "n3": 2, "n4": 3}
    # n2 has left: index 1 is free again, and the replacement takes it (the lowest free)
    assert beat(c, "n2", "left", notice=notice) is None
    assert held(c) == {"n1": 0, "n3": 2, "n4": 3}
    assert beat(c, "n5") == 1
    # a hard loss: n1 falls silent past dead_after_s; its index goes to the next newcomer
    clk.t += 5
    for n, i in (("n3", 2), ("n4", 3), ("n5", 1)):
        assert beat(c, n, "running", index=i) == i
    assert "n1" not in held(c)
    assert beat(c, "n6") == 0
    # n1 comes back with its workers still on index 0, now n6's: it is not given 0 back
    # (its agent restarts its workers with the index it gets)
    assert beat(c, "n1", "running", index=0) == 4
    assert held(c) == {"n1": 4, "n3": 2, "n4": 3, "n5": 1, "n6": 0}
    assert beat(c, "n6", "running", index=0) == 0


def test_a_restarted_head_keeps_the_running_indexes_and_refuses_a_taken_one() -> None:
    clk = Clock()
    c = Coordinator(clk, engine="torchft", dead_after_s=4.0)
    # the nodes report the indexes their workers run with: the new head takes them as
    # they are, nothing is renumbered
    assert beat(c, "n7", "running", index=2) == 2
    assert beat(c, "n3", "running", index=0) == 0
    # a member claiming another's index (a bug, or a node's own processes forging its
    # report) does not get it; while the head settles nothing new is given out
    assert beat(c, "n8", "running", index=2) is None
    assert beat(c, "n9") is None
    clk.t += 3
    beat(c, "n7", "running", index=2)
    beat(c, "n3", "running", index=0)
    clk.t += 2
    assert beat(c, "n8", "running", index=2) == 1  # the lowest free, not n7's
    assert beat(c, "n9") == 3
    assert held(c) == {"n3": 0, "n8": 1, "n7": 2, "n9": 3}


def test_no_index_on_the_torchrun_engine_and_bad_ones_are_refused() -> None:
    c = Coordinator(Clock(), engine="torchrun")
    reply = c.heartbeat(validate.heartbeat({"node_id": "n1", "replica_index": 0}))
    assert "replica_index" not in reply and c.status()["nodes"]["n1"]["replica_index"] is None
    for bad in (-1, "0", 1.0, True, 10_001):
        with pytest.raises(validate.BadInput, match="replica_index must be an integer"):
            validate.heartbeat({"node_id": "n1", "replica_index": bad})


def test_groups_of_several_nodes_take_the_lowest_free_number_as_their_index() -> None:
    """nodes_per_replica > 1: a group's index is its id's number, the lowest free when the
    group was made; a gone group's number goes to the next new group."""
    from spotctl.head.groups import Member, ReplicaGroups

    rg = ReplicaGroups(2, lambda *a, **k: None)

    def members(*ids: str) -> dict[str, Member]:
        return {n: Member(n, "waiting", placeable=True, alive=True, registered_at=i)
                for i, n in enumerate(ids)}

    def index(nid: str) -> int:
        reply = rg.reply(nid, lambda n: ("10.0.0.1", 1))
        assert reply is not None
        return int(reply["index"])

    rg.update(members("a", "b", "c", "d", "e", "f"), settle=False)
    assert [index(n) for n in "abcdef"] == [0, 0, 1, 1, 2, 2]
    rg.update(members("a", "b", "e", "f"), settle=False)  # c and d are gone: group 1 too
    assert "g1" not in rg.groups
    rg.update(members("a", "b", "e", "f", "g", "h"), settle=False)
    assert [index(n) for n in "abefgh"] == [0, 0, 2, 2, 1, 1]
