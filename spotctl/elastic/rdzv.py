"""Take a stopped torchrun agent out of the c10d rendezvous at once.

A SIGTERMed torchrun agent does not close the rendezvous (good) but stays a participant
until its keep-alive expires (keep_alive_interval x keep_alive_max_attempt), which would
hold the survivors' next round for that long. The node's spotctl agent knows the torchrun
pid and address, so after torchrun exits it runs the rendezvous' own exit operation for
that node descriptor. This uses torch's private rendezvous classes (pinned torch 2.13;
tests/e2e cover it).
"""

from __future__ import annotations

import time
from datetime import timedelta


def leave_rendezvous(
    store_host: str, store_port: int, run_id: str, addr: str, pid: int, timeout_s: float = 10.0
) -> bool:
    """Remove node (addr, pid, local_id 0) from the rendezvous participants/wait list.

    Returns True when the node is no longer listed.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters  # noqa: F401
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

    executor.run(leave_op, time.monotonic() + timeout_s)
    holder.sync()
    st = holder.state
    return node not in st.participants and node not in st.wait_list
