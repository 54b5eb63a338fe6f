"""The 16-node AWS trace's goodput figures (docs/figures/goodput.json, rendered into the
benchmarks page) are what the simulator computes; the other traces are checked in the
fast set (tests/unit/test_docs_figures.py). Slow: this trace takes ~8 s per engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import figures  # noqa: E402

TRACE = "aws-16node-08-27-2023_us-west-2a_v100_1"


@pytest.mark.slow
def test_goodput_of_the_16_node_trace_is_the_simulators() -> None:
    g = figures.read_goodput()
    sim = figures.simulate_goodput(g, only=[TRACE])
    for e in ("torchft", "torchrun"):
        want = [r for r in g[e]["rows"] if r["trace"] == TRACE]
        assert len(want) == 1 and sim[e] == want, e
