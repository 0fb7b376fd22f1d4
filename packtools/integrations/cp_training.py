"""Training on context-parallel (CP) shards: model inputs, the loss without a second shift, the global count.

A CP shard (:mod:`packtools.batches.context_parallel`) carries ``shift_labels``: the label of each token is
already the *next* token of its document, shifted before the row was split.  The loss of a shard is
therefore the cross-entropy of ``logits[t]`` against ``shift_labels[t]`` with **no** shift
(:func:`shifted_token_loss`); shifting again would teach every token the token two places ahead and lose
the targets at chunk edges.

The loss of an optimizer step is the token mean over every rank of the data-parallel × context-parallel
world and every micro-batch of the accumulation window: each rank divides its summed token loss by
:func:`global_count` (the targets of the whole window, all ranks), and the gradients are **summed** over all
ranks (``all_reduce``; or DDP's mean times the world size).  A per-rank mean averaged over ranks weighs the
tokens of ranks with fewer targets more (``tests/test_cp_training.py`` shows it moves the step).
"""

from __future__ import annotations

from typing import Any

from .._optional import require
from ..batches.context_parallel import CP_KEY
from ..constants import IGNORE_INDEX


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keys of a CP shard the model's forward takes (no labels: the loss is :func:`shifted_token_loss`)."""
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        CP_KEY: batch[CP_KEY],
        "use_cache": False,
    }


def shifted_token_loss(logits: Any, shift_labels: Any) -> tuple[Any, int]:
    """``(summed cross-entropy, number of targets)`` of ``logits[t]`` against ``shift_labels[t]``, no shift.

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)
    >>> loss, n = shifted_token_loss(logits, torch.tensor([[2, -100, 1]]))
    >>> round(float(loss), 4), n  # two targets at log(4) each
    (2.7726, 2)
    """
    torch = require("torch", "packtools context parallelism")
    labels = shift_labels.to(logits.device).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = torch.nn.functional.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((labels != IGNORE_INDEX).sum())


def global_count(count: int, group: Any = None) -> int:
    """``count`` summed over ``group`` (default: every process, the DP × CP world)."""
    torch = require("torch", "packtools context parallelism")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return int(count)
    total = torch.tensor([int(count)], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return int(total)
