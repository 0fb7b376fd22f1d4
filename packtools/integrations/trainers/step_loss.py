"""The loss normalizations of a packed training step, in one place: ``token``, ``sample`` and ``sqrt``.

Packing changes what a "mean" loss means: a row holds several sequences (documents), so a per-row or
per-batch mean weighs them by how many happen to share a row.  packtools defines every mode by the unpacked
computation -- each document run alone -- and one formula:

* every trained token ``t`` of document ``i`` (``n_i`` trained tokens: targets that are not ``-100``) weighs
  ``w_t = n_i ** (p - 1)``;
* the loss of an optimizer step is ``sum_t w_t * CE_t / D`` with ``D = sum_t w_t = sum_i n_i ** p`` over the
  **global batch**: every micro-batch of the accumulation window, every data-parallel rank and every rank of a
  context-parallel group (a document split over a CP group is one document; its ``n_i`` is summed over the
  group).  Documents with no trained token weigh nothing.

``token`` (``p = 1``, the default, ``Trainer``'s own ``num_items_in_batch``) is the mean over every trained token,
``sample`` (``p = 0``) the mean of the documents' token means, ``sqrt`` (``p = 1/2``) between the two
(docs/training.md).  A "document" is a sequence of the packed row (``seq_lengths``); one that packing cut across
rows (``bfd_split``) counts as its pieces.

>>> import torch
>>> targets = torch.tensor([5, 6, -100, 7])  # document 0: two targets, document 1: one target, one ignored
>>> doc = torch.tensor([0, 0, 1, 1])
>>> token_weights(targets, doc, "sample").tolist(), token_weights(targets, doc, "sqrt").tolist()
([0.5, 0.5, 0.0, 1.0], [0.7071067690849304, 0.7071067690849304, 0.0, 1.0])
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ...batches.context_parallel import CP_KEY
from ...constants import IGNORE_INDEX
from ...errors import PackingError

#: The loss modes and their exponent ``p`` (a token of a document with ``n`` trained tokens weighs ``n ** (p-1)``).
LOSS_MODES = {"token": 1.0, "sample": 0.0, "sqrt": 0.5}


def check_loss_mode(loss: Any) -> str:
    """``loss`` if it names a mode of :data:`LOSS_MODES`, else a :class:`PackingError` listing them."""
    if not isinstance(loss, str) or loss not in LOSS_MODES:
        raise PackingError(
            f"loss must be one of {sorted(LOSS_MODES)} (how the token losses of a step are averaged: 'token' "
            f"over every trained token, 'sample' over documents, 'sqrt' documents weighted by sqrt(length)), "
            f"got {loss!r}.",
            param="loss",
        )
    return loss


def targets_and_documents(inputs: dict[str, Any]) -> tuple[Any, Any]:
    """``(targets, doc)``: the next-token target of every position of the batch (flat, ``-100`` where nothing
    is predicted) and the document it belongs to (ids local to the batch; under CP, the row's document index).

    A CP shard carries ``shift_labels`` and its layout; other batches carry unshifted ``labels`` (``-100`` at
    every document start, as :class:`~packtools.PaddingFreeCollator` sets) and ``position_ids`` restarting at
    0 for each document (or ``cu_seq_lens_q`` of one flat row).
    """
    torch = require("torch", "packtools loss modes")
    shard = inputs.get(CP_KEY)
    if shard is not None:
        targets = inputs["shift_labels"].reshape(-1)
        doc, _, _ = shard.layout.padded_doc()
        return targets, torch.from_numpy(doc[shard.layout.index[shard.rank]]).to(targets.device)
    labels = inputs.get("labels")
    if labels is None or labels.dim() != 2:
        raise PackingError(
            f"a loss mode other than 'token' needs the batch's labels as [rows, tokens] (got "
            f"{None if labels is None else tuple(labels.shape)}).",
            param="loss",
        )
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], 1)
    cu = inputs.get("cu_seq_lens_q")
    if cu is not None and labels.shape[0] == 1:
        starts = torch.zeros(labels.shape[1], dtype=torch.long, device=labels.device)
        starts[cu[:-1].long()] = 1
    elif inputs.get("position_ids") is not None and inputs["position_ids"].dim() == 2:
        starts = (inputs["position_ids"] == 0).long()
        starts[:, 0] = 1
    else:
        raise PackingError(
            "a loss mode other than 'token' needs the documents of each row: keep position_ids (restarting per "
            "document) or cu_seq_lens_q in the batch (packtools.PaddingFreeCollator returns them).",
            param="loss",
        )
    return targets.reshape(-1), torch.cumsum(starts.reshape(-1), 0) - 1


def token_weights(targets: Any, doc: Any, loss: str, group: Any = None) -> Any:
    """``w_t = n_i ** (p - 1)`` for every trained target ``t`` of document ``i`` (0 on ``-100``).

    ``group``: the CP process group whose ranks hold the other parts of the same documents (their trained
    tokens are added to ``n_i``); ``None`` with one process or no context parallelism.
    """
    torch = require("torch", "packtools loss modes")
    trained = (targets != IGNORE_INDEX).to(torch.float32)
    p = LOSS_MODES[loss]
    if p == 1.0:
        return trained
    size = int(doc.max()) + 1 if doc.numel() else 0
    n = torch.zeros(size, dtype=torch.float32, device=targets.device).index_add(0, doc, trained)
    if group is not None:
        torch.distributed.all_reduce(n, group=group)
    return trained * n.clamp(min=1.0)[doc].pow(p - 1.0)


def weighted_token_loss(logits: Any, targets: Any, weights: Any) -> Any:
    """``sum_t w_t * CE(logits[t], targets[t])`` (``logits`` ``[..., tokens, vocab]`` aligned with the flat
    ``targets``: already shifted)."""
    torch = require("torch", "packtools loss modes")
    flat = logits.reshape(-1, logits.shape[-1]).float()
    per_token = torch.nn.functional.cross_entropy(
        flat, targets.to(flat.device), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return (per_token * weights.to(per_token.device)).sum()
