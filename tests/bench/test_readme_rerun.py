"""A short form of one README figure, rerun: "step time with nothing failing, 2 ranks, MLP
6x2048" (`scripts/bench overhead`: plain DDP under torchrun, then the same loop,
train_steady.py, through spotctl's torchrun engine and its torchft engine on a local
cluster, each from the first rank's own step log). Absolute step times follow the
machine's load, so each bound is on an engine's step time over plain DDP's, measured in
the same test one after the other: under twice the ratio of the README's run
(docs/figures/bench-results.json; 0.54 / 0.526 s and 0.626 / 0.526 s on 2026-12-07), so a
doubling of the step time fails. The torchrun engine's ratio was 1.40 here on 2026-12-07
at load 21-25 on 2 shared cores (380 s in all); on an idle machine the README's step
times make the test about a minute and a half. Not a figure for the docs: a check that the
published one still holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import overhead  # noqa: E402

from tests.conftest import documented_ratio  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = overhead.WARMUP + 9  # 8 step gaps after the warm-up


def test_readme_step_time_short_form(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    plain = overhead.plain(tmp_path / "plain", 2, STEPS, 2048)
    assert plain.steps >= 6, plain
    seen = []
    for engine in ("torchrun", "torchft"):
        got = overhead.on_spotctl(tmp_path / engine, 2, STEPS, 2048, engine)
        assert got.steps >= 6, (engine, got)
        ratio = got.step_s / plain.step_s
        most = 2 * documented_ratio(f"{engine}: step time vs plain DDP")
        print(f"step time: {got.describe()}; {plain.describe()}; ratio {ratio:.2f} "
              f"(at most {most:.2f})")
        seen.append((engine, ratio, most, got))
    assert all(ratio < most for _, ratio, most, _ in seen), (seen, plain)
