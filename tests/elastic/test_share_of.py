"""checkpoint.share_of: which rank stages which of the tensors every rank holds alike,
worked out for each rank of a 2-rank group whose ranks agree (the group's one all_reduce
stood in for by the agreement it reaches: every rank's digest the same). The real 2-rank
save and its load at other world sizes: tests/integration/test_checkpoint.py -k share."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from spotctl.elastic import checkpoint as ckmod


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """share_of(state, pg=r) is rank r's view of a 2-rank group whose ranks agree."""
    monkeypatch.setattr(ckmod, "dist", SimpleNamespace(
        get_world_size=lambda pg: 2, get_rank=lambda pg: pg,
        all_reduce=lambda t, op=None, group=None: None, ReduceOp=torch.distributed.ReduceOp))


def _tensors(obj: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, list) else ()
    return {p: t for k, v in items for p, t in _tensors(v, (*path, k)).items()}


def test_shares_are_balanced_by_bytes_not_by_count(two_ranks: None) -> None:
    """kills: shares balanced by count instead of bytes (`load[r] += 1`). One tensor of
    400 bytes and four of 40: by bytes rank 0 stages the large one and rank 1 the four
    small ones (400 vs 160 bytes); by count rank 0 would take three (480 vs 80)."""
    state = {"model": {"big": torch.zeros(100), **{f"s{i}": torch.zeros(10) for i in range(4)}}}
    shares = [_tensors(ckmod.share_of(state, r)) for r in (0, 1)]
    assert sorted(shares[0]) == [("model", "big")], sorted(shares[0])
    assert sorted(shares[1]) == [("model", f"s{i}") for i in range(4)], sorted(shares[1])


def test_tensors_under_a_list_stay_on_every_rank(two_ranks: None) -> None:
    """kills: tensors under lists split across ranks again (95171b3 undone: a tensor in a
    dict under a list, such as a tensor learning rate in an optimizer's param_groups, in
    one rank's share only). DCP may write a list whole from one rank: that copy would
    lack the other rank's tensor. The tensors under dicts alone are split, each to one
    rank, none lost."""
    model = {f"w{i}": torch.full((50 + i,), float(i)) for i in range(6)}
    groups = [{"lr": torch.tensor(0.01), "betas": (0.9, 0.99), "params": [0, 1, 2]},
              {"lr": torch.tensor(0.02), "params": [3, 4, 5]}]
    state = {"model": model, "optim": {"state": {0: {"exp_avg": torch.ones(64)}},
                                       "param_groups": groups},
             "rng": [torch.zeros(8, dtype=torch.uint8)]}
    shares = [ckmod.share_of(state, r) for r in (0, 1)]
    for r, share in enumerate(shares):
        got = share["optim"]["param_groups"]
        assert len(got) == 2, r
        assert all(torch.equal(a["lr"], b["lr"]) for a, b in zip(got, groups, strict=True)), r
        assert got[0]["betas"] == (0.9, 0.99) and got[1]["params"] == [3, 4, 5], r
        assert torch.equal(share["rng"][0], state["rng"][0]), r
    split = [{p for p in _tensors(s) if p[:2] != ("optim", "param_groups") and p[0] != "rng"}
             for s in shares]
    every = {p for p in _tensors(state) if p[:2] != ("optim", "param_groups") and p[0] != "rng"}
    assert split[0] | split[1] == every and not split[0] & split[1], split
    assert split[0] and split[1], split  # both ranks stage a part
