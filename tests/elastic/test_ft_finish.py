"""The end of training on the torchft engine when a replica vanished shortly before it.
The survivor's cross-replica group of the last quorum with the vanished replica still has
a collective in flight that only its own timeout ends (the watch gave the step up, the next
quorum dropped the group). run.finish() ends it while the interpreter is alive, and leaves
nothing running that could call into Python during the interpreter's shutdown: left to
that, a gloo thread or a timer taking the GIL aborts the process after training is done
(`terminate called without an active exception`, exit -6)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)
os.environ.setdefault("RUST_LOG", "warn")

from tests.elastic.ft_harness import FtReplicas  # noqa: E402

pytestmark = pytest.mark.slow
FREEZE_AT, M, TIMEOUT_S = 12, 15, 15


def test_finish_waits_out_a_dropped_group_and_leaves_no_thread(tmp_path: Path) -> None:
    # both replicas' first quorum has them both (as a new cluster starts)
    env = {"FT_FREEZE": f"g1:{FREEZE_AT}", "SPOTCTL_FT_TIMEOUT_S": str(TIMEOUT_S),
           "SPOTCTL_FT_START_REPLICAS": "2"}
    c = FtReplicas(tmp_path, M, every=100, delay=0.02)
    try:
        c.start("g0", extra_env={**env, "SPOTCTL_NODE_ID": "g0"})
        c.start("g1", extra_env={**env, "SPOTCTL_NODE_ID": "g1"})  # freezes at its step 12
        codes = c.finish(["g0"], timeout=120)
        assert codes == {"g0": 0}, c.output("g0")
        steps = c.steps("g0")
        done = c.finished("g0")
    finally:
        c.stop()
    # the survivor's own record: every step once, to the end, the last ones alone
    assert [s["step"] for s in steps] == list(range(1, M + 1))
    assert [s["replicas"] for s in steps] == [2] * (FREEZE_AT - 1) + [1] * (M - FREEZE_AT + 1)
    assert len({s["pid"] for s in steps}) == 1
    # finish() waited for the collective the frozen replica never joined to time out
    # (its step 12 began it; the watch gave the step up in seconds, well before the 15 s
    # timeout), rather than leaving it to end during the interpreter's shutdown
    assert 1.0 < done["finish_s"] < TIMEOUT_S + 10, done
    assert done["step"] == M
    assert done["threads"] == [], done
