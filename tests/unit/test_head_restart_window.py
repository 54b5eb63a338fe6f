"""A restarted head adopts the replica groups its nodes report (spotctl.head.groups) for a
few seconds after it starts; those seconds must count from when nodes can reach it."""

from __future__ import annotations

import time
from pathlib import Path


def test_a_restarted_heads_adoption_window_starts_when_nodes_can_reach_it(
    tmp_path: Path,
) -> None:  # fmt: skip
    """A restarted head adopts the replica groups its nodes report for a few seconds. The
    window counts from when the head serves, not from when it was built: building it
    (the Lighthouse, under load) once took longer than the window, every group was formed
    anew and every worker restarted (CI run W, tests/e2e/test_rescale.py's groups of
    two). Here the head is built, then serves a second later."""
    import threading

    from spotctl.head.server import HeadServer

    d = tmp_path / "headdir"
    d.mkdir()
    srv = HeadServer(d, "tok", with_store=False)
    time.sleep(1.0)  # a slow start
    t0 = time.time()
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not (d / "head.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert srv.coord.started_at >= t0, (srv.coord.started_at, t0)
    finally:
        srv.stop()
        t.join(5)
