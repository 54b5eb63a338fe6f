"""Take a stopped torchrun agent out of the c10d rendezvous at once.

A SIGTERMed torchrun agent does not close the rendezvous (good) but stays a participant
until its keep-alive expires (keep_alive_interval x keep_alive_max_attempt), which would
hold the survivors' next round for that long. The node's spotctl agent knows the torchrun
pid and address, so after torchrun exits it runs the rendezvous' own exit operation for
that node descriptor. This uses torch's private rendezvous classes (pinned torch 2.13;
tests/e2e cover it).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from spotctl.sockets import listening_store


def leave_rendezvous(
    store_host: str, store_port: int, run_id: str, addr: str, pid: int, timeout_s: float = 10.0
) -> bool:
    """Remove node (addr, pid, local_id 0) from the rendezvous participants/wait list.

    Returns True when the node is no longer listed.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        RendezvousTimeout,
        _Action,
        _BackendRendezvousStateHolder,
        _DistributedRendezvousOpExecutor,
        _NodeDesc,
        _RendezvousContext,
    )

    store = TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=10),
                     use_libuv=True)
    backend = C10dRendezvousBackend(store, run_id)
    settings = RendezvousSettings(
        run_id=run_id, min_nodes=1, max_nodes=1 << 20, timeout=RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=5,
    )
    holder = _BackendRendezvousStateHolder(backend, settings)
    node = _NodeDesc(addr=addr, pid=pid, local_id=0)
    executor = _DistributedRendezvousOpExecutor(node, holder, settings)

    def leave_op(ctx: _RendezvousContext, deadline: float) -> _Action:
        if ctx.node in ctx.state.participants:
            return _Action.REMOVE_FROM_PARTICIPANTS
        if ctx.node in ctx.state.wait_list:
            return _Action.REMOVE_FROM_WAIT_LIST
        if ctx.node in ctx.state.redundancy_list:
            return _Action.REMOVE_FROM_REDUNDANCY_LIST
        return _Action.FINISH

    holder.sync()
    st = holder.state
    listed = node in st.participants or node in st.wait_list or node in st.redundancy_list
    executor.run(leave_op, time.monotonic() + timeout_s)
    holder.sync()
    st = holder.state
    gone = node not in st.participants and node not in st.wait_list
    logging.getLogger("spotctl.rdzv").info(
        "rendezvous leave of %s pid %d: listed before %s, gone after %s", addr, pid, listed, gone)
    return gone


def listed_pid(pid_file: str, started: int) -> int:
    """The pid a node's torchrun is listed under: what it wrote in `pid_file` (see
    get_handler), or `started` (the process the agent started: torchrun itself when it
    ran cold) when there is no such file."""
    try:
        with open(pid_file) as f:
            raw = f.read(32).strip()
    except OSError:
        return started
    return int(raw) if raw.isdigit() else started


