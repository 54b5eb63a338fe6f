"""What a torchft replica reports to its agent (and so the head) before its first quorum: a
replica that is starting, or waiting to join, is in no worker group yet. Its report says
phase "init", which the head never takes for a new group; a report of phase "train" (rank 0,
world 1, torchrun's incarnation) made the head drop the running quorum's group for it while
a joiner started (seen in the torchft rebalance e2e: status at world 1, the join recorded as
1 -> 3). A real torchrun replica group against the head's Lighthouse module."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)
os.environ.setdefault("RUST_LOG", "warn")

from tests.elastic.ft_harness import FtReplicas  # noqa: E402
from tests.unit.test_coordinator import hb, training  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _report(status: Path) -> dict | None:
    try:
        return json.loads((status / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None


def test_a_replica_reports_init_until_its_first_quorum(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    c = FtReplicas(tmp_path, max_steps=1_000_000, every=1_000_000, delay=0.02)
    monkeypatch.setenv("SPOTCTL_FT_MIN_REPLICAS", "2")  # no quorum until both are there
    status = {n: tmp_path / f"status-{n}" for n in ("a", "b")}
    try:
        for n in ("a", "b"):
            status[n].mkdir()
        monkeypatch.setenv("SPOTCTL_STATUS_DIR", str(status["a"]))
        c.start("a")
        c.wait("a's first report", lambda: _report(status["a"]) is not None, timeout=120)
        first = _report(status["a"])
        assert first is not None and first["phase"] == "init", first
        assert c.steps("a") == []  # it has trained nothing: still waiting for its quorum
        # the head keeps the running group when such a report comes in
        clk, coord = training(["x", "y"], "ft-q1", 10, engine="torchft")
        hb(coord, "a", workers=[{**first, "first_step_at": None}])
        assert coord.incarnation is not None and coord.incarnation["id"] == "ft-q1"
        monkeypatch.setenv("SPOTCTL_STATUS_DIR", str(status["b"]))
        c.start("b")
        c.wait("both training in one quorum",
               lambda: all(any(s["replicas"] == 2 for s in c.steps(n)) for n in ("a", "b")),
               timeout=180)
        c.wait("a train report", lambda: (_report(status["a"]) or {}).get("phase") == "train",
               timeout=30)
        now = _report(status["a"])
        assert now is not None and now["world_size"] == 2 and now["incarnation"].startswith("ft-q")
    finally:
        c.stop()

