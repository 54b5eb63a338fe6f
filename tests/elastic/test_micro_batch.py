"""micro_batch="auto" arithmetic (spotctl.elastic.data): the data-parallel ranks at the
cluster's largest size, and a rank's share of the global batch there. Both ways at every
edge: tensor-parallel peers that share data, no data-parallel rank named, a largest size
smaller than this group, a global batch that does not divide. (The whole run at two sizes:
tests/elastic/test_rescale_state.py, slow.) mutmut found 31 mutants of these two functions
that no fast test reached (issue 63)."""

from __future__ import annotations

import pytest

from spotctl.elastic.data import auto_micro_batch, largest_dp_world


@pytest.mark.parametrize("world,dp_world,max_world,want", [
    (4, 4, 8, 8),    # plain data parallel: every rank of the largest size
    (8, 4, 16, 8),   # pairs of tensor-parallel peers share data: half the ranks
    (8, 2, 8, 2),    # groups of 4 peers
    (2, 0, 8, 4),    # no data-parallel count given: taken as 1, so 2 peers per rank
    (1, 4, 8, 8),    # more data-parallel ranks than ranks: no peers
    (4, 4, 2, 2),    # a largest size below this one: what it says
    (8, 2, 3, 1),    # not one whole group of peers fits: still one rank
    (0, 1, 5, 5),    # no world (nothing started): one rank per process
    (8, 4, 5, 2),    # whole groups of peers only: 2 of 2.5
    (6, 4, 12, 12),  # 6 ranks, 4 data-parallel: 1 rank per data share, not 1.5
])
def test_largest_dp_world(world: int, dp_world: int, max_world: int, want: int) -> None:
    got = largest_dp_world(world, dp_world, max_world)
    assert got == want and type(got) is int, got


@pytest.mark.parametrize("gb,world,dp_world,max_world,want", [
    (32, 3, 3, 3, 11),   # 32 over 3 ranks: shares of 11 (rounded up, 33 >= 32)
    (32, 4, 4, 4, 8),    # divides: exactly
    (33, 4, 4, 8, 5),    # over 8 ranks at the largest size
    (32, 8, 2, 16, 8),   # 16 ranks of which 4 hold data
    (1, 4, 4, 8, 1),     # fewer samples than ranks: one each
    (0, 4, 4, 8, 1),     # no batch: still a micro-batch of one
])
def test_auto_micro_batch(gb: int, world: int, dp_world: int, max_world: int,
                          want: int) -> None:
    got = auto_micro_batch(gb, world, dp_world, max_world)
    assert got == want and type(got) is int, got
    ranks = largest_dp_world(world, dp_world, max_world)
    if gb > 0:  # the smallest share that covers the batch at the largest size
        assert got * ranks >= gb and (got - 1) * ranks < gb
