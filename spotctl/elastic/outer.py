"""Replica groups that sync every H steps ([train] sync = "diloco" | "localsgd"): the
math of one sync, apart from how the groups talk (spotctl.elastic.ft does that through
torchft's Manager).

Each group keeps the parameters of the last sync (`synced`, on the CPU: DiLoCo's extra
copy, as torchft's DiLoCo keeps it) and trains H steps on its own. At the sync every
group computes its pseudo-gradient `synced - params`, the groups average them, and:

- localsgd: params = synced - mean pseudo-gradient (the mean of the groups' params);
- diloco: an outer Nesterov SGD step from `synced` with that mean as its gradient
  (torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True, dampening=0)'s
  update, written out so its state is plain tensors a checkpoint and a heal carry).

A sync that fails (a group gone mid-round) is applied by nobody: `restore()` puts the
synced parameters back (the caller rewinds the rest of the round).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

SYNCS = ("ddp", "diloco", "localsgd")
ON_NOTICE = ("auto", "next_sync", "drop")  # [train] on_notice
# on_notice = "auto": the lead a notice must leave beyond twice the time to the round's
# sync for the group to train to it (the leave itself: the report, the shutdown)
LEAVE_MARGIN_S = 5.0


@dataclass(frozen=True)
class SyncConfig:
    """What the spec's [train] sync keys say, as the agent passes them (SPOTCTL_SYNC...)."""

    mode: str = "ddp"
    every: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    on_notice: str = "auto"

    @property
    def local(self) -> bool:
        """Whether replica groups train on their own between syncs."""
        return self.mode != "ddp"

    @classmethod
    def from_env(cls, env: os._Environ[str] | dict[str, str] = os.environ) -> SyncConfig:
        mode = env.get("SPOTCTL_SYNC") or "ddp"
        if mode not in SYNCS:
            raise SystemExit(f"spotctl.elastic: SPOTCTL_SYNC must be one of {', '.join(SYNCS)}, "
                             f"not {mode[:40]!r}")
        on_notice = env.get("SPOTCTL_ON_NOTICE") or "auto"
        if on_notice not in ON_NOTICE:
            raise SystemExit(f"spotctl.elastic: SPOTCTL_ON_NOTICE must be one of "
                             f"{', '.join(ON_NOTICE)}, not {on_notice[:40]!r}")
        try:
            cfg = cls(mode, int(env.get("SPOTCTL_SYNC_EVERY") or 1),
                      float(env.get("SPOTCTL_OUTER_LR") or 0.7),
                      float(env.get("SPOTCTL_OUTER_MOMENTUM") or 0.9), on_notice)
        except ValueError as e:
            raise SystemExit(f"spotctl.elastic: SPOTCTL_SYNC_EVERY / SPOTCTL_OUTER_LR / "
                             f"SPOTCTL_OUTER_MOMENTUM: {e}") from None
        if cfg.every < 1 or not 0 < cfg.outer_lr < float("inf") or not 0 <= cfg.outer_momentum < 1:
            raise SystemExit("spotctl.elastic: SPOTCTL_SYNC_EVERY must be >= 1, SPOTCTL_OUTER_LR "
                             "> 0 and SPOTCTL_OUTER_MOMENTUM within [0, 1)")
        return cfg


def notice_action(on_notice: str, lead_s: float | None, steps_left: int, step_s: float,
                  sync_s: float) -> str:
    """What a group with a notice does in the middle of a round ([train] on_notice):
    "next_sync" (train the `steps_left` local steps to the round's sync, then leave) or
    "drop" (leave now; the local steps since the last sync are dropped). "auto": next_sync
    when the notice's lead (seconds to its deadline; None: none given, e.g. the head's
    rebalance) covers twice the estimated time to the sync (`step_s` per local step, then
    `sync_s`) plus LEAVE_MARGIN_S, else drop."""
    if on_notice != "auto":
        return on_notice
    if lead_s is None or steps_left <= 0:
        return "next_sync"
    need = 2 * (steps_left * max(0.0, step_s) + max(0.0, sync_s)) + LEAVE_MARGIN_S
    return "next_sync" if lead_s >= need else "drop"


