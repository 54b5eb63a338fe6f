"""scripts/bench network on a local cluster (gloo): the all-reduce bus bandwidth between its
nodes, next to plain torchrun's on one host. Shape only, no timing asserts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import network  # noqa: E402
from bench_lib.core import Context  # noqa: E402


@pytest.mark.slow  # a 2-node local cluster and a plain torchrun job
def test_network_bench_measures_all_reduce_between_the_nodes(tmp_path: Path) -> None:
    ctx = Context(repeat=1, work=tmp_path / "work", out=tmp_path / "out", quiet=True)
    rows = network.bench(ctx, ranks=2, sizes=(1 << 16, 1 << 20), iters=2)
    assert [r.metric for r in rows] == ["all-reduce bus bandwidth, 64 KiB",
                                        "all-reduce bus bandwidth, 1 MiB"]
    for r in rows:
        assert r.unit == "GB/s" and "gloo" in r.note
        assert r.spotctl is not None and r.spotctl.n == 1 and r.spotctl.median > 0
        assert r.baseline is not None and r.baseline.median > 0
        json.dumps(r.to_json())
    # the cluster's result came from a 2-rank world across its two nodes, and nothing is left
    (res,) = [json.loads(p.read_text())
              for p in (tmp_path / "work").glob("network-spotctl-*/net.json")]
    assert res["world"] == 2 and res["backend"] == "gloo" and len(res["rows"]) == 2
    from spotctl.agent import proctree

    assert proctree.tagged_prefix(str(ctx.work) + "/") == []
