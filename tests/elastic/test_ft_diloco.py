"""[train] sync = "diloco" on the torchft engine, with real torchrun replica groups on
CPU/gloo and the head's Lighthouse: groups train on their own and sync every H steps
through torchft's Manager. Through a notice with a long lead (on_notice = "auto": the
group leaves at the next sync), a kill mid-round (the round's sync fails for everyone;
every group rewinds to the round's start and trains it again without the dead one), a
join (heals from a live group at the next sync) and a notice with a short lead mid-round
(on_notice = "auto": the group leaves now, its round's local steps dropped, said in its
report; the survivor's sync of that round fails and it trains the round again), judged
by each worker's own step records (tests/elastic/ft_train.py) and report: no
sync lost, every group's outer step equal at each sync, the parameters identical across
groups after each sync (each worker's own digest of its parameters), every step's samples
the global batch exactly once, and no quorum inside a round."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)
os.environ.setdefault("RUST_LOG", "warn")

from spotctl.elastic.data import ElasticBatchSampler  # noqa: E402
from tests.elastic.ft_harness import FtReplicas, reference_steps  # noqa: E402

pytestmark = pytest.mark.slow
H, M = 4, 96
FREEZE = 30  # g1's step that never ends (mid-round: 29..32)
N, BATCH, SEED = 512, 16, 3  # ft_train.py's dataset, global batch and seed


def _syncs(steps: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A group's committed syncs: its record of each step that ended a round (a redone
    step's last record counts: the one before was rewound)."""
    return {s["step"]: s for s in steps if "rewound" not in s and s["step"] % H == 0}


