"""A plain PyTorch DPO loop with context parallelism (CP) over packed preference pairs, no Trainer.

Usage:
    torchrun --nproc_per_node 2 benchmarks/cp_dpo_loop.py --cp 2 [--steps 3]

``W`` processes form ``W / CP`` data-parallel (DP) groups of ``CP`` consecutive ranks.  Every rank of a CP
group reads the **same** rows of packed pairs (a pair never leaves its row, so it stays on one CP group) and
keeps its share of them (``shard_row`` of the ``PreferenceCollator`` row: per sequence, chunks ``r`` and
``2·CP - 1 - r``, labels shifted before the split); the policy and the frozen reference run on
``packtools_cp`` attention.  ``cp_sequence_logps`` gives each rank the summed log-probabilities of every
sequence of the whole row (the shard's partial sums added over the CP group, the gradient flowing into the
own shard only), so the DPO loss of every pair is the same on all CP peers.  The loss of a step is the pair
mean over the DP groups: each rank divides its DP group's summed pair losses by ``global_pairs`` (CP peers
counted once), and gradients are **summed** over all ranks (``all_reduce`` here; DDP's mean times the world
size in a DDP loop).  ``tests/_cp_dpo_worker.py`` runs ``plain_cp_dpo_step`` against one process on the same
global batch, with the wrong variants as negative controls.
"""

from __future__ import annotations

import copy
from typing import Any

from cp_loop import DEMO_MODEL, cp_layout, demo_parser, summed_sgd_step
from dpo_loop import synthetic_pairs
from train_loop import tiny_llama


def dpo_losses(policy: Any, reference: Any, beta: float) -> Any:
    """Sigmoid DPO loss of each pair from ``[pairs, 2]`` summed log-probabilities (column 0 chosen)."""
    import torch.nn.functional as F

    margins = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    return -F.logsigmoid(beta * margins)


def cp_pair_logps(
    model: Any, batch: dict[str, Any], group: Any, variant: str = "cp", solo: Any = None
) -> Any:
    """``[pairs, 2]`` summed log-probabilities of the whole row's pairs on this rank's shard.

    ``variant``: ``"cp"`` (packtools: :func:`cp_sequence_logps`), ``"local"`` (the negative control: this rank's
    partial sums, never added over the CP group), ``"autograd_sum"`` (added with
    ``torch.distributed.nn.functional.all_reduce``, whose backward sums the gradient over the group too).
    The two wrong variants take ``solo``, a process group of this rank alone (no sum over the CP group).
    """
    import torch

    from packtools.batches.context_parallel import CP_KEY
    from packtools.integrations.parallel.shard_loss import cp_sequence_logps, model_inputs

    logits = model(**model_inputs(batch)).logits
    shard = batch[CP_KEY]
    if variant == "cp":
        return cp_sequence_logps(logits, batch["shift_labels"], shard, group).pairs()[0]
    local = cp_sequence_logps(logits, batch["shift_labels"], shard, group=solo).logps
    if variant == "autograd_sum":
        from torch.distributed.nn.functional import all_reduce

        local = all_reduce(local, group=group)
    elif variant != "local":
        raise ValueError(variant)
    return torch.stack([local[0::2], local[1::2]], dim=1)


def plain_cp_dpo_step(
    model: Any,
    reference: Any,
    batch: dict[str, Any],
    group: Any,
    cp: int,
    *,
    lr: float = 1.0,
    beta: float = 0.5,
    variant: str = "cp",
    divide_by_cp: bool = False,
    solo: Any = None,
) -> tuple[dict[str, Any], int]:
    """One SGD step of DPO on a CP shard of packed pairs; returns ``({name: parameter change}, pairs here)``.

    The loss on every rank: its DP group's summed pair losses over the pairs of every DP group
    (``global_pairs``), times ``1 / cp`` when ``divide_by_cp`` (what the ``autograd_sum`` variant needs); the
    parameter gradients summed over all ranks.
    """
    import torch

    from packtools.integrations.parallel.shard_loss import global_pairs

    model.zero_grad()
    policy = cp_pair_logps(model, batch, group, variant, solo)
    with torch.no_grad():
        ref = cp_pair_logps(reference, batch, group, "local" if variant == "local" else "cp", solo)
    pairs = int(policy.shape[0])
    loss = dpo_losses(policy, ref, beta).sum() / global_pairs(pairs, cp)
    if divide_by_cp:
        loss = loss / cp
    return summed_sgd_step(model, loss, lr), pairs


def shard_pairs(rows: list[dict[str, Any]], cp: int, cp_rank: int, bound: Any = None) -> dict[str, Any]:
    """This rank's CP shard of the padding-free row of ``rows`` (packed pairs), as torch tensors."""
    import numpy as np
    import torch

    from packtools.batches.context_parallel import shard_row
    from packtools.dpo import PreferenceCollator

    full = PreferenceCollator(0, return_tensors="np")(rows)
    lengths = np.diff(full["cu_seq_lens_q"])
    batch = shard_row(
        full["input_ids"][0], full["labels"][0], lengths, cp, cp_rank, pad_token_id=0, bound=bound
    )
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def train_dpo_cp(model, reference, batches, optimizer, group, cp, beta=0.1):
    """DPO on CP shards of packed pairs (``batches``: this rank's shards, e.g. :func:`shard_pairs` of the DP
    group's rows); returns each step's loss (the pair mean over all DP groups).  ``model`` is not wrapped in
    DDP: gradients are summed over all ranks here (with DDP, multiply the loss by the world size instead)."""
    import torch
    import torch.distributed as dist

    from packtools.integrations.parallel.shard_loss import global_pairs

    world = dist.get_world_size() if dist.is_initialized() else 1
    losses = []
    model.train()
    for batch in batches:
        policy = cp_pair_logps(model, batch, group)
        with torch.no_grad():
            ref = cp_pair_logps(reference, batch, group)
        pairs = global_pairs(int(policy.shape[0]), cp)
        loss = dpo_losses(policy, ref, beta).sum() / pairs
        loss.backward()
        for p in model.parameters():
            if p.grad is not None and world > 1:
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        shared = torch.tensor([float(loss.detach())])
        if world > 1:  # every CP peer holds its DP group's loss: add the DP groups' once
            dist.all_reduce(shared)
            shared /= cp
        losses.append(float(shared))
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    import torch
    import torch.distributed as dist

    from packtools.dpo import pack_preference
    from packtools.integrations.attention.context_parallel import use_cp_attention

    parser = demo_parser(__doc__)
    parser.add_argument("--pairs", type=int, default=32)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    layout = cp_layout(args.cp)
    group, dp_rank, cp_rank, dp = layout.cp_group, layout.dp_rank, layout.cp_rank, layout.dp_size
    model = tiny_llama(**DEMO_MODEL)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    use_cp_attention(model)
    use_cp_attention(reference)
    # packed pairs (input_ids, completion_mask, seq_lengths): the model's 97 token ids, the same on every rank
    pairs = synthetic_pairs(args.pairs, args.max_length, vocab_size=DEMO_MODEL["vocab_size"])
    packed = pack_preference(pairs, max_length=args.max_length)
    rows = list(packed)[dp_rank::dp]  # the DP shard: every CP peer reads the same rows
    batches = [shard_pairs([row], args.cp, cp_rank, layout) for row in rows]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(args.steps):
        losses += train_dpo_cp(model, reference, batches, optimizer, group, args.cp)
    if dist.get_rank() == 0:
        print("pair-mean DPO loss per step:", [round(x, 4) for x in losses])
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
