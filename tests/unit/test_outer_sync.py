"""The math of [train] sync = "localsgd" | "diloco" (spotctl.elastic.outer), in one process:
replica groups are model copies, the cross-group average is a mean over them.

- LocalSGD with sync_every=1 equals plain data parallelism (one model, the gradient the
  mean over the global batch) for an inner optimizer that is linear in the gradient (SGD
  with momentum and weight decay): each group's step is linear, so the mean of the groups'
  parameters is the step with the mean gradient. (Adam is not linear in the gradient: its
  groups' averaged steps differ from DDP's, which is why the test uses SGD.)
- DiLoCo with outer_lr=1 and outer_momentum=0 is LocalSGD.
- DiLoCo's outer step is torch.optim.SGD(nesterov=True)'s update on the averaged
  pseudo-gradient, step after step (momentum state carried).
- A sync nobody applies puts the synced parameters back."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from spotctl.elastic.outer import LEAVE_MARGIN_S, OuterSync, SyncConfig, notice_action, notice_lead

GROUPS, BATCH, DIM = 2, 16, 5


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(DIM, 1, generator=g, dtype=torch.float64)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
        out.append((x, x @ w + 0.1 * torch.randn(BATCH, 1, generator=g, dtype=torch.float64)))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    ((m(x) - y) ** 2).mean().backward()
    opt.step()


def _mean_over_groups(per_group: list[list[torch.Tensor]]) -> None:
    """The cross-group allreduce (AVG) of each group's pseudo-gradients, in place."""
    for ts in zip(*per_group, strict=True):
        mean = torch.stack(ts).mean(0)
        for t in ts:
            t.copy_(mean)


def _train_groups(cfg: SyncConfig, steps: int) -> list[nn.Module]:
    """GROUPS model copies, each on its half of every global batch, synced every H."""
    models = [_model() for _ in range(GROUPS)]
    opts = [_sgd(m) for m in models]
    syncs = [OuterSync(list(m.named_parameters()), cfg) for m in models]
    share = BATCH // GROUPS
    for k, (x, y) in enumerate(_data(steps), start=1):
        for i, (m, o) in enumerate(zip(models, opts, strict=True)):
            _step(m, o, x[i * share:(i + 1) * share], y[i * share:(i + 1) * share])
        if k % cfg.every == 0:
            grads = [s.pseudo_grads() for s in syncs]
            _mean_over_groups(grads)
            for s, g in zip(syncs, grads, strict=True):
                s.apply(g)
    assert all(int(s.step) == steps // cfg.every for s in syncs)
    return models


def _params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def test_localsgd_every_step_is_data_parallel_training() -> None:
    ddp = _model()
    opt = _sgd(ddp)
    for x, y in _data(12):
        _step(ddp, opt, x, y)  # the gradient of the mean over the whole global batch
    for m in _train_groups(SyncConfig("localsgd", every=1), 12):
        torch.testing.assert_close(_params(m), _params(ddp), rtol=1e-10, atol=1e-12)
    # (and it is not an identity that holds whatever the sync: H = 3 differs)
    far = _train_groups(SyncConfig("localsgd", every=3), 12)[0]
    assert not torch.allclose(_params(far), _params(ddp), rtol=1e-6)


def test_diloco_with_outer_lr_1_and_no_momentum_is_localsgd() -> None:
    a = _train_groups(SyncConfig("localsgd", every=3), 12)
    b = _train_groups(SyncConfig("diloco", every=3, outer_lr=1.0, outer_momentum=0.0), 12)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(_params(x), _params(y), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_outer_step_is_torch_nesterov_sgd(mu: float) -> None:
    m = _model()
    cfg = SyncConfig("diloco", every=1, outer_lr=0.7, outer_momentum=mu)
    outer = OuterSync(list(m.named_parameters()), cfg)
    # the reference: torch's SGD on a copy, its gradient the same pseudo-gradient
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=mu, nesterov=mu > 0)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        with torch.no_grad():  # some local training: the parameters moved
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype), alpha=0.1)
        grads = outer.pseudo_grads()
        outer.apply([t.clone() for t in grads])
        for p, t in zip(ref.parameters(), grads, strict=True):
            p.grad = t
        ref_opt.step()
        torch.testing.assert_close(_params(m), _params(ref), rtol=1e-12, atol=1e-12)
    assert int(outer.step) == 4


def test_a_sync_nobody_applies_restores_the_synced_parameters() -> None:
    m = _model()
    outer = OuterSync(list(m.named_parameters()), SyncConfig("diloco", every=2))
    before = _params(m).clone()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    momentum = [t.clone() for t in outer.momentum]
    assert outer.sync(lambda grads: False) is False
    torch.testing.assert_close(_params(m), before, rtol=0, atol=0)
    assert int(outer.step) == 0 and all(torch.equal(a, b) for a, b in
                                        zip(momentum, outer.momentum, strict=True))