def notice_lead(env: os._Environ[str] | dict[str, str] = os.environ) -> float | None:
    """Seconds to the notice's deadline, from the notice file the agent writes beside
    SIGUSR1 when the notice has one (SPOTCTL_NOTICE_FILE: JSON {"deadline": unix seconds,
    ...}, read as data); None: no file, or none readable."""
    path = env.get("SPOTCTL_NOTICE_FILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    dl = d.get("deadline") if isinstance(d, dict) else None
    if isinstance(dl, bool) or not isinstance(dl, (int, float)) or not math.isfinite(dl):
        return None
    return float(dl) - time.time()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage (a DTensor's local shard: groups are sharded alike)."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p  # type: ignore[no-any-return]


class OuterSync:
    """The synced parameters and the outer optimizer of one worker; see the module."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], cfg: SyncConfig):
        self.cfg = cfg
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        pin = torch.cuda.is_available()
        self.synced = [torch.empty(local_tensor(p).shape, dtype=p.dtype, device="cpu",
                                   pin_memory=pin and local_tensor(p).is_cuda)
                       for p in self.params]
        # the outer optimizer's state: Nesterov momentum per parameter, and the outer
        # step (syncs committed): torchft's Manager step on this engine
        self.momentum = ([torch.zeros_like(local_tensor(p)) for p in self.params]
                         if cfg.mode == "diloco" and cfg.outer_momentum > 0 else [])
        self.step = torch.zeros((), dtype=torch.int64)
        self.save()

    @torch.no_grad()
    def save(self) -> None:
        """The parameters as they are are the synced ones (after a sync, a heal, a load)."""
        for s, p in zip(self.synced, self.params, strict=True):
            s.copy_(local_tensor(p))

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the last synced parameters (a sync nobody applied)."""
        for s, p in zip(self.synced, self.params, strict=True):
            local_tensor(p).copy_(s)

    @torch.no_grad()
    def pseudo_grads(self) -> list[torch.Tensor]:
        """synced - params, per parameter, on the parameters' devices."""
        return [s.to(local_tensor(p).device) - local_tensor(p)
                for s, p in zip(self.synced, self.params, strict=True)]

    @torch.no_grad()
    def apply(self, mean_grads: list[torch.Tensor]) -> None:
        """The averaged pseudo-gradients: the outer step from the synced parameters, which
        become the new synced ones."""
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        if self.cfg.mode == "localsgd":
            lr, mu = 1.0, 0.0
        for i, (s, p, g) in enumerate(zip(self.synced, self.params, mean_grads, strict=True)):
            if self.momentum:
                buf = self.momentum[i]
                buf.mul_(mu).add_(g)
                g = g.add(buf, alpha=mu)
            t = local_tensor(p)
            t.copy_(s.to(t.device))
            t.add_(g, alpha=-lr)
        self.step += 1
        self.save()

    def sync(self, average: Callable[[list[torch.Tensor]], bool]) -> bool:
        """One sync: `average` averages the pseudo-gradients in place across the groups and
        says whether every group applies them (torchft's commit vote); if not, the synced
        parameters come back."""
        grads = self.pseudo_grads()
        if average(grads):
            self.apply(grads)
            return True
        self.restore()
        return False

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint and a heal carry beside the model (whose parameters are the
        synced ones at every sync): the outer step and the outer momentum."""
        out = {"step": self.step}
        out.update({f"momentum.{n}": m for n, m in zip(self.names, self.momentum, strict=False)})
        return out

    @torch.no_grad()
    def load(self, st: dict[str, torch.Tensor]) -> None:
        """A peer's or a checkpoint's state (tensors landed in place are copied onto
        themselves); the model's parameters are then the synced ones."""
        mine = self.state()
        for k, t in st.items():
            if k in mine and t is not mine[k]:
                mine[k].copy_(t)
        self.save()
