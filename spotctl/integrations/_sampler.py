"""A sampler whose position survives a change of world size (torch only)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from spotctl.integrations._common import GlobalBatchError, world_size


class ElasticSampler(Sampler[int]):
    """DistributedSampler's order, resumable at a global position after a rescale.

    Each epoch is one permutation of the data set (``seed + epoch``), the same at every
    world size; rank r takes positions r, r + world, ... as DistributedSampler does, so a
    step's global batch is the same samples whatever the world. The tail that does not
    fill a whole round of ranks is dropped.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None) -> None:
        self.n = len(dataset)
        self.world = world_size() if num_replicas is None else num_replicas
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, global samples done in it)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, samples: int) -> None:
        """Skip the first ``samples`` positions of ``epoch`` (trained before the restart)."""
        if samples % self.world:
            raise GlobalBatchError(f"resume position {samples} is not a whole round of "
                                   f"{self.world} ranks")
        self._resume = (epoch, samples)

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        end = (self.n // self.world) * self.world
        return iter(order[start + self.rank:end:self.world])
