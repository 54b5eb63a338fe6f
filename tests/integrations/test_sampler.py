"""ElasticSampler: DistributedSampler's order at every world size, and a resume position
that means the same samples after a change of world size."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from spotctl.integrations._common import GlobalBatchError  # noqa: E402
from spotctl.integrations._sampler import ElasticSampler  # noqa: E402

DATA = list(range(64))


def ranks(world: int, epoch: int = 0, **kw: int) -> list[list[int]]:
    out = []
    for r in range(world):
        s = ElasticSampler(DATA, seed=5, num_replicas=world, rank=r)
        s.set_epoch(epoch)
        if kw:
            s.resume_at(epoch, **kw)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_order_as_distributed_sampler(world: int) -> None:
    for r, got in enumerate(ranks(world, epoch=3)):
        d = DistributedSampler(DATA, num_replicas=world, rank=r, shuffle=True, seed=5)
        d.set_epoch(3)
        assert got == list(d)


def global_batches(world: int, per_device: int, accumulate: int,
                   per_rank: list[list[int]]) -> list[set[int]]:
    """The samples of each optimizer step, as a DataLoader cuts each rank's share."""
    step = per_device * accumulate
    n = len(per_rank[0]) // step
    return [set().union(*(set(p[i * step:(i + 1) * step]) for p in per_rank))
            for i in range(n)]


def test_a_step_is_the_same_samples_at_any_world_and_after_a_resume() -> None:
    # global batch 16: 4 ranks x 2 x 2, 2 x 2 x 4, 1 x 2 x 8
    four = global_batches(4, 2, 2, ranks(4))
    assert four == global_batches(2, 2, 4, ranks(2)) == global_batches(1, 2, 8, ranks(1))
    # 2 steps trained at world 4 (32 samples); the rest at world 2 and at world 1
    assert global_batches(2, 2, 4, ranks(2, epoch=0, samples=32)) == four[2:]
    assert global_batches(1, 2, 8, ranks(1, epoch=0, samples=32)) == four[2:]


def test_resume_applies_to_its_epoch_only() -> None:
    s = ElasticSampler(DATA, seed=5, num_replicas=2, rank=0)
    s.resume_at(epoch=1, samples=48)
    s.set_epoch(0)
    assert len(list(s)) == 32
    s.set_epoch(1)
    assert len(list(s)) == 8
    s.set_epoch(2)
    assert len(list(s)) == 32
    assert len(s) == 32  # Lightning counts an epoch by it, resumed or not
    with pytest.raises(GlobalBatchError):
        s.resume_at(epoch=1, samples=3)
