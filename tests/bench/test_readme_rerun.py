"""A short form of one README figure, rerun: "step time with nothing failing, 2 ranks, MLP
6x2048" (scripts/bench overhead: plain DDP under torchrun, then the same loop through
spotctl's torchrun engine on a local cluster, from the first rank's own step log; since
issue 58 the loop is train_steady.py, the README's figure is from the earlier loop). The
README's run gave the engine 0.53 s a step against plain DDP's 0.6 s (ratio 0.88, run 5 of
its table). Absolute step times follow the machine's load, so the bound is on the ratio of
the two, measured in the same test one after the other: at most 1.6, which a doubling of
what spotctl costs a step (1.77) passes. Measured here on 2026-12-07 at load 21-25 on 2
shared cores: 7.0 s against 5.0 s a step (ratio 1.40), 380 s in all; on an idle machine
the README's step times make it about a minute. Not a figure for the docs: a check that
the published one still holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import overhead  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS = overhead.WARMUP + 9  # 8 step gaps after the warm-up


def test_readme_step_time_short_form(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    plain = overhead.plain(tmp_path / "plain", 2, STEPS, 2048)
    engine = overhead.on_spotctl(tmp_path / "torchrun", 2, STEPS, 2048, "torchrun")
    assert plain.steps >= 6 and engine.steps >= 6, (plain, engine)
    ratio = engine.step_s / plain.step_s
    print(f"step time: {engine.describe()}; {plain.describe()}; ratio {ratio:.2f}")
    assert ratio <= 1.6, (ratio, engine, plain)
