"""The torchft quorum holds still (real torchrun replica groups on CPU/gloo, the head's
Lighthouse module with its default timing): a straggler, a replica whose steps are now and
then 0.5-1.5 s late to the quorum while its Manager keeps heartbeating, is waited for, not
left out and healed back; the replicas started together form their first quorum together;
and the pauses at a notice, a kill and a join stay small. Judged by the replicas' own
quorum and step logs (tests/elastic/ft_jitter_train.py)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)
os.environ.setdefault("RUST_LOG", "warn")

from tests.conftest import documented_median  # noqa: E402
from tests.elastic.ft_harness import FtReplicas, pause_at  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("ft_jitter_train.py")
JITTER = "0.08,0.5,1.5"  # 8 % of its steps 0.5-1.5 s late to the quorum
M = 320


def quorums(tmp: Path, name: str) -> list[dict[str, Any]]:
    p = tmp / f"{name}.quorums.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def test_straggler_is_waited_for_and_notice_kill_join_pause_briefly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_QUORUM_LOG", str(tmp_path / "{replica}.quorums.jsonl"))
    # what the local provider tells the nodes it launched together (r3 joins later)
    monkeypatch.setenv("SPOTCTL_FT_START_REPLICAS", "3")
    c = FtReplicas(tmp_path, M, every=50, delay=0.02, script=SCRIPT)
    try:
        c.start("r0")
        c.start("r1")
        monkeypatch.setenv("FT_JITTER", JITTER)
        c.start("r2")  # the straggler
        monkeypatch.delenv("FT_JITTER")
        c.start("r3", gated=True)  # pre-started joiner: imports done, waits at the gate
        c.wait("150 steps with the straggler", lambda: c.last_step("r0") >= 150, timeout=150)

        def steps_at(n: int, after: float) -> int:
            return sum(1 for s in c.steps("r0") if s["t"] > after and s["replicas"] == n)

        t_notice = c.notice("r2")
        c.wait("survivors past the leave", lambda: steps_at(2, t_notice) >= 8)
        t_kill = c.kill("r1")
        c.wait("survivor past the kill", lambda: steps_at(1, t_kill) >= 8)
        t_join = c.open_gate("r3")
        c.wait("joiner training", lambda: len(c.steps("r3")) >= 3)
        codes = c.finish(["r2", "r0", "r3"])
        assert codes == {"r2": 0, "r0": 0, "r3": 0}, c.output("r0") + c.output("r3")
        left_at = c.last_step("r2")
        q = {n: quorums(tmp_path, n) for n in ("r0", "r1", "r2", "r3")}
        logs = {n: c.steps(n) for n in ("r0", "r1", "r2", "r3")}
    finally:
        c.stop()

    # started together: every replica's first quorum had all three (no one plus heals)
    for n in ("r0", "r1", "r2"):
        assert q[n][0]["replicas"] == 3 and q[n][0]["step_before"] == 0, (n, q[n][:3])
    # until the notice: one quorum, nobody healed, although the straggler was late
    before = {n: [x for x in q[n] if x["step_before"] < left_at] for n in ("r0", "r1", "r2")}
    ids = {x["quorum"] for n in before for x in before[n]}
    assert len(ids) == 1, sorted(ids)
    assert all(x["step"] == x["step_before"] for n in before for x in before[n])
    late = [x for x in before["r2"] if x["late_s"] >= 0.5]
    assert len(late) >= 3, "the straggler was not late often enough to prove anything"
    # after it: exactly the three membership changes (3 -> 2, 2 -> 1, 1 -> 2), in r0's view
    seq = [x["replicas"] for x in q["r0"]]
    changes = [(a, b) for a, b in zip(seq, seq[1:], strict=False) if a != b]
    assert changes == [(3, 2), (2, 1), (1, 2)], changes
    r0_ids = [x["quorum"] for x in q["r0"]]
    assert len(set(r0_ids)) == 4, "a regroup without a membership change"
    # nothing lost or repeated on the survivor
    r0 = [s["step"] for s in logs["r0"]]
    assert r0 == list(range(1, M + 1)), r0
    pn = pause_at(logs["r0"], t_notice, 2)
    pk = pause_at(logs["r0"], t_kill, 1)
    pj = pause_at(logs["r0"], t_join, 2)
    print(f"late quorums {len(late)}; pauses (s): notice {pn:.3f} kill {pk:.3f} join {pj:.3f}")
    # generous bounds on a loaded 2-core machine (goals 0.3 / 1 / 0.2 s); the join's is
    # twice the docs' join pause (a doubling fails), scaled by how much slower than the
    # docs' notice pause this run's was: the load calibrates it, a slower join alone fails
    slow = max(1.0, pn / documented_median("torchft: pause at a notice"))
    join_most = 2 * documented_median("torchft: training pause at a join") * slow
    assert pn < 1.0 and pk < 2.0 and pj < join_most, (pn, pk, pj, join_most)
