"""spotctl.elastic end to end on real gloo groups: a 2-level FSDP2 model (fully_shard on a
CPU mesh) trained with AdamW, an LR scheduler and micro-batches at world sizes that do not
divide the batch, rescaled 3 -> 2 -> 3 through drains, has the loss trajectory of plain
single-process training; so does a DDP run fed by a DataLoader with workers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spotctl.elastic.checkpoint import committed_steps  # noqa: E402
from tests.elastic.harness import launch, plain_losses, plain_run  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _check(recorded: dict, ref: list[float]) -> None:
    for step, loss in recorded.items():
        assert loss == pytest.approx(ref[int(step) - 1], rel=1e-4, abs=1e-6), step


def test_auto_micro_batches_keep_their_size_when_the_cluster_shrinks(tmp_path, monkeypatch):
    """micro_batch="auto" (what an unset one means on CUDA) in a cluster of at most 4
    ranks (the agent's SPOTCTL_MAX_WORLD), trained at 4 then, through a drain, at 2:
    every forward/backward holds at most the 4-rank share (3 samples of 10), the smaller
    world runs more of them, and the losses are plain training's."""
    monkeypatch.setenv("SPOTCTL_MAX_WORLD", "4")
    cfg = {"n": 64, "batch": 10, "seed": 3, "steps": 9, "every": 4, "micro": "auto",
           "root": str(tmp_path / "ck"), "fsdp": True, "user": True}
    ref = plain_losses(cfg)
    a = launch(4, {**cfg, "out": str(tmp_path / "a"), "drain_at": 3})
    b = launch(2, {**cfg, "out": str(tmp_path / "b")})
    assert [a[0]["end"], b[0]["end"]] == ["drained@4", "finished"]
    counts, offset = {}, 0  # each step's samples: 10, but 4 at the end of an epoch of 64
    for step in range(1, 10):
        counts[step] = min(10, 64 - offset)
        offset = (offset + counts[step]) % 64
    for part, world in ((a, 4), (b, 2)):
        for rec in part:
            for step, sizes in rec["micro"].items():
                share = -(-counts[int(step)] // world)
                assert max(sizes) <= 3, (world, step, sizes)  # ceil(10 / 4)
                assert len(sizes) == -(-share // 3), (world, step, sizes)
    assert b[0]["micro"]["6"] == [3, 2]  # a full step at 2 ranks: two of at most 3
    _check({**a[0]["losses"], **b[0]["losses"]}, ref)


def test_fsdp2_rescale_3_2_3_matches_plain_training(tmp_path):
    # "user": a GradScaler, clipping (below every step's norm) and a norm log, as scripts do
    cfg = {"n": 64, "batch": 10, "seed": 3, "steps": 14, "every": 5, "micro": 2,
           "root": str(tmp_path / "ck"), "fsdp": True, "user": True}
    ref, ref_norms = plain_run(cfg)
    a = launch(3, {**cfg, "out": str(tmp_path / "a"), "drain_at": 4, "drain_rank": 2})
    # the drain flag is agreed asynchronously: a notice seen during step 5 drains after it,
    # on every rank at the same step; step 5 was committed by the periodic save already
    # (every=5) and is not written again
    assert [r["end"] for r in a] == ["drained@5"] * 3 and a[0]["resume"] == 0
    b = launch(2, {**cfg, "out": str(tmp_path / "b"), "drain_at": 9})
    assert b[0]["resume"] == 5 and b[0]["counter"] == 5  # user state carried
    assert b[0]["lr"] == pytest.approx(0.05 / (1 + 0.3 * 5))  # scheduler carried
    assert [r["end"] for r in b] == ["drained@10"] * 2
    c = launch(3, {**cfg, "out": str(tmp_path / "c")})
    assert c[0]["resume"] == 10 and c[0]["end"] == "finished"
    losses = {**a[0]["losses"], **b[0]["losses"], **c[0]["losses"]}
    assert sorted(map(int, losses)) == list(range(1, 15))  # no step lost or repeated
    _check(losses, ref)
    # the norm user code clipped was the global gradient's, at every world size
    norms = {**a[0]["norms"], **b[0]["norms"], **c[0]["norms"]}
    assert min(ref_norms) > 0.5
    for step, norm in norms.items():
        assert norm == pytest.approx(ref_norms[int(step) - 1], rel=1e-4), step
    # run.is_main: rank 0 alone
    assert all(all(r["main"].values()) == (i == 0) for i, r in enumerate(c))
    assert committed_steps(cfg["root"])[0] == 14


def test_dataloader_workers_ddp_drain_resume_same_world(tmp_path):
    cfg = {"n": 40, "batch": 7, "seed": 5, "steps": 8, "every": 100, "micro": 3,
           "root": str(tmp_path / "ck"), "loader": 2}
    ref = plain_losses(cfg)
    a = launch(2, {**cfg, "out": str(tmp_path / "a"), "drain_at": 3, "drain_rank": 1})
    b = launch(2, {**cfg, "out": str(tmp_path / "b")})
    assert b[0]["resume"] == 4
    _check({**a[0]["losses"], **b[0]["losses"]}, ref)
    # RNG state per rank carried: the draws after the resume are those an uninterrupted
    # run makes (torch.rand after every step, different per rank)
    u = launch(2, {**cfg, "out": str(tmp_path / "u"), "root": str(tmp_path / "ck2")})
    for r in range(2):
        assert b[r]["rand"] == {k: v for k, v in u[r]["rand"].items() if int(k) > 4}
    assert b[0]["rand"] != b[1]["rand"]
    # resuming with another global batch: one line naming it, nothing trained
    m = launch(1, {**cfg, "out": str(tmp_path / "m"), "batch": 8})
    assert m[0]["end"].startswith("mismatch: spotctl.elastic: checkpoint step 8 ")
    assert "global_batch=7, this run has global_batch=8" in m[0]["end"]
    assert "\n" not in m[0]["end"]
