"""A plain PyTorch DPO loop on packed preference pairs, no Trainer: the example of docs/preference.md.

Usage:
    python benchmarks/dpo_loop.py [--pairs 1000] [--max-length 512] [--accumulation 2]

Packs synthetic tokenized pairs with ``packtools.dpo.pack_preference`` (each pair's ``[prompt + chosen][prompt +
rejected]`` side by side, never split), batches whole rows with ``PreferenceCollator`` in a ``DataLoader``,
and trains a tiny random Llama (``train_loop.tiny_llama``) with the DPO loss against a frozen copy of itself,
printing the loss of each optimizer step.  ``train_dpo`` is the loop docs/preference.md shows (verbatim): the
plain loop ``train_loop.train`` with the pairs of the window as the denominator and the DPO loss;
``tests/test_dpo_loop.py`` checks that it trains exactly like the same pairs computed one sequence at a time.

The subtle line is the mean.  Micro-batches of packed rows hold different numbers of pairs, so each one's
loss is ``sum of its pair losses / pairs in the whole accumulation window``: the loss of a step is the mean
over all its pairs, whatever the micro-batches.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from train_loop import tiny_llama, train


def pairs_in(batch):
    """Pairs in a batch of packed pair rows (two sequences each: chosen, rejected)."""
    return (len(batch["cu_seq_lens_q"]) - 1) // 2


def train_dpo(
    model, ref_model, loader, optimizer, beta=0.1, accumulation_steps=1, max_steps=None, device="cpu"
):
    """DPO on packed pair batches with the plain loop ``train`` of docs/training.md; return the loss of each
    optimizer step (the mean over its pairs).

    Every micro-batch's summed pair losses are divided by the pairs of the whole window; under DDP
    (``torch.distributed`` initialized, ``model`` wrapped in ``DistributedDataParallel``, a
    ``TokenBudgetBatchSampler(num_replicas=world, rank=rank)`` per process) ``train`` counts them over all
    processes and multiplies each loss by the number of processes (DDP averages gradients).
    """
    import torch
    import torch.nn.functional as F

    from packtools.dpo import sequence_logps

    def dpo_loss(model, batch, num_pairs):
        # One padding-free row; use_cache=False so sdpa/eager keep the packed sequences apart.
        inputs = {
            k: batch[k]
            for k in (
                "input_ids",
                "position_ids",
                "cu_seq_lens_q",
                "cu_seq_lens_k",
                "max_length_q",
                "max_length_k",
            )
        }
        logits = model(**inputs, use_cache=False).logits
        policy, _ = sequence_logps(logits, batch["labels"], batch["cu_seq_lens_q"]).pairs()
        with torch.no_grad():
            ref_logits = ref_model(**inputs, use_cache=False).logits
            ref, _ = sequence_logps(ref_logits, batch["labels"], batch["cu_seq_lens_q"]).pairs()
        # Columns: 0 chosen, 1 rejected.  -log sigmoid(beta * (policy margin - reference margin)).
        margins = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
        return -F.logsigmoid(beta * margins).sum() / num_pairs

    return train(
        model,
        loader,
        optimizer,
        accumulation_steps,
        device=device,
        max_steps=max_steps,
        count=pairs_in,
        loss_fn=dpo_loss,
    )


def synthetic_pairs(num_pairs: int, max_length: int, vocab_size: int = 1024, seed: int = 0) -> Any:
    """Tokenized pairs with lognormal prompt and completion lengths (completions up to ~8x their median);
    the chosen completion counts up from the prompt's last token, the rejected one is random."""
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    scale = max_length / 16

    def lengths(n: int) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(scale), 0.7, n).astype(int), 1, 8 * int(scale))

    lp, lc, lr = lengths(num_pairs), lengths(num_pairs), lengths(num_pairs)
    prompts = [rng.integers(1, vocab_size, n) for n in lp]
    chosen = [(p[-1] + np.arange(1, n + 1)) % (vocab_size - 1) + 1 for p, n in zip(prompts, lc)]
    rejected = [rng.integers(1, vocab_size, n) for n in lr]
    return Dataset.from_dict(
        {
            "prompt_ids": [p.tolist() for p in prompts],
            "chosen_ids": [c.tolist() for c in chosen],
            "rejected_ids": [r.tolist() for r in rejected],
        }
    )


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rows-per-batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader

    from packtools.dpo import PreferenceCollator, pack_preference

    # --- the docs/preference.md example ------------------------------------------------------------------------------
    from packtools.integrations import use_segmented_sdpa

    pairs = synthetic_pairs(args.pairs, args.max_length)  # prompt_ids, chosen_ids, rejected_ids
    packed = pack_preference(pairs, max_length=args.max_length, shuffle=True, seed=0)
    loader = DataLoader(
        packed, batch_size=args.rows_per_batch, shuffle=True, collate_fn=PreferenceCollator(pad_token_id=0)
    )
    model = tiny_llama()
    use_segmented_sdpa(model)  # sdpa models: attention per sequence, not over the whole packed row
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = train_dpo(
        model, ref_model, loader, optimizer, accumulation_steps=args.accumulation, max_steps=args.max_steps
    )
    # -------------------------------------------------------------------------------------------------------
    for step, loss in enumerate(losses):
        print(f"step {step:4d}  loss {loss:.4f}")
    return losses


if __name__ == "__main__":
    main()
