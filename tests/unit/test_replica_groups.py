"""torchft replica groups spanning nodes ([train] nodes_per_replica > 1): the head places
nodes in group slots, moves a group to a new generation when its membership changes, and
rebuilds its groups from the nodes' reports after a restart. Driven by scripted
heartbeats and a fake clock, as test_coordinator."""

from __future__ import annotations

from spotctl.head import validate
from spotctl.head.coordinator import Coordinator
from tests.unit.test_coordinator import Clock


def beat(c, node, state="waiting", port=None, group=None, notice=None, size=2):
    g = {"size": size, "port": port or 20000 + int(node[1:])}
    if group is not None:  # what the node's torchrun runs in (as its agent reports it)
        g.update((k, v) for k, v in group.items() if k in ("id", "gen", "slot", "broken"))
    body = validate.heartbeat({"node_id": node, "agent_state": state, "addr": f"10.0.0.{node[1:]}",
                               "workers": [], "group": g, "notice": notice})
    return c.heartbeat(body)["group"]


def started(clk, nodes):
    """A head past its settling time, with `nodes` registered (waiting)."""
    c = Coordinator(clk, engine="torchft", dead_after_s=4.0)
    clk.t += 5
    return c, {n: beat(c, n) for n in nodes}


def running_pair(clk):
    """A head whose nodes n1 and n2 run as one group: (coordinator, {id, gen})."""
    c, _ = started(clk, ["n1", "n2"])
    g = beat(c, "n1")
    run = {"id": g["id"], "gen": g["gen"]}
    for i, n in enumerate(["n1", "n2"]):
        beat(c, n, "running", group={**run, "slot": i})
    return c, run


def test_nodes_fill_groups_in_order_and_a_full_group_names_its_store():
    clk = Clock()
    c, got = started(clk, ["n1"])
    g = got["n1"]
    assert g["id"] == "g0" and g["slot"] == 0 and g["master"] is None  # not full: wait
    g1, g2 = beat(c, "n2"), beat(c, "n1")
    assert (g1["id"], g1["slot"], g1["gen"]) == ("g0", 1, g2["gen"])
    # full: everyone is told the first slot's address and group port
    assert g1["master"] == g2["master"] == ["10.0.0.1", 20001]
    assert g1["nodes"] == ["n1", "n2"]
    beat(c, "n3")
    g4, g3 = beat(c, "n4"), beat(c, "n3")
    assert g3["id"] == g4["id"] == "g1" and g3["master"] == ["10.0.0.3", 20003]
    assert [e["group"] for e in c.events if e["type"] == "replica-group"] == ["g0", "g0", "g1", "g1"]


def test_a_noticed_node_keeps_its_slot_until_it_left_then_a_newcomer_takes_it():
    clk = Clock()
    c, run = running_pair(clk)
    # n1's notice: the group leaves the quorum together after its step; n1 keeps its slot
    # (the generation does not move) until it has left
    assert beat(c, "n1", "leaving", group={**run, "slot": 0},
                notice={"id": "x", "deadline": clk.t + 120})["gen"] == run["gen"]
    assert beat(c, "n2", "waiting")["gen"] == run["gen"]
    g = beat(c, "n1", "left")
    assert g is None
    g = beat(c, "n2", "waiting")
    assert g["gen"] > run["gen"] and g["nodes"] == ["n2"] and g["master"] is None
    # the replacement takes the open slot (slot 0: the group's store moves to it)
    g5 = beat(c, "n5")
    assert g5["id"] == "g0" and g5["slot"] == 0 and g5["master"] == ["10.0.0.5", 20005]
    assert beat(c, "n2")["gen"] == g5["gen"]
    # a noticed node that is still waiting is never placed
    beat(c, "n6", notice={"id": "y", "deadline": clk.t + 30})
    assert beat(c, "n6", notice={"id": "y", "deadline": clk.t + 30}) is None


def test_a_vanished_member_moves_its_group_on_and_half_groups_are_merged():
    clk = Clock()
    c, _ = started(clk, ["n1", "n2", "n3", "n4"])
    gens = {}
    for n in ["n1", "n2", "n3", "n4"]:
        g = beat(c, n)
        gens[n] = g
        beat(c, n, "running", group=g)
    # n1 and n3 go silent: both groups move to a new generation; the running survivors
    # stop (their agents see the generation change) and report waiting
    clk.t += 5
    for n in ["n2", "n4"]:
        beat(c, n, "running", group=gens[n])
    clk.t += 0.1
    beat(c, "n2", "running", group=gens["n2"])
    g2 = beat(c, "n2", "waiting")
    # n4 still runs (its agent has not stopped yet): nothing is moved under it
    assert g2["gen"] > gens["n2"]["gen"] and g2["master"] is None
    g4 = beat(c, "n4", "waiting")
    # both wait now: n4 joins n2's group, which is full again; n4's old group is gone
    g2 = beat(c, "n2", "waiting")
    assert g4["id"] == g2["id"] == "g0" and g2["master"] is not None, (g2, g4)
    assert set(c.replica_groups.groups) == {"g0"}


def test_a_restarted_head_adopts_the_running_groups_from_their_nodes():
    clk = Clock()
    c = Coordinator(clk, engine="torchft", dead_after_s=4.0)
    # the nodes report what they run: the head takes it as it is, nothing moves
    for n, slot in [("n3", 1), ("n1", 0)]:
        g = beat(c, n, "running", group={"id": "g4", "gen": 7, "slot": slot})
        assert (g["id"], g["gen"], g["slot"]) == ("g4", 7, slot)
    assert beat(c, "n9") is None  # a newcomer during the settling time waits
    clk.t += 3
    for n, slot in [("n3", 1), ("n1", 0)]:
        beat(c, n, "running", group={"id": "g4", "gen": 7, "slot": slot})
    clk.t += 2
    g = beat(c, "n9")
    assert g["id"] != "g4" and g["master"] is None
    g = beat(c, "n1", "running", group={"id": "g4", "gen": 7, "slot": 0})
    assert g["gen"] == 7 and g["nodes"] == ["n1", "n3"]


def test_bad_group_reports_are_refused():
    import pytest

    for bad in [{"size": 2}, {"size": 0, "port": 1}, {"size": 2, "port": 70000},
                {"size": 2, "port": 1, "id": "x1", "gen": 1, "slot": 0},
                {"size": 2, "port": 1, "id": "g1", "gen": 1, "slot": 2},
                {"size": 2, "port": 1, "extra": 1}, "g0"]:
        with pytest.raises(validate.BadInput):
            validate.heartbeat({"node_id": "n1", "group": bad})


def test_a_member_whose_workers_failed_restarts_its_group_once():
    clk = Clock()
    c, run = running_pair(clk)
    # n2's torchrun failed: a new generation of the same nodes, full at once
    g = beat(c, "n2", "waiting", group={**run, "slot": 1, "broken": True})
    assert g["gen"] == run["gen"] + 1 and g["master"] is not None and g["slot"] == 1
    # n1's failed too (the same failure, seen a moment later): no second restart
    g = beat(c, "n1", "waiting", group={**run, "slot": 0, "broken": True})
    assert g["gen"] == run["gen"] + 1
    assert beat(c, "n2", "waiting")["nodes"] == ["n1", "n2"]
