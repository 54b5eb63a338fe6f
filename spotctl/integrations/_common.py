"""What every integration shares: the world size, the global batch, agreeing on a notice."""

from __future__ import annotations

import os
from typing import Any


class GlobalBatchError(ValueError):
    """The global batch cannot be kept at this world size."""


def world_size() -> int:
    """The data-parallel world torchrun started (WORLD_SIZE), 1 outside torchrun."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def accumulation_steps(global_batch: int, per_device: int, world: int | None = None) -> int:
    """Gradient accumulation steps that keep ``global_batch`` at this world size.

    ``global_batch = per_device * world * steps``; raises GlobalBatchError (one line that
    names the numbers) when no whole number of steps gives it.
    """
    w = world_size() if world is None else world
    if global_batch <= 0 or per_device <= 0 or w <= 0:
        raise GlobalBatchError(
            f"global batch {global_batch}, per-device batch {per_device} and world size {w} "
            "must all be positive")
    if global_batch % (per_device * w):
        raise GlobalBatchError(
            f"global batch {global_batch} is not a multiple of per-device batch {per_device} "
            f"x world size {w} = {per_device * w}: pick a global batch divisible by "
            "per-device batch x every world size the cluster may run at")
    return global_batch // (per_device * w)


class Agreement:
    """All ranks agree on a notice at the same step: one tiny gloo all-reduce (MAX).

    The notice file is read by each rank at its own moment, so ranks may see it a step
    apart; saving must start at one step everywhere. The all-reduce runs on a gloo group
    (control traffic stays on the CPU and never synchronizes a GPU stream).
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._ready = False

    def setup(self) -> None:
        """Collective when the job is distributed: call on every rank at the same point."""
        import torch.distributed as dist

        self._ready = True
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        if dist.get_backend() == "gloo":
            self._group = dist.group.WORLD
        else:
            self._group = dist.new_group(backend="gloo")

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank's flag is True."""
        if not self._ready:
            self.setup()
        if self._group is None:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def barrier(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._group)
