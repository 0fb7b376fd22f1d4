"""Training on context-parallel (CP) shards: model inputs, the loss without a second shift, the global count.

A CP shard (:mod:`packtools.batches.context_parallel`) carries ``shift_labels``: the label of each token is
already the *next* token of its document, shifted before the row was split.  The loss of a shard is
therefore the cross-entropy of ``logits[t]`` against ``shift_labels[t]`` with **no** shift
(:func:`shifted_token_loss`); shifting again would teach every token the token two places ahead and lose
the targets at chunk edges.

The loss of an optimizer step is the token mean over every rank of the data-parallel × context-parallel
world and every micro-batch of the accumulation window: each rank divides its summed token loss by
:func:`global_count` (the targets of the whole window, all ranks), and the gradients are **summed** over all
ranks (``all_reduce``; or DDP's mean times the world size).  A per-rank mean averaged over ranks would weigh the
tokens of ranks with fewer targets more.

**DPO on packed pairs** (:func:`cp_sequence_logps`, docs/preference.md): each rank sums its shard's per-token
log-probabilities per sequence, added over the CP group with an identity backward (:func:`sum_over_group`); the
loss of a step is the pair mean over :func:`global_pairs` (CP peers counted once).
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ...batches.context_parallel import CP_KEY
from ...batches.logps import SequenceLogps
from ...constants import IGNORE_INDEX
from ...errors import PackingError


def model_inputs(batch: dict[str, Any], model: Any = None) -> dict[str, Any]:
    """The keys of a CP shard the model's forward takes (no labels: the loss is :func:`shifted_token_loss`).

    Given the ``model``, refuses one whose attention is not ``packtools_cp`` (any other would attend only
    within this rank's chunks, :func:`~packtools.integrations.trainers.guard.check_cp_attention`)."""
    if model is not None:
        from ..attention.backends import attention_implementation
        from ..trainers.guard import check_cp_attention

        check_cp_attention(batch, attention_implementation(model))
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


def sum_over_group(x: Any, group: Any = None) -> Any:
    """``x`` summed over the ranks of ``group`` in the forward; in the backward, the identity on ``x``.

    Each rank's gradient goes to its own contribution only: with the same loss of the sum on every rank, the
    gradients of the ranks add up to the gradient of that loss counted once.  One process: ``x`` itself.
    """
    torch = require("torch", "packtools context parallelism")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return x + (total - x.detach())


def cp_sequence_logps(logits: Any, shift_labels: Any, shard: Any, group: Any = None) -> SequenceLogps:
    """The summed log-probabilities of every sequence of the **whole** row, from this rank's CP shard.

    ``logits``: the model's output on the shard (``[1, local_tokens, V]``); ``shift_labels``: the shard's
    (labels shifted before the split, -100 where nothing is predicted); ``shard``: ``batch[CP_KEY]``, the
    :class:`~packtools.batches.context_parallel.CPShard`; ``group``: the CP group.  Per sequence (document of
    the row), the shard's per-token log-probabilities are summed and the sums added over ``group`` with
    :func:`sum_over_group`; the token counts too.  The result is the same on every rank of the group, its
    gradient flowing into this rank's tokens only; ``.pairs()`` views it as ``[pairs, 2]`` (chosen, rejected)
    for a row of packed pairs.

    >>> import torch
    >>> from packtools.batches.context_parallel import shard_row
    >>> b = shard_row([5, 6, 7, 8, 9], [-100, 6, 7, -100, 9], [3, 2], 1, 0, pad_token_id=0)
    >>> out = cp_sequence_logps(torch.zeros(1, 6, 10), torch.from_numpy(b["shift_labels"]), b["packtools_cp"])
    >>> out.tokens.tolist(), [round(x, 4) for x in out.logps.tolist()]  # uniform over 10: log(1/10) a token
    ([2, 1], [-4.6052, -2.3026])
    """
    torch = require("torch", "packtools context parallelism")
    layout = shard.layout
    labels = shift_labels.to(logits.device).reshape(-1)
    if logits.dim() != 3 or logits.shape[0] != 1 or labels.shape[0] != layout.local_tokens:
        raise PackingError(
            f"cp_sequence_logps takes the logits of one CP shard ([1, {layout.local_tokens}, vocab]) and its "
            f"{layout.local_tokens} shift_labels; got logits {tuple(logits.shape)} and {labels.shape[0]} labels.",
            param="shift_labels",
        )
    doc, _, _ = layout.padded_doc()
    seq = torch.from_numpy(doc[layout.index[shard.rank]]).to(logits.device)
    flat = logits[0].float()
    token_logps = -torch.nn.functional.cross_entropy(
        flat, labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    n_seq = int(layout.lengths.size)
    sums = token_logps.new_zeros(n_seq).index_add(0, seq, token_logps)
    tokens = torch.zeros(n_seq, dtype=torch.int64, device=logits.device)
    tokens = tokens.index_add(0, seq, (labels != IGNORE_INDEX).long())
    return SequenceLogps(sum_over_group(sums, group), sum_over_group(tokens, group))


def global_pairs(pairs: int, cp_size: int, group: Any = None) -> int:
    """The pairs of a step over every data-parallel group: ``pairs`` summed over ``group`` (default: every
    process), each CP group's counted once (its ``cp_size`` ranks hold the same pairs)."""
    total = global_count(pairs, group)
    if total % cp_size:
        raise PackingError(
            f"{total} pairs summed over the processes is not a multiple of the CP size {cp_size}: the ranks of "
            f"a CP group must read the same batch (shard the loader over the data-parallel rank only).",
            param="context_parallel",
        )
    return total // cp_size
