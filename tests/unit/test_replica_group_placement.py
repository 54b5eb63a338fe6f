"""spotctl.head.groups.ReplicaGroups on its own: placement order, merging half groups,
adoption after a head restart, and the `replica-group` events each change journals. The
same through the coordinator's heartbeats: tests/unit/test_replica_groups.py."""

from __future__ import annotations

from typing import Any

from spotctl.head.groups import Member, ReplicaGroups


class Journal:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, type_: str, **data: Any) -> None:
        self.events.append({"type": type_, **data})

    def changes(self) -> list[tuple[str, int, str]]:
        return [(e["group"], e["gen"], e["change"]) for e in self.events]


def waiting(*ids: str, alive: bool = True) -> dict[str, Member]:
    return {n: Member(n, "waiting", placeable=alive, alive=alive, registered_at=i)
            for i, n in enumerate(ids)}  # fmt: skip


def slots(rg: ReplicaGroups) -> dict[str, list[str | None]]:
    return {gid: list(g.slots) for gid, g in rg.groups.items()}


def test_waiting_nodes_fill_groups_in_registration_order() -> None:
    j = Journal()
    rg = ReplicaGroups(2, j)
    ms = {
        "n9": Member("n9", "waiting", True, True, registered_at=1.0),
        "n1": Member("n1", "waiting", True, True, registered_at=3.0),
        "n5": Member("n5", "waiting", True, True, registered_at=2.0),
        "n0": Member("n0", "running", True, True, registered_at=0.0),  # not waiting
        "n2": Member("n2", "waiting", False, True, registered_at=0.5),
    }  # not placeable
    rg.update(ms, settle=False)
    assert slots(rg) == {"g0": ["n9", "n5"], "g1": ["n1", None]}
    assert j.changes() == [("g0", 2, "n9 in"), ("g0", 3, "n5 in"), ("g1", 2, "n1 in")]
    e = j.events[1]
    assert e == {"type": "replica-group", "group": "g0", "gen": 3, "nodes": ["n9", "n5"],
                 "full": True, "change": "n5 in"}  # fmt: skip
    assert j.events[2]["full"] is False and j.events[2]["nodes"] == ["n1"]
    # a tie in registration time goes by node id
    rg2 = ReplicaGroups(2, Journal())
    rg2.update({n: Member(n, "waiting", True, True, 1.0) for n in ("b", "a", "c")}, False)
    assert slots(rg2) == {"g0": ["a", "b"], "g1": ["c", None]}


def test_new_groups_take_the_lowest_free_number() -> None:
    rg = ReplicaGroups(1, Journal())
    rg.update(waiting("a", "b", "c", "d"), settle=False)
    assert slots(rg) == {"g0": ["a"], "g1": ["b"], "g2": ["c"], "g3": ["d"]}
    rg.update(waiting("a", "c", "d", "e"), settle=False)  # b gone: g1 is free again
    assert slots(rg) == {"g0": ["a"], "g1": ["e"], "g2": ["c"], "g3": ["d"]}


def test_gone_nodes_leave_their_slots_except_while_settling() -> None:
    j = Journal()
    rg = ReplicaGroups(2, j)
    rg.update(waiting("a", "b"), settle=False)
    rg.update({"a": Member("a", "running", True, True)}, settle=True)  # b unheard: kept
    assert slots(rg) == {"g0": ["a", "b"]}
    dead = {"a": Member("a", "running", True, True), "b": Member("b", "running", False, False)}
    rg.update(dead, settle=False)
    assert slots(rg) == {"g0": ["a", None]}
    assert j.changes()[-1] == ("g0", 4, "b out")
    rg.update({}, settle=False)  # a forgotten too: the empty group goes
    assert rg.groups == {} and j.changes()[-1] == ("g0", 5, "a out")
    # an open slot before a node that is gone
    rg.update(waiting("c", "d"), settle=False)
    rg.update({"d": Member("d", "running", True, True)}, settle=False)
    assert slots(rg) == {"g0": [None, "d"]}
    rg.update({}, settle=False)
    assert rg.groups == {}


