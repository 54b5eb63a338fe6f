"""The torchft engine's heal target: a joiner's optimizer gets its state tensors before a
heal (so torchft's PGTransport receives the peer's moments in place, on their device),
without changing what it trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spotctl.elastic.ft import _create_optimizer_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
    lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
])  # fmt: skip
def test_state_is_made_without_moving_anything(make) -> None:  # noqa: ANN001
    m = _model()
    opt = make(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    lr = opt.param_groups[0]["lr"]
    _create_optimizer_state(opt)
    assert opt.state and all(opt.state[p] for p in m.parameters())  # one entry per param
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # weight decay at lr 0 moved nothing
    assert opt.param_groups[0]["lr"] == lr and all(p.grad is None for p in m.parameters())
    # the scheduler saw no optimizer step (its own wrapper was bypassed)
    assert not getattr(opt, "_opt_called", False) and sched.last_epoch == 0


def test_an_optimizer_with_state_or_gradients_is_left_alone() -> None:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    _create_optimizer_state(opt)  # gradients present: mid-step, nothing is made
    assert not opt.state
    opt.step()
    moments = [opt.state[p]["exp_avg"].clone() for p in m.parameters()]
    opt.zero_grad()
    _create_optimizer_state(opt)  # has state: untouched
    assert all(torch.equal(opt.state[p]["exp_avg"], e) for p, e in zip(m.parameters(), moments, strict=True))


def test_a_heal_receives_in_place_only_what_lives_on_the_transports_device() -> None:
    """On NCCL the transport's device is the GPU while the RNG states and Adam's step
    counts live on the CPU: given a CPU target, torchft receives onto the GPU and leaves
    the tensor there (torch.set_rng_state then refuses it). The target keeps, at their own
    paths, only the tensors on the transport's device ("meta" stands for the GPU here)."""
    from torch.utils._pytree import tree_flatten_with_path

    from spotctl.elastic import _rng_state
    from spotctl.elastic.ft import _on_device

    with torch.device("meta"):
        m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for p in m.parameters():  # Adam's state as after a step: moments with the parameter,
        opt.state[p] = {"step": torch.tensor(3.0),  # the step count on the CPU
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    live = {"model": m.state_dict(), "optim": [opt.state_dict()], "rng": _rng_state()}
    target = _on_device(live, "meta")

    def leaves(tree: object) -> dict[object, object]:
        return {path: v for path, v in tree_flatten_with_path(tree)[0]}

    before, after = leaves(live), leaves(target)
    moved = [k for k, v in before.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
    assert len(moved) == len(list(m.parameters())) + 1  # each step count, the torch RNG state
    for k, v in before.items():
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            assert after[k] is v, k  # received in place, at the same path
        elif isinstance(v, torch.Tensor):
            assert after.get(k) is None, k  # left to torchft: a CPU copy comes back
        else:
            assert after[k] is v, k