def serve_leaves() -> int:
    """`python -m spotctl.agent.leave`: the leave above, for the node agent (which may
    run as root). The rendezvous state in the store is a pickle anyone who reaches the
    store can write, so root never loads it: the agent starts this server as the training
    user (torch imported ahead, off the critical path) and sends one JSON line per leave,
    {"host", "port", "run_id", "addr", "pid", "pid_file"}: the pid torchrun wrote in
    pid_file when there is one (the training user wrote it: read here, not by root), else
    "pid". The answer is one word of LEAVE_ANSWERS on a
    line (the agent compares it, parsing nothing the training user wrote); an error's
    detail goes to stderr, the server's log. Ends at end of input."""
    import json
    import sys

    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401

    # (imported here, not at the top: the zygote imports this module before it forks
    # the server, and runpy warns about a __main__ module imported before it runs)
    from spotctl.agent.leave import LEAVE_ANSWERS, MAX_LEAVE_LINE

    # each leave's line (pid, listed before, gone after) goes to the server's log
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    lg = logging.getLogger("spotctl.rdzv")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)

    for line in sys.stdin:
        try:
            req = json.loads(line[:MAX_LEAVE_LINE])
            pid = listed_pid(str(req.get("pid_file") or ""), int(req["pid"]))
            ok = leave_rendezvous(str(req["host"]), int(req["port"]), str(req["run_id"]),
                                  str(req["addr"]), pid)
            ans = LEAVE_ANSWERS[0] if ok else LEAVE_ANSWERS[1]
        except Exception as e:  # noqa: BLE001 - logged here; the agent goes on
            print(f"leave failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            ans = LEAVE_ANSWERS[2]
        sys.stdout.buffer.write(ans + b"\n")
        sys.stdout.flush()
    return 0


class NodeLeaving(Exception):
    """This node has a preemption notice: its torchrun joins no new rendezvous round."""


class GatedHandler:
    """torchrun's c10d handler behind a gate: the first `next_rendezvous` waits until the
    gate file exists. The agent starts torchrun early (interpreter and torch imports take
    seconds) and opens the gate only when the head says the group has checkpointed, so a
    joining node enters the rendezvous as soon as it may and not a moment before.

    Once the agent has a notice it writes `<gate>.leaving`: from then on this torchrun
    refuses every new round (it exits instead of re-forming with the survivors when the
    group breaks mid-drain, e.g. a notice and a kill at once) and does not close the
    rendezvous on its way out (torchrun shuts the handler down on any non-signal error,
    which would close it for every node)."""

    def __init__(self, inner: object, gate: str):
        self._inner = inner
        self._gate = gate
        self._round_gen = -1  # the newest drain whose round count this torchrun has used

    def leaving(self) -> bool:
        import os

        return bool(self._gate) and os.path.exists(self._gate + ".leaving")

    def next_rendezvous(self):  # type: ignore[no-untyped-def]
        import os

        if self.leaving():
            raise NodeLeaving("this node has a preemption notice: it joins no new round")
        if self._gate and not os.path.exists(self._gate):
            # tell the agent we are ready; the head starts the group's drain only now
            open(self._gate + ".ready", "w").close()
        while self._gate and not os.path.exists(self._gate):
            if self.leaving():
                raise NodeLeaving("this node has a preemption notice: it joins no new round")
            time.sleep(0.05)
        # a drain's count is for the round right after it: a later round of this torchrun
        # (a kill's, with no drain before it) would wait for nodes that are gone
        gen, n = newest_round(self._gate) if self._gate else (-1, 0)
        _expected[0] = n if gen > self._round_gen else 0
        self._round_gen = max(self._round_gen, gen)
        return self._inner.next_rendezvous()  # type: ignore[attr-defined]

    def shutdown(self) -> bool:
        if self.leaving():
            return True  # leave the rendezvous open: the survivors go on without us
        return self._inner.shutdown()  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


RDZV_POLL_S = 0.1
# how long past torch's last call a round waits for the nodes the head announced
ROUND_HOLD_S = 10.0
_expected = [0]  # the size of the round this torchrun joins next (0: not known)


def newest_round(gate: str) -> tuple[int, int]:
    """The size of the group's next round the head expects, as (drain gen, nodes): the
    node agent names it at each drain in an empty file beside the gate,
    `<gate>.round-<drain gen>-<nodes>`; the newest drain's, or (-1, 0) when there is none."""
    import os

    folder, base = os.path.split(gate)
    prefix = base + ".round-"
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return (-1, 0)
    best = (-1, 0)
    for name in names:
        if name.startswith(prefix):
            gen, _, n = name[len(prefix):].partition("-")
            if gen.isdigit() and n.isdigit() and int(gen) > best[0]:
                best = (int(gen), int(n))
    return best


def _complete_when_expected() -> None:
    """torch's c10d rendezvous completes a round when max_nodes have joined, or else
    last_call_timeout (1 s here) after min_nodes had: every rescale waited that second,
    and a joiner whose torchrun came later than it (a loaded machine) missed the round and
    restarted the group a second time. With the count the head expects (newest_round), a
    participant completes the round as soon as that many are in, and holds it open for
    them up to ROUND_HOLD_S past torch's last call (an announced node that never comes
    costs that much, once). A node beyond them that comes later finds the round complete
    and waits for the next (torch's wait list, which restarts the group with it)."""
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    orig = dr._RendezvousJoinOp.__call__
    if getattr(orig, "_spotctl", False):
        return

    def call(self, ctx, deadline):  # type: ignore[no-untyped-def]
        st, n = ctx.state, _expected[0]
        if (n and not st.closed and not st.complete and ctx.node in st.participants
                and time.monotonic() <= deadline):
            if len(st.participants) >= n:
                return dr._Action.MARK_RENDEZVOUS_COMPLETE
            if (st.deadline is not None
                    and datetime.now(timezone.utc)
                    < st.deadline + timedelta(seconds=ROUND_HOLD_S)):
                # torch would complete it without them once its last call is over
                return dr._Action.KEEP_ALIVE if dr._should_keep_alive(ctx) else dr._Action.SYNC
        return orig(self, ctx, deadline)

    call._spotctl = True  # type: ignore[attr-defined]
    dr._RendezvousJoinOp.__call__ = call


def _cheap_event_names() -> None:
    """torch names each rendezvous event after its caller with inspect.stack(), which reads
    the source of every frame and walks sys.modules for each: in a torchrun forked by the
    warm zygote (torch._dynamo and the rest imported) one call took seconds of CPU on a
    loaded machine. A node late to a round then never got onto the wait list: its
    read-modify-write of the shared state outlasted the next keep-alive of the nodes in
    the round every time (seen: two of three nodes waiting for minutes). The same name
    from the frame itself."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if getattr(dr.get_method_name, "_spotctl", False):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    get_method_name._spotctl = True  # type: ignore[attr-defined]
    dr.get_method_name = get_method_name


def _fast_polls() -> None:
    """torch's c10d rendezvous polls its shared state once a second (a fixed `_delay(1)`
    and a 1 s state cache), which adds one to two seconds to every re-formation. A
    spot cluster is a few dozen nodes on one store: poll every 0.1 s instead."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    orig = dr._delay
    if getattr(orig, "_spotctl", False):
        return

    def delay(seconds):  # type: ignore[no-untyped-def]
        orig(RDZV_POLL_S if seconds == 1 else seconds)

    delay._spotctl = True  # type: ignore[attr-defined]
    dr._delay = delay


