"""ft_train.py with a straggler knob and the replica's own quorum log (tests and
scripts/bench; run by FtReplicas(script=...)).

FT_JITTER="p,lo,hi": before asking for a step's quorum, with probability p the replica
sleeps uniform(lo, hi) s: it is late to that quorum as a slow step, a save or a starved
core makes it, while its Manager keeps heartbeating. FT_QUORUM_LOG ("{replica}" in it: the replica's id): one JSON line per
quorum this replica got (worker 0 of the group only): when it asked and got it, the step
before and after it (after > before: the replica healed from a peer), the quorum
(`incarnation`: the Lighthouse's quorum id and spotctl's) and its number of replicas."""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from spotctl.elastic import ft
from tests.elastic import ft_train


def main() -> None:
    spec = os.environ.get("FT_JITTER", "")
    p, lo, hi = (float(v) for v in spec.split(",")) if spec else (0.0, 0.0, 0.0)
    rng = random.Random(f"{os.environ.get('SPOTCTL_FT_REPLICA_ID', '')}"
                        f"{os.environ.get('FT_JITTER_SEED', '0')}")
    path = os.environ.get("FT_QUORUM_LOG", "").replace(
        "{replica}", os.environ.get("SPOTCTL_FT_REPLICA_ID", "x"))
    out = open(path, "a", buffering=1) if path and not int(os.environ.get("LOCAL_RANK", "0")) \
        else None
    orig = ft.FtRun.next_step

    def next_step(self: Any) -> bool:
        slept = 0.0
        if p and rng.random() < p and not self.drain_requested:  # a notice: no delay
            slept = rng.uniform(lo, hi)
            time.sleep(slept)
        before, asked = self.step, time.time()
        more = orig(self)
        if out is not None:
            out.write(json.dumps({
                "asked": asked, "t": time.time(), "late_s": round(slept, 3),
                "step_before": before, "step": self.step, "quorum": self.incarnation,
                "replicas": self.replicas, "pid": os.getpid(),
            }) + "\n")
        return bool(more)

    ft.FtRun.next_step = next_step  # type: ignore[method-assign]
    ft_train.main()


if __name__ == "__main__":
    main()