def test_diloco_through_a_notice_a_kill_and_a_join(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCTL_SYNC", "diloco")
    monkeypatch.setenv("SPOTCTL_SYNC_EVERY", str(H))
    c = FtReplicas(tmp_path, M, every=8, delay=0.04)
    try:
        # a new cluster's groups start together (the agent sets this): one first quorum;
        # g1 stops itself at the start of step FREEZE, in the middle of a round
        for n in ("g0", "g1", "g2"):
            c.start(n, extra_env={"SPOTCTL_FT_START_REPLICAS": "3", "SPOTCTL_NODE_ID": n,
                                  "FT_FREEZE": f"g1:{FREEZE}",
                                  "SPOTCTL_NOTICE_FILE": str(tmp_path / f"{n}.notice.json")})
        # the notice files: each group's own, as the agent writes it beside SIGUSR1
        notices = {n: tmp_path / f"{n}.notice.json" for n in ("g0", "g3")}
        c.start("g3", gated=True, extra_env={  # pre-started joiner: waits at the gate
            "SPOTCTL_NOTICE_FILE": str(notices["g3"]),
            "SPOTCTL_STATUS_DIR": str(tmp_path / "g3-status"),
            "FT_NOTICE_GATE": str(tmp_path / "g3.notice-go")})
        (tmp_path / "g3-status").mkdir()
        c.wait("three groups synced together",
               lambda: all(any(s["replicas"] == 3 and s["step"] % H == 0 for s in c.steps(n))
                           for n in ("g0", "g1", "g2")))
        # g0: a notice whose lead (10 min) covers the round: it leaves at the next sync,
        # with nothing unsynced (g0 was started without a notice file: set it now)
        notices["g0"].write_text(json.dumps({"deadline": time.time() + 600}))
        c.notice("g0")
        # then g1 is killed in the middle of a round of g1 and g2
        c.wait("g1 in its last round", lambda: c.last_step("g1") >= FREEZE - 1)
        c.kill("g1")
        c.open_gate("g3")  # it joins at a sync of g2 (after the failed one, or later)
        c.wait("the failed sync rewound", lambda: any("rewound" in s for s in c.steps("g2")))
        c.wait("the joiner synced", lambda: any(s["step"] % H == 0 for s in c.steps("g3")),
               timeout=180)
        # g3: a notice whose lead (1 s) is short of twice the time to its round's sync plus
        # 5 s, given at its round's second step (FT_NOTICE_GATE): it leaves after that step
        notices["g3"].write_text(json.dumps({"deadline": time.time() + 1}))
        (tmp_path / "g3.notice-go").touch()
        codes = c.finish(["g0", "g2", "g3"])
        assert codes == {"g0": 0, "g2": 0, "g3": 0}, (
            c.output("g0") + c.output("g2") + c.output("g3"))
        logs = {n: c.steps(n) for n in ("g0", "g1", "g2", "g3")}
        left_at = logs["g0"][-1]["step"]
        g3_report = json.loads((tmp_path / "g3-status" / "worker-0.json").read_text())
    finally:
        c.stop()

    # each group's record: steps one after another, except where a failed sync took it back
    # to its round's start (a multiple of H)
    for name, steps in logs.items():
        prev = steps[0]["step"] - 1
        for s in steps:
            if "rewound" in s:
                assert s["rewound"] == prev + 1 and s["step"] == s["rewound"] - H, (name, s)
            else:
                assert s["step"] == prev + 1, (name, prev, s)
            prev = s["step"]
    # the notice: g0 left right after a sync the others applied too
    assert left_at % H == 0 and any(s["replicas"] == 3 for s in logs["g0"])
    # the kill: the survivor's sync of that round failed once, and it trained the round
    # again alone (the dead group's samples too), then synced with the joiner
    rewinds = [s for s in logs["g2"] if "rewound" in s]
    killed_in = logs["g1"][-1]["step"] + 1
    assert left_at < killed_in - H, (left_at, killed_in)  # (a round of two groups)
    assert len(rewinds) == 2 and rewinds[0]["step"] < killed_in <= rewinds[0]["rewound"], (
        killed_in, rewinds)
    # the short notice: g3 left two steps into a round, those two local steps dropped (its
    # own records and its report say so); g2's sync of that round failed and it trained
    # the round again alone
    g3_left = logs["g3"][-1]["step"]
    assert g3_left % H == 2, g3_left
    assert (g3_report["phase"], g3_report["notice_dropped"], g3_report["drain_step"]) == (
        "drained", 2, g3_left - 2), g3_report
    assert g3_report["outer_step"] == (g3_left - 2) // H, g3_report
    assert rewinds[1]["step"] == g3_left - 2 < g3_left < rewinds[1]["rewound"], rewinds
    assert 0 < rewinds[0]["dropped"] <= H
    redo = [s for s in logs["g2"] if "rewound" not in s and s["t"] > rewinds[0]["t"]]
    assert redo[0]["step"] == rewinds[0]["step"] + 1  # the round again, without g1
    assert logs["g3"][0]["healed"] is not None and logs["g3"][0]["step"] > rewinds[0]["step"]
    assert any(s["replicas"] == 2 for s in logs["g3"])

    syncs = {n: _syncs(steps) for n, steps in logs.items()}
    # no sync lost: the survivor committed every one, H, 2H, ... M, each one outer step
    assert sorted(syncs["g2"]) == list(range(H, M + 1, H))
    for step in range(H, M + 1, H):
        at = {n: s[step] for n, s in syncs.items() if step in s}
        # every group that synced there: the same outer step, the same parameters, and as
        # many groups as that round's quorum had
        assert {s["outer"] for s in at.values()} == {step // H}, (step, at)
        assert len({s["digest"] for s in at.values()}) == 1, (step, at)
        assert {s["replicas"] for s in at.values()} == {len(at)}, (step, at)
    # the groups stayed in step: no quorum inside a round (only at its first step)
    for name, steps in logs.items():
        inside = [s["quorum_s"] for s in steps if "rewound" not in s and (s["step"] - 1) % H]
        assert inside and all(q == 0.0 for q in inside), name
    # every step's samples, over the groups whose round of it synced: the global batch,
    # once (a round rewound, or cut short by the kill, counts for no group)
    want = list(ElasticBatchSampler(N, BATCH, SEED, 1, 0, max_steps=M))
    final: dict[int, list[int]] = {}
    for steps in logs.values():
        pending: list[dict[str, Any]] = []
        for s in steps:
            if "rewound" in s:
                pending = []
                continue
            pending.append(s)
            if s["step"] % H == 0:
                for p in pending:
                    final.setdefault(p["step"], []).extend(p["idx"])
                pending = []
    for k in range(1, M + 1):
        assert sorted(final[k]) == sorted(want[k - 1]), k
    # checkpoints were written at syncs only (they hold the synced parameters)
    saved = [int(p.name.rsplit("-", 1)[-1]) for p in (tmp_path / "ckpt").iterdir()
             if p.name.rsplit("-", 1)[-1].isdigit()]
    assert saved and all(k % H == 0 for k in saved), saved


def test_localsgd_every_step_is_ddp_on_the_engine(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The math through the engine's wiring (each group's share of the batch, its loss
    scale, the sync): two groups on localsgd with sync_every=1 and SGD with momentum (an
    update linear in the gradient) train as one process on the whole batch does, step
    for step (tests/unit/test_outer_sync.py has the algebra, and why Adam would differ)."""
    monkeypatch.setenv("FT_OPT", "sgd")
    steps = 16
    ref = reference_steps(tmp_path, steps)  # one process, sync = ddp
    monkeypatch.setenv("SPOTCTL_SYNC", "localsgd")
    monkeypatch.setenv("SPOTCTL_SYNC_EVERY", "1")
    c = FtReplicas(tmp_path, steps, every=100, delay=0.0)
    try:
        for n in ("a", "b"):
            c.start(n, extra_env={"SPOTCTL_FT_START_REPLICAS": "2"})
        assert c.finish(["a", "b"]) == {"a": 0, "b": 0}, c.output("a") + c.output("b")
        logs = {n: c.steps(n) for n in ("a", "b")}
    finally:
        c.stop()
    assert sum(s["replicas"] == 2 for s in logs["a"]) >= steps // 2, logs["a"]
    for name, recs in logs.items():
        for s in recs:
            assert s["outer"] == s["step"], (name, s)
            want = ref[s["step"]]["full_loss"]
            assert math.isclose(s["full_loss"], want, rel_tol=1e-5, abs_tol=1e-7), (
                name, s["step"], s["full_loss"], want)