def test_half_groups_merge_into_the_fullest_when_their_nodes_wait() -> None:
    j = Journal()
    rg = ReplicaGroups(2, j)
    rg.update(waiting("a", "b", "c", "d"), settle=False)
    assert slots(rg) == {"g0": ["a", "b"], "g1": ["c", "d"]}
    # a and c are gone; d still runs its (now broken) torchrun: it does not move yet
    ms = {"b": Member("b", "waiting", True, True, 1), "d": Member("d", "running", True, True, 3)}
    rg.update(ms, settle=False)
    assert slots(rg) == {"g0": [None, "b"], "g1": [None, "d"]}
    ms["d"].state = "waiting"
    n = len(j.events)
    rg.update(ms, settle=False)
    # d (of the later group) moves to g0, the first of the two equally full groups
    assert slots(rg) == {"g0": ["d", "b"]}
    assert j.changes()[n:] == [("g1", 5, "d moved to g0"), ("g0", 5, "d in")]


def test_merge_takes_the_last_groups_nodes_first_and_only_when_they_fill_it() -> None:
    j = Journal()
    rg = ReplicaGroups(3, j)
    rg.adopt("a", "g0", 1, 0)
    rg.adopt("b", "g0", 1, 1)
    rg.adopt("c", "g2", 1, 0)
    rg.adopt("d", "g10", 1, 0)
    ms = waiting("a", "b", "c", "d")
    # the fullest group first, then by number (g2 before g10): d of g10 fills g0
    rg.update(ms, settle=False)
    assert slots(rg) == {"g0": ["a", "b", "d"], "g2": ["c", None, None]}
    rg2 = ReplicaGroups(3, Journal())
    rg2.adopt("c", "g2", 1, 0)
    rg2.adopt("e", "g5", 1, 0)
    rg2.adopt("f", "g5", 1, 1)
    rg2.update(waiting("c", "e", "f"), settle=False)
    # g5 (two nodes) is the fullest: c moves there, as it fills it
    assert slots(rg2) == {"g5": ["e", "f", "c"]}
    # two groups of one node each: one node cannot fill the other, both wait as they are
    rg3 = ReplicaGroups(3, Journal())
    rg3.adopt("c", "g2", 1, 0)
    rg3.adopt("e", "g5", 1, 0)
    rg3.update(waiting("c", "e"), settle=False)
    assert slots(rg3) == {"g2": ["c", None, None], "g5": ["e", None, None]}


def test_adopt_takes_a_nodes_own_report_only_where_nothing_contradicts_it() -> None:
    j = Journal()
    rg = ReplicaGroups(2, j)
    rg.adopt("a", "g0", 3, 0)
    rg.adopt("a", "g1", 3, 1)  # already placed: ignored
    rg.adopt("b", "g0", 3, 0)  # slot taken: ignored
    rg.adopt("c", "g0", 4, 1)  # another generation: ignored
    rg.adopt("d", "g3", 1, 2)  # no such slot
    assert slots(rg) == {"g0": ["a", None]} and rg.groups["g0"].gen == 3
    rg.adopt("e", "g0", 3, 1)
    assert slots(rg) == {"g0": ["a", "e"]} and j.events == []  # adoption journals nothing


def test_broken_reports_restart_the_current_generation_only() -> None:
    j = Journal()
    rg = ReplicaGroups(2, j)
    rg.adopt("a", "g0", 5, 0)
    rg.adopt("b", "g0", 5, 1)
    rg.broken("a", "g0", 4)  # an older generation's failure
    rg.broken("a", "g1", 5)  # not its group
    rg.broken("x", "g0", 5)  # not a member
    assert rg.groups["g0"].gen == 5 and j.events == []
    rg.broken("b", "g0", 5)
    assert j.changes() == [("g0", 6, "b's workers failed")]


def test_reply_names_the_store_once_the_group_is_full() -> None:
    rg = ReplicaGroups(2, Journal())
    rg.adopt("a", "g0", 2, 0)
    stores = {"a": ("10.0.0.1", 20001), "b": ("10.0.0.2", 20002)}
    assert rg.reply("a", stores.get) == {"id": "g0", "gen": 2, "slot": 0, "nodes": ["a"],
                                         "master": None, "index": 0}  # fmt: skip
    rg.adopt("b", "g0", 2, 1)
    assert rg.reply("b", stores.get) == {"id": "g0", "gen": 2, "slot": 1, "nodes": ["a", "b"],
                                         "master": ["10.0.0.1", 20001], "index": 0}  # fmt: skip
    assert rg.reply("zz", stores.get) is None
    assert rg.reply("a", lambda n: None)["master"] is None  # type: ignore[index]
