"""FtRun.dataloader()'s iterator against the run's position (a plain object holding what
FtRun sets in next_step/end_step): it yields exactly run.micro_batches()'s samples for the
current step, keeps its DataLoader while steps follow each other with one split, and starts
a new one at the run's position when the split changes or a step is run again. The whole
engine with it (joins, leaves, workers): tests/elastic/test_ft_groups.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils.data import TensorDataset

from spotctl.elastic.data import epoch_permutation, micro_slices
from spotctl.elastic.ft import QuorumLoader

N, GB, SEED = 20, 6, 5


def _want(run: SimpleNamespace) -> list[list[int]]:
    """The step's micro-batches as Run.micro_batches() cuts them (empty ones left out)."""
    perm = epoch_permutation(N, SEED, run.epoch)
    count = min(GB, N - run.offset)
    sl = micro_slices(count, run.dp_world, run.dp_rank, run.micro_batch)
    return [perm[run.offset + a : run.offset + b].tolist() for a, b in sl if b > a]


def _commit(run: SimpleNamespace) -> None:
    run.step += 1
    run.offset += min(GB, N - run.offset)
    if run.offset >= N:
        run.epoch, run.offset = run.epoch + 1, 0


def test_loader_follows_the_split_and_redone_steps() -> None:
    run = SimpleNamespace(step=0, epoch=0, offset=0, dp_world=2, dp_rank=1, micro_batch=2,
                          global_batch=GB, dataset_size=N, seed=SEED, max_steps=None,
                          epochs=10)
    it = iter(QuorumLoader(run, TensorDataset(torch.arange(N)), {}))  # type: ignore[arg-type]

    def step() -> list[list[int]]:
        return [next(it)[0].tolist() for _ in _want(run)]

    got = []
    for world, rank, commit in [(2, 1, True), (2, 1, True), (2, 1, False), (2, 1, True),
                                (3, 0, True), (3, 0, True), (1, 0, True), (1, 0, True),
                                (1, 0, True), (2, 0, True)]:
        run.dp_world, run.dp_rank = world, rank
        assert step() == _want(run), (run.step, world, rank)
        got.append(it.restarts)
        if commit:
            _commit(run)
    # one DataLoader per run of steps with one split; the redone step (the 4th) starts one
    assert got == [1, 1, 1, 2, 3, 3, 4, 4, 4, 5], got
    # an epoch boundary crossed inside one DataLoader: 9 steps of 6 from 20 samples
    assert run.epoch == 2 and run.offset == 6