def get_handler():  # type: ignore[no-untyped-def]
    """Entry point (group `torchrun.handlers`, name `spotctl`): `--rdzv-backend=spotctl`."""
    import os

    from torch.distributed.elastic.rendezvous.api import RendezvousHandler
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    class _Gated(GatedHandler, RendezvousHandler):  # RendezvousHandler for isinstance checks
        def get_backend(self) -> str:
            return "spotctl"  # torch checks it against --rdzv-backend

        def is_closed(self) -> bool:
            return self._inner.is_closed()  # type: ignore[attr-defined,no-any-return]

        def set_closed(self) -> None:
            self._inner.set_closed()  # type: ignore[attr-defined]

        def num_nodes_waiting(self) -> int:
            return self._inner.num_nodes_waiting()  # type: ignore[attr-defined,no-any-return]

        def get_run_id(self) -> str:
            return self._inner.get_run_id()  # type: ignore[attr-defined,no-any-return]

        def shutdown(self) -> bool:
            return GatedHandler.shutdown(self)

        @property
        def use_agent_store(self) -> bool:
            return self._inner.use_agent_store  # type: ignore[attr-defined,no-any-return]

    def create(params):  # type: ignore[no-untyped-def]
        _fast_polls()
        _cheap_event_names()
        _complete_when_expected()
        inner = _create_c10d_handler(params)
        holder = getattr(inner, "_state_holder", None)
        if holder is not None and hasattr(holder, "_cache_duration"):
            # the state is re-read at most this often (torch: 1 s)
            holder._cache_duration = RDZV_POLL_S
        gate = os.environ.get("SPOTCTL_RDZV_GATE", "")
        if gate:
            # the pid this torchrun is listed under in the rendezvous, for the agent's leave:
            # forked by the zygote, torchrun is not the process the agent started
            node = getattr(inner, "_this_node", None)
            tmp = f"{gate}.pid.tmp"
            with open(tmp, "w") as f:
                f.write(str(getattr(node, "pid", os.getpid())))
            os.replace(tmp, f"{gate}.pid")
        return _Gated(inner, gate)

    return create


def get_node_handler():  # type: ignore[no-untyped-def]
    """Entry point (group `torchrun.handlers`, name `spotctl-node`): the torchft engine's
    replica group, `--nnodes=1 --rdzv-backend=spotctl-node --rdzv-endpoint=ADDR:PORT` for a
    group of one node; a group of K nodes adds `--nnodes=K --rdzv-conf=rank=R` (R: this
    node's slot in the group, 0 on the node at ADDR).

    torch's static rendezvous, whose store (torchrun's agent store: the group's workers
    meet in it, and the other replicas' workers meet in it when torchft picks this group's
    store for a quorum) listens on ADDR only instead of on every interface."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    class _Bound(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return "spotctl-node"  # torch checks it against --rdzv-backend

        def next_rendezvous(self):  # type: ignore[no-untyped-def]
            if not self._store and self.rank == 0:
                self._store = listening_store(
                    self.master_addr, self.master_port, world_size=self.world_size,
                    timeout=self.timeout, multi_tenant=True,
                )
                self.master_port = self._store.port
            return super().next_rendezvous()

    def create(params):  # type: ignore[no-untyped-def]
        if params.min_nodes != params.max_nodes:
            raise ValueError("--rdzv-backend=spotctl-node is a fixed group: --nnodes=K")
        # this node's slot (torchrun sets "rank" for the "static" backend only)
        rank = int(params.config.get("rank", 0))
        if not 0 <= rank < params.max_nodes:
            raise ValueError(f"rank {rank} is not a slot of a group of {params.max_nodes}")
        params.config["rank"] = rank
        handler = create_rdzv_handler(params)
        handler.__class__ = _Bound
        return handler

    return create
