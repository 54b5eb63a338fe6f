"""A Lightning job that survives spot rescales under spotctl.

A small MLP on a synthetic regression set; run it with torchrun on any number of
processes, the global batch stays the same:

    torchrun --nproc-per-node 2 train.py --out out
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spotctl.integrations.lightning import (
    ElasticSampler,
    SpotctlCallback,
    accumulation_steps,
    latest_checkpoint,
    torchrun_layout,
)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self._loss_sum = torch.zeros(())
        self._micro = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self._loss_sum = self._loss_sum + loss.detach()
        self._micro += 1
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # one value per optimizer step: the mean over the step's global batch
        self.log("step_loss", self._loss_sum / self._micro, on_step=True, sync_dist=True)
        self._loss_sum, self._micro = torch.zeros(()), 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=g)).tanh()
    return TensorDataset(x, y)


def build(argv: list[str] | None = None) -> tuple[L.Trainer, Regressor, DataLoader, str]:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=100)
    a = p.parse_args(argv)

    L.seed_everything(0)
    model = Regressor()
    ds = data()
    loader = DataLoader(ds, batch_size=a.per_device_batch, sampler=ElasticSampler(ds, seed=0))
    ckpt = f"{a.out}/checkpoints"
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", max_steps=a.max_steps, **torchrun_layout(),
        accumulate_grad_batches=accumulation_steps(a.global_batch, a.per_device_batch),
        gradient_clip_val=1.0,  # as users clip: the equivalence holds with it
        use_distributed_sampler=False,
        callbacks=[
            SpotctlCallback(ckpt),  # a save at the step boundary on a notice
            # the saves a hard kill falls back to (no notice): every --save-steps steps,
            # all kept, named with their step (latest_checkpoint picks the newest whole one)
            L.callbacks.ModelCheckpoint(dirpath=ckpt, every_n_train_steps=a.save_steps,
                                        save_top_k=-1, save_on_train_epoch_end=False),
        ],
        # each step's row on disk as it is logged: a kill loses none of the log
        logger=L.loggers.CSVLogger(a.out, name="logs", flush_logs_every_n_steps=1),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
    )
    return trainer, model, loader, ckpt


def main() -> None:
    trainer, model, loader, ckpt = build()
    trainer.fit(model, loader, ckpt_path=latest_checkpoint(ckpt), weights_only=True)


if __name__ == "__main__":
    main()
