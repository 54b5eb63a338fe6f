"""The data order of spotctl.elastic (spotctl/elastic/data.py), on its own: a step's fixed
global batch split over the ranks, micro-batches of equal count on every rank, the
per-epoch permutation (pinned: a checkpoint resumes into the order it was saved with), and
the DataLoader batch sampler walking the same order from a saved position."""

from __future__ import annotations

import itertools

import torch

from spotctl.elastic.data import (
    ElasticBatchSampler,
    PermutationCache,
    empty_like_batch,
    epoch_permutation,
    micro_slices,
    split_batch,
)


def test_split_batch_covers_the_step_in_contiguous_shares_larger_first() -> None:
    for count, world in itertools.product(range(0, 23), range(1, 7)):
        shares = [split_batch(count, world, r) for r in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == count, (count, world, shares)
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
        sizes = [b - a for a, b in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes
    assert [split_batch(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_micro_slices_same_count_on_every_rank_each_at_most_micro_batch() -> None:
    for count, world, mb in itertools.product(range(0, 19), range(1, 6), (None, 1, 2, 3, 7)):
        per_rank = [micro_slices(count, world, r, mb) for r in range(world)]
        largest = -(-count // world)
        want_k = 1 if not mb else max(1, -(-largest // mb))
        assert {len(s) for s in per_rank} == {want_k}, (count, world, mb, per_rank)
        for r, sl in enumerate(per_rank):
            a, b = split_batch(count, world, r)
            got = [i for x, y in sl for i in range(x, y)]
            assert got == list(range(a, b)), (count, world, mb, r, sl)
            assert all(y - x <= (mb or max(1, largest)) for x, y in sl)
            assert all(a <= x <= y <= b for x, y in sl)
    assert micro_slices(10, 2, 1, 2) == [(5, 7), (7, 9), (9, 10)]
    assert micro_slices(3, 4, 3, None) == [(3, 3)]  # no sample: one empty micro-batch


def test_the_epoch_permutation_is_pinned_and_cached_per_epoch() -> None:
    # changing it would resume every saved checkpoint into a different order
    assert epoch_permutation(8, 1, 2).tolist() == [6, 1, 5, 3, 7, 0, 4, 2]
    assert epoch_permutation(8, 0, 0).tolist() == [4, 0, 7, 3, 2, 5, 1, 6]
    assert epoch_permutation(8, 2, 0).tolist() == [2, 3, 4, 0, 7, 5, 6, 1]
    cache = PermutationCache(8, 1)
    p = cache.get(2)
    assert p.tolist() == [6, 1, 5, 3, 7, 0, 4, 2] and cache.get(2) is p
    assert cache.get(0).tolist() == epoch_permutation(8, 1, 0).tolist()
    assert cache.get(2).tolist() == p.tolist()


def _walk(n: int, gb: int, world: int, mb: int | None, **kw: int) -> list[list[list[int]]]:
    return [list(ElasticBatchSampler(n, gb, 5, world, r, mb, **kw)) for r in range(world)]


def test_the_sampler_walks_each_steps_samples_from_the_saved_position() -> None:
    n, gb = 10, 4
    # defaults: epoch 0, offset 0, step 0; max_steps bounds the steps
    ranks = _walk(n, gb, 2, 1, max_steps=3)
    perm = epoch_permutation(n, 5, 0).tolist()
    # steps of 4, 4, 2 samples; rank r's micro-batches of one sample each, in order
    assert ranks[0] == [[perm[0]], [perm[1]], [perm[4]], [perm[5]], [perm[8]]]
    assert ranks[1] == [[perm[2]], [perm[3]], [perm[6]], [perm[7]], [perm[9]]]
    # past the epoch's end the next epoch's permutation, from offset 0
    nxt = epoch_permutation(n, 5, 1).tolist()
    ranks = _walk(n, gb, 1, None, max_steps=4)
    assert ranks[0] == [perm[0:4], perm[4:8], perm[8:10], nxt[0:4]]
    # from a saved position: epoch 1, offset 4, step 7 of at most 9 steps
    ranks = _walk(n, gb, 1, None, epoch=1, offset=4, step=7, max_steps=9)
    assert ranks[0] == [nxt[4:8], nxt[8:10]]
    # epochs bound it too
    assert _walk(n, gb, 1, None, epochs=1)[0] == [perm[0:4], perm[4:8], perm[8:10]]
    assert _walk(n, gb, 1, None, epoch=1, epochs=1)[0] == []


def test_a_rank_with_no_sample_gets_one_stand_in_and_no_empty_fetch() -> None:
    # 3 samples over 4 ranks: rank 3 has none; it still yields one index list (the run
    # trims it to an empty micro-batch) so every rank's DataLoader moves in step
    ranks = _walk(3, 3, 4, None, max_steps=1)
    perm = epoch_permutation(3, 5, 0).tolist()
    assert ranks[:3] == [[[perm[0]]], [[perm[1]]], [[perm[2]]]]
    assert ranks[3] == [[perm[0]]]
    # 5 samples over 2 ranks in micro-batches of 2: rank 1 has 2 samples, one micro-batch
    # fetched, its second (empty) not
    ranks = _walk(5, 5, 2, 2, max_steps=1)
    assert [len(x) for x in ranks[0]] == [2, 1] and [len(x) for x in ranks[1]] == [2]


def test_empty_like_batch_cuts_every_tensor_to_zero_rows() -> None:
    batch = {"x": torch.ones(3, 2), "y": [torch.arange(3), "label"], "n": 3}
    out = empty_like_batch(batch)
    assert isinstance(out, dict)
    assert out["x"].shape == (0, 2) and out["y"][0].shape == (0,)
    assert out["y"][1] == "label" and out["n"] == 3
