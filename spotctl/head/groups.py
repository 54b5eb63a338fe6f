"""torchft replica groups that span nodes ([train] nodes_per_replica > 1): which nodes
train together under one torchrun.

The head places each node in a group slot; a group starts once every slot is filled. A
group's generation goes up whenever its membership changes; the nodes of a group run
their torchrun for one (group, generation), so a generation that moves on stops them and
they start again together once the group is full. A noticed node keeps its slot until it
has left: its whole group leaves the quorum with it after the step in flight (the workers
agree on it inside the group), and the others then wait for a replacement. Nodes in
groups that are not full and not running are moved together so that as few nodes as
possible wait. After a head restart the nodes' own reports rebuild the groups (a group is
adopted as its nodes say it is), and nothing is moved for a grace period while they
report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Member:
    """What the head knows of a node, as far as groups go."""

    node_id: str
    state: str  # the agent's state
    placeable: bool  # may take a slot (alive, no notice, not told to leave)
    alive: bool  # keeps its slot (not gone, not left, not unresponsive)
    registered_at: float = 0.0


@dataclass
class Group:
    gid: str
    slots: list[str | None]
    gen: int = 1

    def members(self) -> list[str]:
        return [n for n in self.slots if n is not None]

    def full(self) -> bool:
        return None not in self.slots

    @property
    def index(self) -> int:
        """The group's dense replica index (SPOTCTL_FT_REPLICA_INDEX): its number, the
        lowest free when it was made (ReplicaGroups._new)."""
        return int(self.gid[1:])


class ReplicaGroups:
    def __init__(self, size: int, record: Callable[..., Any]):
        self.size = size
        self.groups: dict[str, Group] = {}
        self.record = record  # the coordinator's event journal

    def group_of(self, nid: str) -> tuple[Group, int] | None:
        for g in self.groups.values():
            if nid in g.slots:
                return g, g.slots.index(nid)
        return None

    def adopt(self, nid: str, gid: str, gen: int, slot: int) -> None:
        """A node says it runs in group `gid`, generation `gen`, slot `slot` (a head that
        restarted learns its groups so). Taken when the head has no other node there."""
        if self.group_of(nid) is not None or slot >= self.size:
            return
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = Group(gid, [None] * self.size, gen=gen)
        if g.slots[slot] is not None or g.gen != gen:
            return
        g.slots[slot] = nid

    def broken(self, nid: str, gid: str, gen: int) -> None:
        """`nid`'s torchrun failed in group `gid`'s generation `gen`: a new generation
        restarts the group's nodes together (the others would wait for it in a collective
        or a quorum). A report of an older generation changes nothing."""
        at = self.group_of(nid)
        if at is not None and at[0].gid == gid and at[0].gen == gen:
            self._changed(at[0], f"{nid}'s workers failed")

    def update(self, members: dict[str, Member], settle: bool) -> None:
        """Drop the nodes that are gone from their slots, then (unless `settle`: a head
        that just started, whose nodes have not all reported) fill the open slots."""
        for g in list(self.groups.values()):
            for i, nid in enumerate(g.slots):
                if nid is None:
                    continue
                m = members.get(nid)
                if (m is None or not m.alive) and not settle:
                    g.slots[i] = None
                    self._changed(g, f"{nid} out")
            if not g.members():
                del self.groups[g.gid]
        if settle:
            return
        placed = {n for g in self.groups.values() for n in g.members()}
        free = sorted((m for m in members.values()
                       if m.placeable and m.state == "waiting" and m.node_id not in placed),
                      key=lambda m: (m.registered_at, m.node_id))
        for g in self._open():
            while not g.full() and free:
                self._place(g, free.pop(0).node_id)
        self._merge(members)
        while free:
            g = self._new()
            while not g.full() and free:
                self._place(g, free.pop(0).node_id)

    def reply(self, nid: str, store_of: Callable[[str], tuple[str, int] | None]
              ) -> dict[str, Any] | None:
        """What a node is told: its group, generation and slot, and where the group's store
        listens (`store_of` its first slot's node: address and group port) once the group
        is full."""
        at = self.group_of(nid)
        if at is None:
            return None
        g, slot = at
        head = g.slots[0]
        first = store_of(head) if g.full() and head is not None else None
        return {"id": g.gid, "gen": g.gen, "slot": slot, "nodes": g.members(),
                "master": list(first) if first else None, "index": g.index}

    # -- placement
    def _open(self) -> list[Group]:
        """Groups with an open slot, the fullest first."""
        return sorted((g for g in self.groups.values() if not g.full()),
                      key=lambda g: (-len(g.members()), int(g.gid[1:])))

    def _merge(self, members: dict[str, Member]) -> None:
        """Nodes waiting in groups that are not full move to the fullest of them, while the
        others' waiting nodes are enough to fill it: a half group of two pays for GPUs
        that train nothing."""
        while True:
            open_ = self._open()
            if len(open_) < 2:
                return
            dst, rest = open_[0], open_[1:]
            movable = [n for g in reversed(rest) for n in g.members()
                       if members.get(n) is not None and members[n].state == "waiting"]
            need = self.size - len(dst.members())
            if len(movable) < need:
                return
            for nid in movable[:need]:
                at = self.group_of(nid)
                assert at is not None
                src, i = at
                src.slots[i] = None
                self._changed(src, f"{nid} moved to {dst.gid}")
                if not src.members():
                    del self.groups[src.gid]
                self._place(dst, nid)

    def _new(self) -> Group:
        """A group under the lowest free number (a gone group's is free again)."""
        i = 0
        while f"g{i}" in self.groups:
            i += 1
        g = self.groups[f"g{i}"] = Group(f"g{i}", [None] * self.size)
        return g

    def _place(self, g: Group, nid: str) -> None:
        g.slots[g.slots.index(None)] = nid
        self._changed(g, f"{nid} in")

    def _changed(self, g: Group, why: str) -> None:
        g.gen += 1
        self.record("replica-group", group=g.gid, gen=g.gen, nodes=g.members(),
                    full=g.full(), change=why)


class ReplicaIndexes:
    """Dense indexes 0..N-1 for torchft replicas of one node each ([train]
    nodes_per_replica = 1; groups of several nodes take theirs from their id, `g<N>`, which
    ReplicaGroups numbers the same way). torchtitan's `--fault_tolerance.replica_id` wants
    one (it is the replica's torchft identity and picks its data shard), and node ids are
    not dense once nodes are replaced.

    A replica gets the lowest free index when it first needs one and keeps it while it is
    alive (a noticed node too, until it has left); once it is gone the index is free again
    and the next newcomer takes it. Two live replicas never hold one index: a node may
    claim the index its workers run with (a head that restarted learns them so) only while
    no other node holds it.
    """

    def __init__(self) -> None:
        self.of: dict[str, int] = {}

    def adopt(self, nid: str, index: int) -> None:
        """`nid` says its workers run with `index`: taken if it holds none and no other
        node holds that one."""
        if nid not in self.of and index >= 0 and index not in self.of.values():
            self.of[nid] = index

    def update(self, members: dict[str, Member], settle: bool) -> None:
        """Free the indexes of the nodes that are gone; then (unless `settle`: a head that
        just started, whose nodes have not all reported theirs) give the others the lowest
        free ones, in the order they registered."""
        for nid in [n for n in self.of if n not in members or not members[n].alive]:
            del self.of[nid]
        if settle:
            return
        new = [m for m in members.values() if m.alive and m.node_id not in self.of]
        if not new:  # every heartbeat ticks: nothing to sort once all hold one
            return
        used = set(self.of.values())
        for m in sorted(new, key=lambda m: (m.registered_at, m.node_id)):
            i = 0
            while i in used:
                i += 1
            self.of[m.node_id] = i
            used.add(i)
