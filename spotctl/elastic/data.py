"""The data order of an elastic run: a fixed global batch per step, split over the
data-parallel ranks, in an exact, resumable per-epoch permutation.

Step k of an epoch takes samples perm[offset : offset + global_batch]; rank r of W takes
its contiguous share of those (sizes differ by at most one), cut into micro-batches of at
most `micro_batch`. Every rank runs the same number of micro-batches (the largest share
decides; a rank with fewer samples gets empty ones), so collectives always match.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


class PermutationCache:
    """The current epoch's permutation, computed once per epoch (not per step: randperm
    of 50M samples takes seconds)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def get(self, epoch: int) -> torch.Tensor:
        if self._epoch != epoch or self._perm is None:
            self._perm = epoch_permutation(self.n, self.seed, epoch)
            self._epoch = epoch
        return self._perm


def split_batch(count: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous share [start, end) of `count` items for `rank` of `world` (sizes differ
    by at most one)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_slices(count: int, world: int, rank: int, micro_batch: int | None
                 ) -> list[tuple[int, int]]:
    """This rank's micro-batches of a step of `count` samples, as [start, end) offsets into
    the step. Same length on every rank; trailing ones may be empty."""
    a, b = split_batch(count, world, rank)
    largest = -(-count // world)
    m = micro_batch or max(1, largest)
    k = max(1, -(-largest // m))
    return [(min(a + i * m, b), min(a + (i + 1) * m, b)) for i in range(k)]


def largest_dp_world(world: int, dp_world: int, max_world: int) -> int:
    """Data-parallel ranks at the cluster's largest size: `max_world` ranks in all, of
    which this process group's `world` hold `dp_world` data-parallel ranks (the rest share
    data: tensor-parallel peers)."""
    return max(1, max_world // max(1, world // max(1, dp_world)))


def auto_micro_batch(global_batch: int, world: int, dp_world: int, max_world: int) -> int:
    """micro_batch "auto": a rank's share of `global_batch` at the largest size."""
    return max(1, -(-global_batch // largest_dp_world(world, dp_world, max_world)))


class ElasticBatchSampler(Sampler[list[int]]):
    """Batch sampler for a standard DataLoader (worker processes welcome): yields this
    rank's index list for every micro-batch of every step, from a saved (epoch, offset) on,
    in the same order Run.micro_batches() uses. Deterministic, so the DataLoader may
    prefetch ahead; a rescale builds a new one at the resumed position."""

    def __init__(self, dataset_size: int, global_batch: int, seed: int, world: int, rank: int,
                 micro_batch: int | None = None, epoch: int = 0, offset: int = 0,
                 step: int = 0, max_steps: int | None = None, epochs: int = 1_000_000):
        self.n, self.global_batch, self.seed = dataset_size, global_batch, seed
        self.world, self.rank, self.micro_batch = world, rank, micro_batch
        self.epoch, self.offset, self.step = epoch, offset, step
        self.max_steps, self.epochs = max_steps, epochs

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset, step = self.epoch, self.offset, self.step
        perm: torch.Tensor | None = None
        perm_epoch = -1
        while epoch < self.epochs and (self.max_steps is None or step < self.max_steps):
            if perm_epoch != epoch:
                perm, perm_epoch = epoch_permutation(self.n, self.seed, epoch), epoch
            assert perm is not None
            count = min(self.global_batch, self.n - offset)
            sl = micro_slices(count, self.world, self.rank, self.micro_batch)
            if sl[0][0] == sl[0][1]:
                # no sample for this rank this step: one stand-in the run trims to empty
                yield perm[offset : offset + 1].tolist()
            for a, b in sl:
                if b > a:  # empty micro-batches are not fetched: the run makes them
                    yield perm[offset + a : offset + b].tolist()
            step += 1
            offset += count
            if offset >= self.n:
                epoch, offset = epoch + 1, 0



def empty_like_batch(batch: object) -> object:
    """The same structure with every tensor cut to zero rows (an empty micro-batch)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)
