"""The overhead benchmark's step-log reading: gaps between consecutive steps only, the
warm-up left out (a gap across a missing step would count two steps as one)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib.overhead import gaps  # noqa: E402


def test_gaps_skip_warmup_and_missing_steps(tmp_path: Path) -> None:
    log = tmp_path / "steps.log"
    lines = [f"{100 + 0.5 * s:.4f} {s} 2 256" for s in range(1, 13)]
    lines += ["110.0000 14 2 256", "110.3000 15 2 256", "garbage", ""]
    log.write_text("\n".join(lines) + "\n")
    got = gaps(log, warmup=10)
    # steps 11->12 (0.5 s) and 14->15 (0.3 s); 12->14 skips a step; 1..10 are warm-up
    assert [round(g, 4) for g in got] == [0.5, 0.3]
    assert gaps(tmp_path / "missing.log") == []