def test_state_round_trip_carries_the_outer_optimizer() -> None:
    a, b = _model(), _model()
    cfg = SyncConfig("diloco", every=1)
    sa = OuterSync(list(a.named_parameters()), cfg)
    sb = OuterSync(list(b.named_parameters()), cfg)
    with torch.no_grad():
        for p in a.parameters():
            p.mul_(0.5)
    sa.apply(sa.pseudo_grads())
    st = sa.state()
    assert int(st["step"]) == 1 and sum(k.startswith("momentum.") for k in st) == 4
    b.load_state_dict(a.state_dict())
    sb.load({k: v.clone() for k, v in st.items()})
    assert int(sb.step) == 1
    for x, y in zip(sa.momentum + sa.synced, sb.momentum + sb.synced, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("env, why", [
    ({"SPOTCTL_SYNC": "gossip"}, "SPOTCTL_SYNC must be one of"),
    ({"SPOTCTL_SYNC": "diloco", "SPOTCTL_SYNC_EVERY": "0"}, "SPOTCTL_SYNC_EVERY must be >= 1"),
    ({"SPOTCTL_SYNC": "diloco", "SPOTCTL_OUTER_MOMENTUM": "1"}, "within [0, 1)"),
    ({"SPOTCTL_SYNC": "diloco", "SPOTCTL_OUTER_LR": "x"}, "SPOTCTL_OUTER_LR"),
    ({"SPOTCTL_SYNC": "diloco", "SPOTCTL_ON_NOTICE": "later"},
     "SPOTCTL_ON_NOTICE must be one of auto, next_sync, drop, not 'later'"),
])
def test_bad_sync_environment_is_one_line(env: dict[str, str], why: str) -> None:
    with pytest.raises(SystemExit) as e:
        SyncConfig.from_env(env)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_on_notice_comes_from_the_environment() -> None:
    assert SyncConfig.from_env({"SPOTCTL_SYNC": "diloco"}).on_notice == "auto"
    for mode in ("next_sync", "drop", "auto"):
        got = SyncConfig.from_env({"SPOTCTL_SYNC": "localsgd", "SPOTCTL_ON_NOTICE": mode})
        assert got.on_notice == mode


def test_a_notice_mid_round_leaves_at_the_sync_when_its_lead_covers_it() -> None:
    """[train] on_notice: next_sync and drop whatever the lead; auto: next_sync when the
    lead is at least twice the time to the round's sync (steps left x step time, then
    the sync) plus LEAVE_MARGIN_S, else drop; no lead known (the head's rebalance, no
    notice file): next_sync; no step left: next_sync (the group is at the sync)."""
    for lead in (None, 0.0, 1e6):
        assert notice_action("next_sync", lead, 5, 1.0, 1.0) == "next_sync"
        assert notice_action("drop", lead, 5, 1.0, 1.0) == "drop"
    need = 2 * (5 * 1.0 + 2.0) + LEAVE_MARGIN_S  # 19 s
    assert notice_action("auto", need, 5, 1.0, 2.0) == "next_sync"
    assert notice_action("auto", need - 0.01, 5, 1.0, 2.0) == "drop"
    assert notice_action("auto", -3.0, 5, 1.0, 2.0) == "drop"  # past its deadline
    assert notice_action("auto", None, 5, 1.0, 2.0) == "next_sync"
    assert notice_action("auto", 0.5, 0, 1.0, 2.0) == "next_sync"
    # nothing measured yet (the first round): only the margin counts
    assert notice_action("auto", LEAVE_MARGIN_S, 3, 0.0, 0.0) == "next_sync"
    assert notice_action("auto", LEAVE_MARGIN_S - 0.01, 3, 0.0, 0.0) == "drop"


def test_the_notice_lead_is_read_from_the_notice_file_as_data(tmp_path: Path) -> None:
    f = tmp_path / "notice.json"
    env = {"SPOTCTL_NOTICE_FILE": str(f)}
    assert notice_lead({}) is None
    assert notice_lead(env) is None  # no file yet
    f.write_text(json.dumps({"reason": "notice", "deadline": time.time() + 30, "id": "x"}))
    lead = notice_lead(env)
    assert lead is not None and 25 < lead <= 30
    for bad in ("{", "[1]", '{"deadline": "30"}', '{"deadline": true}', '{"deadline": NaN}',
                '{"deadline": Infinity}', '{"reason": "notice"}'):
        f.write_text(bad)
        assert notice_lead(env) is None, bad
