"""Per-sequence log-probabilities of a packed batch, and their preference-pair view (torch).

A packed batch is one row of ``T`` tokens cut into sequences by ``cu_seq_lens``.  A sequence's log-probability
is the sum, over its predicted tokens, of ``log p(token | the tokens before it in the same sequence)``:
position ``i`` predicts token ``i + 1`` only when both lie in the same sequence, so the first token of every
sequence is never a target, whatever its label says, and nothing is summed across a boundary.  Sums are
segment sums (``index_add_`` on a segment id), with no Python loop over sequences.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._optional import require
from ..constants import IGNORE_INDEX
from ..errors import PackingError
from .labels import ignore_starts


class SequenceLogps(NamedTuple):
    """Per-sequence sums of predicted-token log-probabilities (``logps``) and the number of such tokens
    (``tokens``), one entry per segment of ``cu_seq_lens``."""

    logps: Any  # float [S]
    tokens: Any  # int64 [S]
    group_sizes: Any = None  # prompt-shared batches: completions per prompt (host array), else None

    def groups(self) -> tuple[Any, Any]:
        """``(logps, tokens)`` of a prompt-shared batch viewed as ``[n_groups, G]`` (one row per prompt, its
        completions in order); every group of the batch must have the same ``G``."""
        sizes = self.group_sizes
        if sizes is None or len(sizes) == 0 or int(min(sizes)) != int(max(sizes)):
            raise PackingError(
                f"groups() needs a prompt-shared batch whose groups all have one size; got group sizes "
                f"{None if sizes is None else list(sizes)[:8]}.",
                param="cu_seq_lens",
            )
        g = int(sizes[0])
        return self.logps.view(-1, g), self.tokens.view(-1, g)

    def pairs(self) -> tuple[Any, Any]:
        """``(logps, tokens)`` viewed as ``[n_pairs, 2]``: column 0 the chosen, column 1 the rejected sequence.

        Sequences ``2k`` and ``2k + 1`` form pair ``k`` (the layout of :func:`packtools.dpo.pack_preference`).  A
        last, odd segment without predicted tokens (the padding of ``pad_to_multiple_of``) is left out; any
        other odd count is an error.
        """
        logps, tokens = self.logps, self.tokens
        n = logps.shape[0]
        if n % 2:
            if int(tokens[-1]) != 0:
                raise PackingError(
                    f"{n} sequences do not form pairs: a preference batch holds chosen and rejected sequences "
                    f"in turn (an even count), plus at most one padding segment without targets.",
                    param="cu_seq_lens",
                )
            logps, tokens = logps[:-1], tokens[:-1]
        return logps.view(-1, 2), tokens.view(-1, 2)


def _flat(name: str, value: Any, ndim_max: int) -> Any:
    if value.dim() > ndim_max or (value.dim() == ndim_max and value.shape[0] != 1):
        raise PackingError(
            f"{name} has shape {tuple(value.shape)}; a packed batch is one row: pass [1, T, ...] or [T, ...].",
            param=name,
        )
    return value[0] if value.dim() == ndim_max else value


def sequence_logps(logits_or_logprobs: Any, labels: Any, cu_seq_lens: Any) -> SequenceLogps:
    """Sum the log-probabilities of each packed sequence's predicted tokens.

    ``logits_or_logprobs``: the model's logits, ``[1, T, V]`` or ``[T, V]`` (position ``i`` scores token
    ``i + 1``; computed in float32 with a fused cross-entropy), or per-token log-probabilities already taken
    at the labels, ``[1, T]`` or ``[T]``, aligned with ``labels`` (entry ``i`` is ``log p(token i)``).
    ``labels``: ``[1, T]`` or ``[T]``, ``-100`` on tokens that are not targets (prompt, padding).
    ``cu_seq_lens``: ``[S + 1]`` sequence boundaries (int, starting at 0, ending at ``T``), as
    :class:`~packtools.PaddingFreeCollator` returns them, or the :class:`~packtools.batches.tree.TreeLayout` of
    a prompt-shared batch (``batch["packtools_tree"]``): then one sum per *completion* (the prompt segments,
    which predict nothing, are left out), ``.pairs()`` for preference pairs and ``.groups()`` for groups.
    Each new output read over a layout needs a forward that ran it through the ``packtools_tree`` attention
    (:class:`~packtools.batches.tree.TreeReads`); else :class:`PackingError` (a model on any other attention
    ignores the tree and its output is wrong).
    Returns :class:`SequenceLogps`; its ``logps`` carries gradients.

    >>> import torch
    >>> logits = torch.zeros(1, 5, 4)  # uniform: every predicted token has log-probability log(1/4)
    >>> out = sequence_logps(logits, torch.tensor([[-100, 1, 2, -100, 3]]), torch.tensor([0, 3, 5]))
    >>> out.tokens.tolist(), [round(x, 4) for x in out.logps.tolist()]
    ([2, 1], [-2.7726, -1.3863])
    """
    torch = require("torch", "packtools.dpo.sequence_logps")
    if hasattr(cu_seq_lens, "branches") and hasattr(cu_seq_lens, "cu_seq_lens"):  # a prompt-shared tree
        tree = cu_seq_lens
        tree.reads.take(logits_or_logprobs, "sequence_logps")  # refuses output no tree attention made
        every = sequence_logps(logits_or_logprobs, labels, tree.cu_seq_lens)
        index = tree.branches.to(every.logps.device)
        return SequenceLogps(every.logps[index], every.tokens[index], tree.group_sizes)
    labels = _flat("labels", labels, 2)
    total = labels.shape[0]
    cu = torch.as_tensor(cu_seq_lens, device=labels.device).long()
    if cu.dim() != 1 or cu.shape[0] < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise PackingError(
            f"cu_seq_lens must be 1-D, start at 0 and end at the {total} tokens of labels; got "
            f"{cu.tolist() if cu.numel() < 12 else tuple(cu.shape)}.",
            param="cu_seq_lens",
        )
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()):
        raise PackingError(
            "cu_seq_lens must be strictly increasing (no empty sequence).", param="cu_seq_lens"
        )
    n_seq = lengths.shape[0]
    seg = torch.repeat_interleave(torch.arange(n_seq, device=labels.device), lengths)
    target = labels.clone()
    ignore_starts(target, cu[:-1])  # a sequence's first token is never predicted (from the previous one)
    scores = logits_or_logprobs
    is_logits = scores.dim() == 3 or (scores.dim() == 2 and tuple(scores.shape) != (1, total))
    if is_logits:
        logits = _flat("logits_or_logprobs", scores, 3)
        if logits.dim() != 2 or logits.shape[0] != total:
            raise PackingError(
                f"logits have shape {tuple(scores.shape)} but labels {total} positions; pass [1, T, V] or [T, V] "
                f"logits, or per-token log-probabilities [1, T] / [T].",
                param="logits_or_logprobs",
            )
        shifted = target[1:]
        token = torch.zeros(total, dtype=torch.float32, device=logits.device)
        token[1:] = -torch.nn.functional.cross_entropy(
            logits[:-1].float(), shifted, ignore_index=IGNORE_INDEX, reduction="none"
        )
    else:
        token = _flat("logits_or_logprobs", scores, 2)
        if token.shape[0] != total:
            raise PackingError(
                f"per-token log-probabilities have {token.shape[0]} entries but labels {total}; pass them "
                f"aligned with labels (entry i = log p(token i)).",
                param="logits_or_logprobs",
            )
    valid = target != IGNORE_INDEX
    token = torch.where(valid, token, torch.zeros((), dtype=token.dtype, device=token.device))
    logps = torch.zeros(n_seq, dtype=token.dtype, device=token.device).index_add(0, seg, token)
    tokens = torch.zeros(n_seq, dtype=torch.long, device=labels.device).index_add(0, seg, valid.long())
    return SequenceLogps(logps, tokens)
