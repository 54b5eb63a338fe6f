"""An FSDP2 transformer built from a `transformers` config, through spotctl.elastic.

    torchrun --nproc-per-node 2 train.py       # or: spotctl up, with train.script = this file

A tiny Llama (LlamaConfig + AutoModelForCausalLM.from_config: no weights or tokenizer are
downloaded) learns token sequences drawn from a fixed random bigram table. Each decoder
layer and then the whole model are sharded with FSDP2's fully_shard over this process
group's ranks; spotctl.elastic uses a sharded model as given. The forward runs under bf16
autocast (CUDA or CPU), the loss is computed in float32, gradients are clipped.
"""

import math
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from spotctl import elastic

# STEPS, else `spotctl up --max-steps N` ([train] max_steps), else 30
STEPS = int(os.environ.get("STEPS") or os.environ.get("SPOTCTL_MAX_STEPS") or 0) or 30
DATASET_SIZE = 4096  # sequences
SEQ_LEN = 32
GLOBAL_BATCH = 16  # sequences per step, whatever the world size
MICRO_BATCH = 4  # at most this many sequences per forward on a rank
LR = 3e-3
WARMUP = 5
SEED = 0

CONFIG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)


def make_data():
    """DATASET_SIZE sequences of SEQ_LEN + 1 token ids from a fixed random bigram table
    (the shifted pair is input and target)."""
    g = torch.Generator().manual_seed(SEED)
    vocab = CONFIG.vocab_size
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=-1)
    seq = torch.empty(DATASET_SIZE, SEQ_LEN + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (DATASET_SIZE,), generator=g)
    for t in range(SEQ_LEN):
        seq[:, t + 1] = torch.multinomial(table[seq[:, t]], 1, generator=g).squeeze(1)
    return seq


def build(device):
    """The model sharded with FSDP2 over this process group, AdamW, warmup + cosine."""
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(CONFIG).to(device)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / STEPS)))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at), mesh


def main():
    device = elastic.init()  # before the mesh: sets the device and forms the group
    seq = make_data()
    model, opt, sched, mesh = build(device)
    run = elastic.Run(model, opt, dataset_size=DATASET_SIZE, global_batch=GLOBAL_BATCH,
                      seed=SEED, max_steps=STEPS, micro_batch=MICRO_BATCH, mesh=mesh,
                      schedulers=[sched])
    while run.next_step():
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for idx in run.micro_batches():
            batch = seq[idx].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = run.model(input_ids=batch[:, :-1]).logits
            # the sum over sequences of each one's mean token loss, in float32
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(),
                                       reduction="sum") / SEQ_LEN
            (loss_sum * run.loss_scale).backward()
            total += loss_sum.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor: its full value is a collective,
            grad_norm = grad_norm.full_tensor()  # so every rank asks, not only the main one
        opt.step()
        sched.step()
        loss = run.all_reduce(total, "sum").item() / run.step_samples
        run.end_step(loss=loss)
        if run.is_main:
            print(f"step {run.step} loss {loss:.5f} grad_norm {grad_norm.item():.4f} "
                  f"world {run.dp_world}", flush=True)
    run.finish()


if __name__ == "__main__":
    main()
