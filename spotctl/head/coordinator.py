"""The head's coordinator: cluster membership, drains and rescale accounting.

It is a state machine driven by agents' heartbeats and notices; the clock is passed in,
so tests can script sequences. The HTTP layer (server.py) only parses and serializes.

Drain cycle (see DESIGN.md):
  notice(X) or join(Y) -> drain gen G starts; every member agent signals its workers;
  workers agree on a step S, save and commit S, then block and report phase "drained".
  notice: leavers stop torchrun and leave the rendezvous, report "left"; then the
          coordinator releases the survivors (they restart their workers, load S).
  join:   when all members are drained the joiner is told to go; its torchrun joins the
          rendezvous and torchrun itself restarts the survivors' workers.
Node states: waiting (not yet allowed to start torchrun) -> running -> leaving -> left;
a node whose heartbeat stops for `dead_after_s` is "unresponsive" (peers' workers of the
current incarnation are killed so nobody waits in a collective for it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from spotctl.head.groups import Member, ReplicaGroups, ReplicaIndexes

DEAD_AFTER_S = 4.0  # heartbeats every 0.25 s: 16 missed beats, well past scheduling jitter
DRAIN_TIMEOUT_S = 20.0  # a drain not complete by then is abandoned (leavers leave anyway)
JOIN_GO_TIMEOUT_S = 25.0
# A noticed node that is in a group still forming (its workers up, not yet training) is
# drained once the group trains rather than pulled out of it (which would make the others
# fail and restart again), unless its deadline is closer than this.
FORMING_MARGIN_S = 10.0
# a drain of a plain torchrun script's group: each agent ends its workers' grace itself
# (SPOTCTL_NOTICE_GRACE_S, at most MAX_NOTICE_GRACE_S) and this only backs it up
PLAIN_DRAIN_TIMEOUT_S = 150.0
START_GRACE_S = 30.0  # a start waits this long at most for slow nodes to be ready  # after `go`, survivors still blocked this long are released


@dataclass
class WorkerReport:
    rank: int
    local_rank: int
    world_size: int
    step: int  # optimizer steps completed (global step)
    phase: str  # "init" | "train" | "draining" | "drained" | "done"
    incarnation: str  # one id per worker-group formation (rank 0 makes it)
    resume_step: int  # the committed step this incarnation started from
    first_step_at: float | None  # unix time the first step at this world size completed
    last_ckpt: int  # highest committed checkpoint step this worker knows
    loss: float | None = None
    throughput: float | None = None  # samples/s of the whole job (rank 0's view)
    drain_step: int | None = None
    pid: int = 0
    startup: dict[str, Any] | None = None  # where this worker's start-up time went
    engine: str = "torchrun"
    # torchft: the replicas in its quorum, and the steps this process ran whose work was
    # thrown away (not committed: run again), counted by the replica itself (None: not
    # reported; the head's validation must pass both fields through)
    replicas: int = 0
    failed_steps: int | None = None
    # diloco/localsgd: this process's syncs that nobody applied and the local steps they
    # dropped (each group trains its round again)
    failed_syncs: int | None = None
    dropped_steps: int | None = None
    # diloco/localsgd: a group that left on a notice in the middle of a round ([train]
    # on_notice): the local steps it dropped (0: it left at a sync)
    notice_dropped: int | None = None
    # torchft: the pause of the last regroup this replica went through, timed by itself
    regroup_pause_s: float | None = None
    route: str = ""  # "plain": the script formed its group itself (spotctl.elastic.plain)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkerReport:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in fields})


@dataclass
class NodeInfo:
    node_id: str
    state: str = "waiting"
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    addr: str = ""
    workers: list[WorkerReport] = field(default_factory=list)
    notice: dict[str, Any] | None = None
    unresponsive: bool = False
    go_at: float | None = None
    ready: bool = True  # its torchrun waits at the rendezvous gate
    # its network as its agent probed it, with the transport NCCL named (validated by the
    # server; an agent sends it until this head has it, so a beat without it keeps it)
    net: dict[str, Any] | None = None
    # torchft, nodes_per_replica > 1: the port its replica group's store listens on when
    # it holds the group's first slot (spotctl.head.groups)
    group_port: int = 0
    # the last error line of its workers when they failed the same way again and again
    # (agent state "crashed": its agent stopped restarting them)
    error: str | None = None

    def training(self, incarnation: str | None) -> bool:
        return any(w.phase == "train" and w.incarnation == incarnation for w in self.workers)

    def drained_at(self, gen: int, drained_gen: int) -> bool:
        return drained_gen >= gen and bool(self.workers) and all(
            w.phase == "drained" for w in self.workers
        )


@dataclass
class Drain:
    gen: int
    reason: str  # "notice" | "join" | "rebalance"
    started_at: float
    members: list[str]
    leavers: list[str]
    joiners: list[str]
    drained: dict[str, int] = field(default_factory=dict)  # node -> drain step S
    left: set[str] = field(default_factory=set)
    released: bool = False
    committed: bool = False  # every member drained: "drain-committed" recorded
    go_at: float | None = None
    deadline: float = math.inf
    plain: bool = False  # a plain script's group: its agents end the grace (notice file)


@dataclass
class Cause:
    reason: str  # notice | join | failure | restart
    at: float


ENGINES = ("torchrun", "torchft")


class Coordinator:
    """engine: the cluster's `[train] engine`. On torchft the replicas regroup by themselves
    (torchft's quorum): a notice is the node's own graceful leave and a join its own
    recovery from a live peer, so the head starts no group drain, gates no joiner and kills
    no peer's workers; it still records notices, leaves and every membership change (a new
    quorum is a new worker group) as rescale events."""

    def __init__(self, clock: Any, dead_after_s: float = DEAD_AFTER_S, engine: str = "torchrun"):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
        self.clock = clock
        self.engine = engine
        self.dead_after_s = dead_after_s
        self.started_at = clock()  # a group training before this is one a restarted head adopts
        self.nodes: dict[str, NodeInfo] = {}
        self.drain: Drain | None = None
        self.gens = itertools.count(1)
        self.release_gen = 0
        self.kill_gen = 0
        self.kill_incarnation: str | None = None
        self.node_drain_gen: dict[str, int] = {}  # gen each node's agent acknowledged
        self.incarnation: dict[str, Any] | None = None  # current worker group
        self.max_step = 0  # highest step any rank reported completing
        self.last_ckpt = 0
        self.cause: Cause | None = None
        self.events: list[dict[str, Any]] = []
        self.seq = itertools.count(1)
        self.queued_notices: list[str] = []
        # which kind of script runs ("plain" once a worker said so), and when a plain
        # script moved a torchft cluster onto the restart cycle
        self.route: str | None = None
        self.switched_at: float | None = None
        self.restarts = 0  # rescale events journaled by this head
        self.start_nodes = 0  # after a switch: how many nodes the first round waits for
        self.leave_requested: set[str] = set()  # torchft: nodes told to leave (rebalance)
        # torchft replica groups of several nodes, once a node says its group size
        self.replica_groups: ReplicaGroups | None = None
        # torchft, one node per replica: each replica's dense index (torchtitan's replica id)
        self.replica_indexes = ReplicaIndexes()
        # torchft: each worker process's own count of failed (redone) steps, as last
        # reported and as already charged to a journaled regroup, by (node, pid, local rank)
        self._failed_seen: dict[tuple[str, int, int], int] = {}
        self._failed_charged: dict[tuple[str, int, int], int] = {}
        # diloco/localsgd: (node, pid) -> (failed syncs, dropped steps) journaled so far
        self._syncs_seen: dict[tuple[str, int], tuple[int, int]] = {}
        # diloco/localsgd: (node, pid) of leaves on a notice journaled (notice_drop)
        self._notice_drops_seen: set[tuple[str, int]] = set()
        # torchft: rescales journaled with no pause the head could time (a join, a loss it
        # learnt of late), by incarnation: the first survivor's own measure of its regroup
        # pause (WorkerReport.regroup_pause_s) is journaled as a `pause` event for it
        self._pause_wanted: dict[str, float] = {}
        # A restarted head starts its generations from 0 again: agents reset theirs when
        # this id changes, so a new drain is never mistaken for an old one.
        self.head_id = f"{clock():.6f}"

    # -- events
    def record(self, type_: str, **data: Any) -> dict[str, Any]:
        # seq, ts and type are the head's own: fields of the same name in data never win
        ev = {"seq": next(self.seq), "ts": self.clock(), "type": type_}
        ev.update((k, v) for k, v in data.items() if k not in ev)
        self.events.append(ev)
        return ev

    # -- inputs
    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        now = self.clock()
        nid = str(body["node_id"])
        node = self.nodes.get(nid)
        if node is None:
            node = self.nodes[nid] = NodeInfo(node_id=nid, registered_at=now)
            self.record("join-request" if self._group_training() else "register", node=nid)
        if node.unresponsive:
            node.unresponsive = False
            self.record("node-back", node=nid)
        node.last_heartbeat = now
        node.addr = body.get("addr", node.addr)
        agent_state = body.get("agent_state", "waiting")
        if node.state not in ("left",) or agent_state == "waiting":
            if agent_state == "left" and node.state != "left":
                self.record("leave", node=nid)
            elif agent_state == "running" and node.state == "waiting":
                self.record("join", node=nid)
            elif agent_state == "crashed" and node.state != "crashed":
                self.record("crashed", node=nid, error=body.get("error") or "")
            node.state = agent_state
        node.error = body.get("error")
        node.workers = [WorkerReport.from_json(w) for w in body.get("workers", [])]
        node.ready = bool(body.get("ready", True))
        if body.get("net") is not None:
            node.net = dict(body["net"])
        if "drain_gen" in body:
            self.node_drain_gen[nid] = int(body["drain_gen"])
        self._see_route(nid, node.workers, now)
        for w in node.workers:
            if w.failed_steps is not None:
                self._failed_seen[(nid, w.pid, w.local_rank)] = int(w.failed_steps)
            if w.failed_syncs and w.local_rank == 0:
                self._see_failed_syncs(nid, w)
            if w.notice_dropped and w.local_rank == 0:
                self._see_notice_drop(nid, w)
        for w in node.workers:
            self._observe_worker(w, now)
        if body.get("notice") and node.notice is None:
            self.notice(nid, body["notice"])
        grp = body.get("group")
        if grp is not None and grp["size"] > 1 and self.engine == "torchft":
            node.group_port = int(grp["port"])
            if self.replica_groups is None:
                self.replica_groups = ReplicaGroups(int(grp["size"]), self.record)
            if "id" in grp and grp["broken"]:
                # its torchrun failed: the group's other nodes would wait for it
                self.replica_groups.broken(nid, grp["id"], grp["gen"])
            elif "id" in grp and self._settling(now):
                # a head that just (re)started learns the running groups from their nodes
                self.replica_groups.adopt(nid, grp["id"], grp["gen"], grp["slot"])
        if body.get("replica_index") is not None and self.engine == "torchft" \
                and grp is None:
            # the index its workers run with: kept, unless another node holds it
            self.replica_indexes.adopt(nid, int(body["replica_index"]))
        self.tick()
        return self._reply(node)

    def _see_route(self, nid: str, workers: list[WorkerReport], now: float) -> None:
        """A plain torchrun script always runs as one torchrun job across the nodes: on
        torchft (one torchrun per node, each a copy of the job) the cluster moves to the
        restart cycle, once; agents learn the engine from the replies and restart."""
        if self.route == "plain" or not any(w.route == "plain" for w in workers):
            return
        self.route = "plain"
        was, self.engine = self.engine, "torchrun"
        if was != "torchrun":
            self.switched_at = now
            self.replica_groups = None
            self.leave_requested.clear()
        self.record("route", route="plain", engine="torchrun", node=nid,
                    why="a plain torchrun script (it forms its own process group): one "
                    "torchrun job across the nodes on the restart cycle"
                    + (f", not one {was} replica per node" if was != "torchrun" else ""))

    def _settling(self, now: float) -> bool:
        return now - self.started_at < self.dead_after_s

    def _group_store(self, nid: str) -> tuple[str, int] | None:
        """Where `nid`'s group store listens when it holds its group's first slot."""
        n = self.nodes.get(nid)
        return (n.addr, n.group_port) if n is not None and n.addr else None

    def _group_members(self) -> dict[str, Member]:
        out = {}
        for n in self.nodes.values():
            alive = not n.unresponsive and n.state not in ("left", "down", "finished", "failed",
                                                              "crashed")
            out[n.node_id] = Member(
                node_id=n.node_id, state=n.state,
                placeable=alive and n.notice is None and n.group_port > 0
                and n.node_id not in self.leave_requested,
                alive=alive, registered_at=n.registered_at)
        return out

    def notice(self, nid: str, notice: dict[str, Any]) -> None:
        now = self.clock()
        node = self.nodes.setdefault(nid, NodeInfo(node_id=nid, registered_at=now))
        if node.notice is not None:
            return
        node.notice = dict(notice)
        self.record("notice", node=nid, **{k: v for k, v in notice.items() if k != "node"})
        if self.cause is None or self.cause.reason != "notice":
            self.cause = Cause("notice", now)
        if self.engine == "torchrun":  # on torchft the node's replica leaves by itself
            self.queued_notices.append(nid)
        self.tick()

    def request_drain(self, reason: str = "rebalance", leavers: list[str] | None = None) -> int:
        """Drain on request (rebalance replace). Returns the drain gen or 0 if busy. On
        torchft nothing drains: the leavers are told to leave, and each node's replica
        leaves the quorum as on a notice."""
        if self.engine != "torchrun":
            known = [n for n in leavers or [] if n in self.nodes]
            if not known:
                return 0
            self.leave_requested.update(known)
            gen = next(self.gens)
            self.record("leave-requested", gen=gen, reason=reason, nodes=known)
            return gen
        if self.drain is not None:
            return 0
        d = self._start_drain(reason, leavers or [], [])
        return d.gen if d else 0

    # -- the state machine
    def tick(self) -> None:
        now = self.clock()
        self._liveness(now)
        if self.replica_groups is not None or self.engine == "torchft":
            members, settling = self._group_members(), self._settling(now)
            if self.replica_groups is not None:
                self.replica_groups.update(members, settling)
            if self.engine == "torchft":
                self.replica_indexes.update(
                    {nid: m for nid, m in members.items() if not self.nodes[nid].group_port},
                    settling)
        if self.drain is None:
            self._maybe_start_drain(now)
        if self.drain is not None:
            self._advance_drain(now)

    def _group_training(self) -> bool:
        inc = self.incarnation["id"] if self.incarnation else None
        return any(n.training(inc) for n in self.nodes.values() if not n.unresponsive)

    def _members(self) -> list[str]:
        inc = self.incarnation["id"] if self.incarnation else None
        return sorted(
            n.node_id
            for n in self.nodes.values()
            if not n.unresponsive and n.state == "running" and n.training(inc)
        )

    def _liveness(self, now: float) -> None:
        for n in self.nodes.values():
            if n.state in ("left", "down") or n.unresponsive:
                continue
            if n.last_heartbeat and now - n.last_heartbeat > self.dead_after_s:
                n.unresponsive = True
                inc = self.incarnation["id"] if self.incarnation else None
                was_member = any(w.incarnation == inc for w in n.workers)
                self.record("node-unresponsive", node=n.node_id,
                            silent_s=round(now - n.last_heartbeat, 2))
                # (on torchft the quorum has dropped it long before: nothing to do)
                if was_member and inc is not None and self.engine == "torchrun":
                    # Peers may be blocked in a collective waiting for this node; a signal
                    # handler cannot run there, so their agents kill the workers.
                    self.kill_gen += 1
                    self.kill_incarnation = inc
                    if self.cause is None:
                        self.cause = Cause("failure", n.last_heartbeat)
                    elif (self.cause.reason == "notice" and self.drain is not None
                          and not self.drain.committed):
                        # the death broke the notice's drain: the restart is a failure's
                        self.cause = Cause("failure", min(self.cause.at, n.last_heartbeat))

    def _maybe_start_drain(self, now: float) -> None:
        if self.engine != "torchrun":
            return
        members = self._members()
        if members:
            self.start_nodes = 0  # the first round formed: later rounds are drains' or joins'
        # notices first: a leaving node has a deadline
        while self.queued_notices:
            nid = self.queued_notices[0]
            node = self.nodes[nid]
            if nid in members:
                self._start_drain("notice", [nid], [])
                self.queued_notices.pop(0)
                return
            if self._forming(node, now):
                return  # drained as soon as its group trains
            # Not training (not started, or already gone): it just leaves.
            self.queued_notices.pop(0)
            node.state = "leaving" if node.state != "left" else node.state
        waiting = sorted(
            n.node_id
            for n in self.nodes.values()
            if n.state == "waiting" and not n.unresponsive and n.notice is None
            and n.go_at is None
        )
        if not waiting:
            return
        if not members and self.switched_at is not None and now - self.switched_at < START_GRACE_S \
                and any(n.state == "running" and not n.unresponsive and n.notice is None
                        for n in self.nodes.values()):
            return  # moved off torchft: start once every node's agent restarted its torchrun
        if not members:
            # Nothing to protect: start together. Wait until every waiting node's torchrun
            # is at the gate (or START_GRACE_S passed), so one rendezvous round takes them
            # all instead of a first node training alone and the others forcing restarts.
            ready = [nid for nid in waiting if self.nodes[nid].ready]
            oldest = min(self.nodes[nid].registered_at for nid in waiting)
            if self.switched_at is not None:  # their torchrun started again then
                oldest = max(oldest, self.switched_at)
            if ready and (len(ready) == len(waiting) or now - oldest > START_GRACE_S):
                for nid in ready:
                    self.nodes[nid].go_at = now
                if self.switched_at is not None:
                    # every node restarted its torchrun at once: the first round waits
                    # for all of them (not torch's 1 s last call on a loaded machine)
                    self.start_nodes = len(ready)
            return
        ready = [nid for nid in waiting if self.nodes[nid].ready]
        if ready:
            # the group keeps training while a newcomer boots; it drains only once the
            # newcomer's torchrun waits at the gate
            self._start_drain("join", [], ready)

    def _forming(self, node: NodeInfo, now: float) -> bool:
        """`node` has live workers in a group that does not train yet (a rendezvous round
        it entered before its notice came), and time enough to drain once it does."""
        dl = (node.notice or {}).get("deadline")
        if not isinstance(dl, (int, float)) or not math.isfinite(dl):
            return False
        inc = self.incarnation["id"] if self.incarnation else None
        return (node.state == "running" and not node.unresponsive and bool(node.workers)
                and not node.training(inc) and float(dl) - now > FORMING_MARGIN_S)

    def _start_drain(self, reason: str, leavers: list[str], joiners: list[str]) -> Drain | None:
        now = self.clock()
        members = self._members()
        if not members:
            return None
        plain = any(w.route == "plain" for m in members for w in self.nodes[m].workers)
        # a plain script's workers train on through their grace (the agents end it)
        deadline = now + (PLAIN_DRAIN_TIMEOUT_S if plain else DRAIN_TIMEOUT_S)
        for nid in leavers:
            nd = self.nodes[nid].notice or {}
            dl = nd.get("deadline")
            if isinstance(dl, (int, float)) and math.isfinite(dl):
                deadline = min(deadline, float(dl) - 2.0)
        self.drain = Drain(
            gen=next(self.gens), reason=reason, started_at=now, members=members,
            leavers=leavers, joiners=joiners, deadline=deadline, plain=plain,
        )
        if reason == "join" and (self.cause is None or self.cause.reason == "restart"):
            self.cause = Cause("join", now)
        self.record("drain-start", gen=self.drain.gen, reason=reason, members=members,
                    leavers=leavers, joiners=joiners)
        return self.drain

    def _advance_drain(self, now: float) -> None:
        d = self.drain
        assert d is not None
        live_members = [m for m in d.members if not self.nodes[m].unresponsive]
        for m in live_members:
            node = self.nodes[m]
            if m not in d.drained and self.node_drain_gen.get(m, 0) >= d.gen and node.workers \
                    and all(w.phase == "drained" for w in node.workers):
                d.drained[m] = max(w.drain_step or w.step for w in node.workers)
        all_drained = all(m in d.drained for m in live_members)
        for nid in d.leavers:
            if self.nodes[nid].state == "left" or self.nodes[nid].unresponsive:
                d.left.add(nid)
        timed_out = now >= d.deadline
        if d.reason == "join":
            if all_drained and d.go_at is None:
                d.go_at = now
                d.committed = True
                for j in d.joiners:
                    self.nodes[j].go_at = now
                self.record("drain-committed", gen=d.gen, step=max(d.drained.values(), default=0))
            if d.go_at is not None and self._reformed(d):
                self._finish_drain("reformed")
            elif (d.go_at is not None and now - d.go_at > JOIN_GO_TIMEOUT_S) or (
                timed_out and d.go_at is None
            ):
                for j in d.joiners:
                    self.nodes[j].go_at = self.nodes[j].go_at or now
                self._release(d, "join timed out")
            return
        # notice / rebalance: leavers go first, then survivors are released
        if self._reformed(d):
            # The group broke before this drain could commit (a member died mid-drain) and
            # the survivors already re-formed without the leavers (a noticed node joins no
            # new round): nothing is left to drain, and joins must not wait for a timeout.
            self._release(d, "group re-formed")
            return
        if all_drained and not d.committed:
            d.committed = True
            self.record("drain-committed", gen=d.gen, step=max(d.drained.values(), default=0))
        done = all_drained and all(nid in d.left for nid in d.leavers)
        if done or timed_out:
            self._release(d, "leavers gone" if done else "timed out")

    def _reformed(self, d: Drain) -> bool:
        inc = self.incarnation
        return bool(inc and inc["first_seen"] > d.started_at and inc.get("first_step_at"))

    def _release(self, d: Drain, why: str) -> None:
        if not d.released:
            d.released = True
            self.release_gen = d.gen
            self.record("drain-release", gen=d.gen, why=why)
        self._finish_drain(why)

    def _finish_drain(self, why: str) -> None:
        d = self.drain
        if d is not None:
            self.record("drain-end", gen=d.gen, why=why)
        self.drain = None

    def _see_failed_syncs(self, nid: str, w: WorkerReport) -> None:
        """diloco/localsgd: a `sync_failed` event for each new sync a node's group did not
        apply (its count went up since this process's last report): the local steps it
        dropped and the step it went back to (the round's start, trained again)."""
        key = (nid, w.pid)
        seen, dropped = self._syncs_seen.get(key, (0, 0))
        n = int(w.failed_syncs or 0)
        if n <= seen:
            return
        self._syncs_seen[key] = (n, int(w.dropped_steps or 0))
        self.record("sync_failed", node=nid, failed_syncs=n - seen,
                    dropped_steps=max(0, int(w.dropped_steps or 0) - dropped),
                    step=w.step, incarnation=w.incarnation)

    def _see_notice_drop(self, nid: str, w: WorkerReport) -> None:
        """diloco/localsgd: a `notice_drop` event, once per process, for a group that left
        on a notice in the middle of a round ([train] on_notice): the local steps it
        dropped and the synced step it left at (the other groups' sync of that round
        fails: their own `sync_failed` events follow)."""
        key = (nid, w.pid)
        if key in self._notice_drops_seen:
            return
        self._notice_drops_seen.add(key)
        self.record("notice_drop", node=nid, dropped_steps=int(w.notice_dropped or 0),
                    step=w.drain_step, incarnation=w.incarnation)

    # -- worker reports and rescale accounting
    def _observe_worker(self, w: WorkerReport, now: float) -> None:
        self.last_ckpt = max(self.last_ckpt, w.last_ckpt)
        if w.regroup_pause_s is not None and w.incarnation in self._pause_wanted:
            del self._pause_wanted[w.incarnation]
            self.record("pause", incarnation=w.incarnation, pause_s=w.regroup_pause_s,
                        measured_by="replicas")
        inc = self.incarnation
        if inc is not None and w.incarnation == inc["id"]:
            self.max_step = max(self.max_step, w.step)
            if w.rank == 0 and w.first_step_at and not inc.get("first_step_at"):
                inc["first_step_at"] = w.first_step_at
                self._record_rescale(inc)
            return
        if w.rank != 0 or not w.incarnation or w.phase not in ("train", "drained", "done"):
            return
        if inc is not None and w.incarnation in inc.get("old", ()):
            return
        # a new worker group formed
        old = set(inc.get("old", ())) | {inc["id"]} if inc else set()
        prev_world = inc["world_size"] if inc else 0
        prev_max = self.max_step
        self.incarnation = {
            "id": w.incarnation, "world_size": w.world_size, "resume_step": w.resume_step,
            "first_seen": now, "first_step_at": w.first_step_at, "old": old,
            "prev_world": prev_world, "prev_max": prev_max,
        }
        # the new group's own progress: after a restore from an older checkpoint the old
        # group's higher steps are gone, and must not count as lost again at the next rescale
        self.max_step = w.step
        if w.first_step_at:
            self._record_rescale(self.incarnation)

    def _failed_since_last_regroup(self) -> int:
        """torchft: the steps whose work was thrown away since the last journaled regroup,
        from the replicas' own counts (every replica of a failed step counts it: the most
        any worker counted)."""
        lost = max((n - self._failed_charged.get(k, 0) for k, n in self._failed_seen.items()),
                   default=0)
        self._failed_charged.update(self._failed_seen)
        return max(0, lost)

    def _record_rescale(self, inc: dict[str, Any]) -> None:
        """Journal how group `inc` formed. Called once per group: when its rank 0's first
        step is first seen (_observe_worker sets `first_step_at` then, and never again)."""
        cause = self.cause
        ft = self.engine == "torchft"
        grew = inc["world_size"] > inc["prev_world"]
        if ft and inc["prev_world"] and inc["world_size"] == inc["prev_world"] and (
                cause is None or cause.reason == "notice"):
            # a new quorum of the same size with no join or loss seen: the same replicas
            # regrouped (torchft numbers a quorum anew after a failed commit vote, a
            # restarted Lighthouse from 1 again). Nobody stopped and nothing was rescaled:
            # journaled as a regroup, never as a rescale with a made-up pause, and a
            # pending notice stays pending for the quorum its node leaves
            # (unknown when no replica's report carries its count)
            lost = self._failed_since_last_regroup() if self._failed_seen else None
            self.record("regroup", world_size=inc["world_size"], resume_step=inc["resume_step"],
                        reason="redo" if lost else "same-members", lost_steps=lost,
                        engine=self.engine)
            return
        # on torchft a notice explains only a quorum that shrank: one that grew while a
        # notice is pending (a replica late to a quorum healing back in, a join) is not the
        # notice's, and the notice stays pending for the quorum its node leaves
        keep = cause is not None and cause.reason == "notice" and grew and ft
        if keep:
            cause = None
        inferred = cause is None and ft and inc["world_size"] != inc["prev_world"]
        if inferred:
            # torchft regroups within a quorum round, before the head could see why: when
            # it happened is unknown too, so no duration is measured from it
            cause = Cause("join" if grew else "failure", inc["first_seen"])
        # no cause seen: the group restarted by itself; when that began is unknown
        unseen = cause is None
        cause = cause or Cause("restart", inc["first_seen"])
        if not keep:
            self.cause = None
        if inc["prev_world"] == 0:
            # a group that trained before this head started (torchft, after a head restart:
            # the replicas went on from memory) is taken up where first seen, not
            # "started" at its quorum's first step
            adopted = inc["first_step_at"] < self.started_at
            self.record("train-start", world_size=inc["world_size"],
                        resume_step=max(inc["resume_step"], self.max_step) if adopted
                        else inc["resume_step"], **({"adopted": True} if adopted else {}))
            self._failed_since_last_regroup()
            return
        # steps thrown away: on torchft the replicas count their own failed (redone) steps
        # (a quorum's resume step says nothing of it: a healed replica resumes at its
        # peers' step); on torchrun, and from replicas whose reports carry no count (the
        # head's validation dropped the field), the steps past the step the group resumed
        rank0 = next((w for n in self.nodes.values() for w in n.workers
                      if w.rank == 0 and w.incarnation == inc["id"]), None)
        plain = rank0 is not None and rank0.route == "plain"
        # a plain script resumes from its own checkpoint: the head cannot tell what it lost
        if plain:
            lost = None
        elif ft and self._failed_seen:
            lost = self._failed_since_last_regroup()
        else:
            lost = max(0, inc["prev_max"] - inc["resume_step"])
        # the workers' start-up, when they were started for this rescale (on torchft the
        # quorum's first replica has usually trained all along: none then)
        spawned = (round(rank0.startup["started_at"] - cause.at, 3)
                   if rank0 and rank0.startup else None)
        if spawned is not None and spawned < 0:
            spawned = None
        # the pause, from the cause the head saw to the new group's first step; none when
        # the cause was not seen (inferred, or a restart by itself) and never negative (a
        # cause the head learnt of after the first step, or clocks apart, measures nothing)
        pause = None if inferred or unseen else round(inc["first_step_at"] - cause.at, 3)
        if pause is not None and pause < 0:
            pause = None
        replica_pause = None
        if pause is None and ft:
            # the survivors time their own regroup: the first one that reported it now,
            # else the first that does later (a `pause` event for this incarnation)
            replica_pause = next((w.regroup_pause_s for n in self.nodes.values()
                                  for w in n.workers if w.incarnation == inc["id"]
                                  and w.regroup_pause_s is not None), None)
            if replica_pause is None:
                self._pause_wanted[inc["id"]] = self.clock()
                while len(self._pause_wanted) > 16:  # bounded: the oldest is given up
                    del self._pause_wanted[min(self._pause_wanted,
                                               key=lambda k: self._pause_wanted[k])]
        self.restarts += 1
        self.record(
            "rescale",
            incarnation=inc["id"],
            **({"replica_pause_s": replica_pause} if ft else {}),
            from_world_size=inc["prev_world"],
            to_world_size=inc["world_size"],
            reason=cause.reason,
            cause_seen=not (inferred or unseen),
            checkpoint_step=inc["resume_step"],
            resume_step=inc["resume_step"],
            lost_steps=lost,
            engine=self.engine,
            # plain: from the cause to the new group formed (its init_process_group)
            notice_to_resume_s=pause,
            **({"route": "plain"} if plain else {}),
            # the new workers' own start: imports, process group, restore, first step
            worker_start=(rank0.startup if rank0 and spawned is not None else None),
            worker_spawned_after_s=spawned,
        )

    # -- outputs
    def _reply(self, node: NodeInfo) -> dict[str, Any]:
        d = self.drain
        drain = None
        if d is not None and (node.node_id in d.members):
            # nodes: how many the group's next round has (its members that stay, and the
            # joiners), so that it forms once they are all in (spotctl.elastic.rdzv)
            stay = [m for m in d.members if m not in d.leavers]
            drain = {"gen": d.gen, "leave": node.node_id in d.leavers, "reason": d.reason,
                     "nodes": len(stay) + len([j for j in d.joiners if j not in stay])}
            if d.plain:  # when it is abandoned: a plain script's grace ends before
                drain["deadline"] = d.deadline
        noticed = node.notice is not None and (
            d is None or node.node_id not in d.members
        ) and not (node.node_id in self.queued_notices and self._forming(node, self.clock()))
        leave_now = (noticed or node.node_id in self.leave_requested) and node.state != "left"
        return {
            "head_id": self.head_id,
            "engine": self.engine,
            "drain": drain,
            "leave": leave_now or bool(drain and drain["leave"] and node.node_id in d.drained
                                       if d else False),
            "release_gen": self.release_gen,
            "kill_gen": self.kill_gen,
            "kill_incarnation": self.kill_incarnation,
            "go": node.go_at is not None or self.engine != "torchrun",
            **({"start_nodes": self.start_nodes} if self.start_nodes and node.go_at else {}),
            "group": None if self.replica_groups is None
            else self.replica_groups.reply(node.node_id, self._group_store),
            # torchft, one node per replica: its dense replica index (None: not given yet;
            # its agent starts its workers once it has one)
            **({"replica_index": self.replica_indexes.of.get(node.node_id)}
               if self.engine == "torchft" and not node.group_port else {}),
        }

    def status(self) -> dict[str, Any]:
        now = self.clock()
        inc = self.incarnation or {}
        rank0 = None
        for n in self.nodes.values():
            for w in n.workers:
                if w.rank == 0 and w.incarnation == inc.get("id"):
                    rank0 = w
        return {
            "engine": self.engine,
            # plain: a torchrun script that forms its own group; elastic: spotctl.elastic
            "route": self.route or ("elastic" if inc else None),
            # how many times the worker group re-formed (rescales and restarts)
            "restarts": self.restarts,
            "world_size": inc.get("world_size", 0) if self._group_training() else 0,
            "step": self.max_step,
            "last_checkpoint_step": self.last_ckpt,
            "loss": rank0.loss if rank0 else None,
            "throughput": rank0.throughput if rank0 else None,
            "incarnation": inc.get("id"),
            "drain": None if self.drain is None else {
                "gen": self.drain.gen, "reason": self.drain.reason,
                "members": self.drain.members, "leavers": self.drain.leavers,
                "joiners": self.drain.joiners,
            },
            "nodes": {
                n.node_id: {
                    "state": "unresponsive" if n.unresponsive else n.state,
                    "last_heartbeat": n.last_heartbeat,
                    "heartbeat_age_s": round(now - n.last_heartbeat, 2) if n.last_heartbeat else None,
                    "addr": n.addr,
                    "notice": n.notice,
                    "step": max((w.step for w in n.workers), default=None),
                    "world_size": max((w.world_size for w in n.workers), default=None),
                    "workers": [w.__dict__ for w in n.workers],
                    "net": n.net,
                    # torchft, nodes_per_replica > 1: the replica group it is placed in
                    "group": self._group_name(n.node_id),
                    # torchft: its replica's dense index, SPOTCTL_FT_REPLICA_INDEX
                    "replica_index": self._replica_index(n.node_id),
                    "error": n.error,
                }
                for n in self.nodes.values()
            },
        }

    def _replica_index(self, nid: str) -> int | None:
        if self.engine != "torchft":
            return None
        at = None if self.replica_groups is None else self.replica_groups.group_of(nid)
        return at[0].index if at is not None else self.replica_indexes.of.get(nid)

    def _group_name(self, nid: str) -> str | None:
        at = None if self.replica_groups is None else self.replica_groups.group_of(nid)
        return None if at is None else at[0].gid

    def forget(self, nid: str) -> None:
        """The node is gone for good (terminated): drop it from membership."""
        n = self.nodes.get(nid)
        if n is not None:
            n.state = "left"
