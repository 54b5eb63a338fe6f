"""A Hugging Face Trainer job that survives spot rescales under spotctl.

A tiny GPT-2 built from a config (nothing is downloaded) on a synthetic token data set.
Run it with torchrun on any number of processes; the global batch stays the same:

    torchrun --nproc-per-node 2 train.py --out out
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from spotctl.integrations.hf import SpotctlCallback, keep_global_batch, latest_checkpoint


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same on every rank and every run."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def build_trainer(argv: list[str] | None = None) -> Trainer:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=100)
    a = p.parse_args(argv)

    set_seed(0)
    # dropout off: with it, each rank draws its own masks and the loss depends on the
    # world size (the math is otherwise the same at any size)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.per_device_batch,
        max_steps=a.max_steps, learning_rate=3e-3, warmup_steps=2,
        logging_steps=1, save_strategy="steps", save_steps=a.save_steps,
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
        dataloader_num_workers=0,
    )
    keep_global_batch(args, a.global_batch)
    return Trainer(model=model, args=args, train_dataset=Tokens(64, 16, 64),
                   callbacks=[SpotctlCallback()])


def main() -> None:
    trainer = build_trainer()
    trainer.train(resume_from_checkpoint=latest_checkpoint(trainer.args.output_dir))
    trainer.save_model()  # the end of the job: out/ holds the final weights


if __name__ == "__main__":
    main()
