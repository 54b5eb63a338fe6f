"""The overhead benchmark's reading of its runs: step gaps and CPU per step between
consecutive steps only, the warm-up left out (a gap across a missing step would count two
steps as one); the per-part profile of every rank; the per-round ratios and spread it
prints; the roles of a run's processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import overhead  # noqa: E402
from bench_lib.overhead import RunResult, cpu_gaps, gaps, parts_of, role, summary  # noqa: E402


def test_gaps_skip_warmup_and_missing_steps(tmp_path: Path) -> None:
    log = tmp_path / "steps.log"
    lines = [f"{100 + 0.5 * s:.4f} {s} 2 256 {0.4 * s:.4f} 0 0" for s in range(1, 13)]
    lines += ["110.0000 14 2 256 9.0", "110.3000 15 2 256 9.25", "garbage", "", "1 x"]
    log.write_text("\n".join(lines) + "\n")
    # steps 11->12 (0.5 s) and 14->15 (0.3 s); 12->14 skips a step; 1..10 are warm-up
    assert [round(g, 4) for g in gaps(log, warmup=10)] == [0.5, 0.3]
    assert [round(c, 4) for c in cpu_gaps(log, warmup=10)] == [0.4, 0.25]
    assert gaps(tmp_path / "missing.log") == []


def test_cpu_per_step_never_mixes_two_processes_clocks(tmp_path: Path) -> None:
    # torchft: the first rank moved to the other replica after step 12 (its own clock)
    log = tmp_path / "steps.log"
    log.write_text("111.0 11 2 256 5.0 4 1 100\n112.0 12 2 256 5.5 4 1 100\n"
                   "113.0 13 2 256 9.0 8 1 200\n114.0 14 2 256 9.6 8 1 200\n")
    assert gaps(log, warmup=10) == [1.0, 1.0, 1.0]
    assert [round(c, 3) for c in cpu_gaps(log, warmup=10)] == [0.5, 0.6]


def test_old_logs_without_cpu_give_wall_gaps_only(tmp_path: Path) -> None:
    log = tmp_path / "steps.log"
    log.write_text("".join(f"{100 + s}.0 {s} 2 256\n" for s in range(1, 14)))
    assert gaps(log, warmup=10) == [1.0, 1.0]
    assert cpu_gaps(log, warmup=10) == []


def test_parts_medians_over_every_rank(tmp_path: Path) -> None:
    log = tmp_path / "steps.log"
    (tmp_path / "steps.log.11.parts").write_text(
        "10 next_step=9/9 forward=9/9\n"  # warm-up: left out
        "11 next_step=0.002/0.001 forward=0.1/0.09\n12 next_step=0.004/0.001 forward=0.3/0.1\n")
    (tmp_path / "steps.log.12.parts").write_text("11 next_step=0.003/0.002 forward=0.2/0.1\n")
    got = parts_of(log, warmup=10)
    assert got["next_step"] == (0.003, 0.001)
    assert got["forward"] == (0.2, 0.1)


def _res(name: str, step: float, cpu: float) -> RunResult:
    return RunResult(name, step, cpu, 20, 1.0, 0.5, [], {"worker": 1.9},
                     {"forward": (0.1, 0.1)})


def test_summary_prints_each_round_and_the_spread_of_ratios() -> None:
    rounds = [{"plain": _res("plain", 0.40, 0.40), "torchft": _res("torchft", 0.50, 0.42),
               "torchrun": _res("torchrun", 0.40, 0.40)},
              {"plain": _res("plain", 0.44, 0.40), "torchft": _res("torchft", 0.40, 0.40),
               "torchrun": _res("torchrun", 0.44, 0.44)}]
    text = "\n".join(summary(rounds))
    assert "round 1  torchft: step 0.500 s" in text
    assert "plain/torchft wall 0.800" in text and "plain/torchft wall 1.100" in text
    # the two rounds' ratios 0.8 and 1.1: median 0.95, -15.8 %..+15.8 % of it
    assert "torchft: speed as a fraction of plain DDP's, wall 0.950 (0.800..1.100, " \
           "-15.8 %..+15.8 %)" in text
    assert "torchrun: speed as a fraction of plain DDP's, wall 1.000 (1.000..1.000" in text
    assert "cores: worker" in text and "forward" in text


def test_summary_reads_each_engine_against_plain_with_the_same_malloc_settings() -> None:
    """spotctl's workers keep freed memory (elastic.keep_freed_memory); plain DDP does not,
    so each engine is also read against plain DDP with the same setting (issue 58)."""
    rounds = [{"plain": _res("plain", 0.60, 0.55), "plain-keep": _res("plain-keep", 0.50, 0.48),
               "torchft": _res("torchft", 0.52, 0.50), "torchrun": _res("torchrun", 0.50, 0.48)}]
    text = "\n".join(summary(rounds))
    assert "plain/plain-keep wall 1.200" in text
    assert "plain-keep/torchft wall 0.962, CPU 0.960" in text
    assert "torchft: speed as a fraction of plain DDP's with spotctl's malloc settings, " \
           "wall 0.962" in text
    assert "torchft: speed as a fraction of plain DDP's, wall 1.154" in text
    assert "plain-keep/plain" not in text and "plain-keep/plain-keep" not in text


def test_plain_keep_sets_what_the_workers_set() -> None:
    from spotctl.elastic import MALLOC_MMAP_BYTES, MALLOC_TRIM_BYTES

    assert overhead.keep_env() == {"MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_BYTES),
                                   "MALLOC_TRIM_THRESHOLD_": str(MALLOC_TRIM_BYTES)}


def test_roles_and_cores_of_a_run() -> None:
    assert role("python -m spotctl.head.lighthouse 127.0.0.1 0") == "lighthouse"
    assert role("python -m spotctl.cli.app head --dir x --supervise") == "head"
    assert role("python -m spotctl.agent.launch -m torch.distributed.run") == "launcher"
    assert role("/v/bin/torchrun --standalone train.py") == "torchrun agent"
    assert role("python -m spotctl.cli.app agent --config c.json") == "spotctl agent"
    assert role("python -m spotctl.providers.local.vm /d") == "local VM (metadata)"
    probe = overhead.LoadProbe()
    me = os.getpid()
    probe.procs = {me: [(10.0, 1.0), (12.0, 2.0)], 99: [(10.0, 0.0), (12.0, 0.1)]}
    probe.cmd = {99: "python -m spotctl.cli.app agent --config c.json"}
    assert probe.cores(10.0, 12.0, workers={me}) == {"worker": 0.5, "spotctl agent": 0.05}
