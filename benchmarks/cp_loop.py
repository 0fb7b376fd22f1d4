"""A plain PyTorch loop with context parallelism (CP) over packed rows: the recipe of docs/training.md.

Usage:
    torchrun --nproc_per_node 4 benchmarks/cp_loop.py --cp 2 [--steps 3] [--accumulation 2]

``W`` processes form ``W / CP`` data-parallel (DP) groups of ``CP`` consecutive ranks.  Every rank of a CP
group reads the **same** batch (the sampler shards over the DP rank only) and keeps its share of it
(``ContextParallelCollator(..., balance=True)``: per document, a pair of chunks ``k`` and ``2·CP - 1 - k``,
the busiest rank so far taking the lightest pair, so the documents' padding is spread); the model runs on
``packtools_cp`` attention (keys and values all-gathered in the CP group).  The loss of a step is the token
mean over all DP × CP ranks and accumulation steps: each micro-batch's summed token loss is divided by the
targets of the whole window on every rank, and gradients are summed over all ranks.  ``tests/_cp_worker.py``
runs ``plain_cp_step`` against one process on the same global batch.
"""

from __future__ import annotations

import argparse
from typing import Any

from train_loop import synthetic_dataset, tiny_llama


def cp_layout(cp: int) -> Any:
    """This process's :class:`~packtools.integrations.RankLayout` with CP groups of ``cp`` consecutive ranks, its
    CP group created (the layout owns it; hand it to the collator, ``layout=``)."""
    import torch.distributed as dist

    from packtools.integrations.parallel.layout import RankLayout

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = RankLayout(dp_rank=rank // cp, dp_size=world // cp, cp_rank=rank % cp, cp_size=cp)
    return layout.with_cp_group()


def _to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def plain_cp_step(model: Any, batch: dict[str, Any], lr: float = 1.0, rank_mean: bool = False) -> Any:
    """One SGD step on a CP shard; returns ``({name: parameter change}, targets on this rank)``.

    ``rank_mean=True`` is the wrong loss (each rank's own token mean, averaged over ranks), kept as the
    negative control of the tests.
    """
    import torch.distributed as dist

    from packtools.integrations.parallel.shard_loss import global_count, model_inputs, shifted_token_loss

    batch = _to_torch(batch)
    world = dist.get_world_size() if dist.is_initialized() else 1
    model.zero_grad()
    logits = model(**model_inputs(batch)).logits
    loss, count = shifted_token_loss(logits, batch["shift_labels"])
    if rank_mean:
        loss = loss / max(count, 1) / world
    else:
        loss = loss / global_count(count)
    return summed_sgd_step(model, loss, lr), count


def summed_sgd_step(model: Any, loss: Any, lr: float) -> dict[str, Any]:
    """Backward ``loss``, sum the gradients over all ranks and take one SGD step of ``lr``; returns
    ``{name: parameter change}`` (the plain steps the tests compare with one process)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(p.grad)
            p -= lr * p.grad
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def train(model: Any, loader: Any, optimizer: Any, accumulation_steps: int = 1, max_steps: int | None = None):
    """Train on CP shards from ``loader`` (a ``ContextParallelCollator``); returns each step's global loss."""
    import torch
    import torch.distributed as dist

    from packtools.integrations.parallel.shard_loss import global_count, model_inputs, shifted_token_loss

    world = dist.get_world_size() if dist.is_initialized() else 1
    losses, batches = [], iter(loader)
    model.train()
    while max_steps is None or len(losses) < max_steps:
        window = [b for _, b in zip(range(accumulation_steps), batches)]
        if not window:
            break
        targets = global_count(sum(int((b["shift_labels"] != -100).sum()) for b in window))
        total = torch.zeros(())
        for batch in window:
            loss, _ = shifted_token_loss(model(**model_inputs(batch)).logits, batch["shift_labels"])
            (loss / targets).backward()
            total += loss.detach()
        for p in model.parameters():
            if p.grad is not None and world > 1:
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / targets)
    return losses


def demo_parser(description: str) -> argparse.ArgumentParser:
    """The options of the CP demos (this one and ``cp_dpo_loop.py``): ``--cp``, ``--steps``, ``--max-length``."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=128)
    return parser


#: The demos' model: ``train_loop``'s tiny Llama, narrower (hidden 64), over 97 token ids.
DEMO_MODEL = dict(vocab_size=97, hidden_size=64)


def main(argv: list[str] | None = None) -> list[float]:
    import torch
    import torch.distributed as dist

    from packtools import PaddingFreeCollator, pack_dataset
    from packtools.batches.context_parallel import ContextParallelCollator
    from packtools.integrations.attention.context_parallel import use_cp_attention

    parser = demo_parser(__doc__)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    layout = cp_layout(args.cp)
    dp, dp_rank = layout.dp_size, layout.dp_rank
    model = tiny_llama(**DEMO_MODEL)
    use_cp_attention(model)
    collator = ContextParallelCollator(PaddingFreeCollator(0), layout=layout)  # balanced, the layout's group
    # packed rows (input_ids, seq_lengths): the model's 97 token ids, the same on every rank
    dataset = synthetic_dataset(args.sequences, args.max_length, vocab_size=DEMO_MODEL["vocab_size"])
    rows = list(pack_dataset(dataset, max_length=args.max_length, strategy="bfd_split"))
    mine = rows[dp_rank::dp]  # the DP shard: every CP peer reads the same rows
    loader = torch.utils.data.DataLoader(mine, batch_size=1, collate_fn=collator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(args.steps):
        losses += train(model, loader, optimizer, args.accumulation)
    if dist.get_rank() == 0:
        print("global token-mean loss per step:", [round(x, 4) for x in losses])
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
