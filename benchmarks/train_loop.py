"""A plain PyTorch training loop on packed padding-free batches, no Trainer: the example of docs/training.md.

Usage:
    python benchmarks/train_loop.py [--sequences 2000] [--max-length 512] [--accumulation 2]

Packs a synthetic tokenized dataset with ``packtools.pack_dataset``, batches it with ``PaddingFreeCollator``
in a ``DataLoader`` and trains a tiny random Llama on the CPU, printing the loss of each optimizer step.
``train`` is the loop docs/training.md shows (verbatim), also the loop of ``dpo_loop.py`` (with its own count and
loss); ``tests/test_train_loop.py`` checks that it trains exactly like the same sequences run one by one, and
``bench_train.py`` times it on padded and on packed batches.

The one subtle line is the loss denominator.  With gradient accumulation, each micro-batch's loss must be
``sum of its token losses / tokens predicted in the whole window``; dividing each micro-batch by its own
token count and then by the number of micro-batches weighs the tokens of small batches more.  The
collator puts -100 on every sequence start and on padding, so ``labels[:, 1:] != -100`` counts exactly
the predicted tokens, and transformers' causal-LM loss takes the count as ``num_items_in_batch``.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from _common import small_llama_config


def predicted_tokens(batch):
    """Tokens a packed causal-LM batch predicts: the collator puts -100 on every sequence start and on padding."""
    return int((batch["labels"][:, 1:] != -100).sum())


def causal_lm_loss(model, batch, num_items):
    """``batch``'s summed token loss over ``num_items`` (transformers' causal-LM loss, ``num_items_in_batch``)."""
    # The batch holds use_cache=False: with sdpa/eager, transformers separates packed sequences only without
    # a cache, and Llama & co. default to one.
    return model(**batch, num_items_in_batch=num_items).loss


def train(
    model,
    loader,
    optimizer,
    accumulation_steps=1,
    device="cpu",
    max_steps=None,
    *,
    count=predicted_tokens,
    loss_fn=causal_lm_loss,
):
    """Train ``model`` on the batches of ``loader``; return the loss of each optimizer step.

    Each micro-batch's loss is ``loss_fn(model, batch, num_items)``: its summed loss over ``num_items``, what
    ``count`` counts (by default the predicted tokens) in the whole accumulation window.  Under DDP
    (``torch.distributed`` initialized, ``model`` wrapped in ``DistributedDataParallel``, one
    ``TokenBudgetBatchSampler(num_replicas=world, rank=rank)`` per process, so every process runs the same
    number of micro-batches), ``num_items`` counts the window over all processes and each loss is multiplied by
    the number of processes, which DDP's gradient mean divides by again.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    model.train()
    batches = iter(loader)
    losses = []
    while max_steps is None or len(losses) < max_steps:
        window = list(itertools.islice(batches, accumulation_steps))
        if not window:
            break
        # Items (tokens predicted) in the whole accumulation window: the loss denominator of every micro-batch.
        num_items = sum(count(b) for b in window)
        if world > 1:  # over all processes: the global mean
            total = torch.tensor([num_items])
            dist.all_reduce(total)
            num_items = int(total)
        step_loss = 0.0
        for batch in window:
            batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            loss = loss_fn(model, batch, num_items)
            (loss * world).backward()  # DDP averages gradients over the processes
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:  # this process's share of the step's loss, summed over processes
            shared = torch.tensor([step_loss])
            dist.all_reduce(shared)
            step_loss = float(shared)
        losses.append(step_loss)
    return losses


def tiny_llama(vocab_size: int = 1024, hidden_size: int = 128, seed: int = 0) -> Any:
    """A 2-layer random ``LlamaForCausalLM`` (sdpa attention) small enough to train on a CPU."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(small_llama_config(vocab_size, 2, 4096, hidden_size=hidden_size))


def synthetic_dataset(num_sequences: int, max_length: int, vocab_size: int = 1024, seed: int = 0) -> Any:
    """Learnable token sequences (counting from a random start by a random step of 1-3, modulo the
    vocabulary) with lognormal lengths: median ~max_length/8, a few longer than max_length."""
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    lengths = np.clip(
        rng.lognormal(np.log(max_length / 8), 0.8, num_sequences).astype(int), 2, 2 * max_length
    )
    starts = rng.integers(0, vocab_size - 1, num_sequences)
    steps = rng.integers(1, 4, num_sequences)
    ids = [
        ((s + k * np.arange(n)) % (vocab_size - 1) + 1).tolist() for s, k, n in zip(starts, steps, lengths)
    ]
    return Dataset.from_dict({"input_ids": ids})


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rows-per-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader

    from packtools import PaddingFreeCollator, pack_dataset
    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.integrations.trainers.guard import guard_model

    # --- the docs/training.md example ------------------------------------------------------------------------------
    dataset = synthetic_dataset(args.sequences, args.max_length)  # any dataset with an "input_ids" column
    packed = pack_dataset(dataset, max_length=args.max_length, strategy="bfd_split", shuffle=True, seed=0)
    loader = DataLoader(
        packed, batch_size=args.rows_per_batch, shuffle=True, collate_fn=PaddingFreeCollator(pad_token_id=0)
    )
    model = tiny_llama()
    run_mixers_per_document(model)  # hybrids: token-mixing layers per document (nothing on others)
    guard_model(model)  # refuses batches and models that would let packed sequences meet
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = train(model, loader, optimizer, accumulation_steps=args.accumulation, max_steps=args.max_steps)
    # -------------------------------------------------------------------------------------------------------
    for step, loss in enumerate(losses):
        print(f"step {step:4d}  loss {loss:.4f}")
    return losses


if __name__ == "__main__":
    main()
