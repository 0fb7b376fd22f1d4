"""TRL's padded ``[B, P + C]`` GRPO/RLOO batch as one padding-free row, and the way back to ``[B, C]``.

TRL builds ``input_ids = cat(prompt_ids, completion_ids)`` with the prompts padded on the left (to ``P``) and the
completions on the right (to ``C = logits_to_keep``), and reads the per-token log-probabilities of the completion
tokens from the last ``C`` positions of its fused LM head's (shifted) output.  :func:`unpad_completions` lays the
real tokens of every sequence one after the other in one row (``prompt_b`` then ``completion_b``; positions
restarting at 0, ``cu_seq_lens``), labels only the completion tokens, and says where each completion token's
log-probability lands in ``[B, C]``: the output at flat position ``k`` scores flat token ``k + 1``, so completion
token ``j`` of sequence ``b`` (flat position ``start_b + p_b + j``) is read at ``start_b + p_b + j - 1``.

:func:`share_prompts` folds the same batch into a prompt-shared row instead (the tree layout of
:mod:`packtools.batches.tree`): sequences of one forward whose prompts are token-for-token equal form one unit,
``[prompt][c_1]...[c_k]``, the prompt once; a prompt held by one sequence only is a plain unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._optional import require
from ...batches.tree import TreeLayout, tree_segments
from ...errors import PackingError
from ..attention.backends import base_model


@dataclass(frozen=True)
class Row:
    """One flat row for the model and the gather back: ``out[b, j] = log_probs[0, source]`` where ``dest``.

    ``ids``, ``labels``, ``positions`` are ``[N]``; ``dest`` is the ``[B, C]`` bool mask of the real completion
    tokens; ``source`` (``[dest.sum()]``, row-major over ``dest``) the flat output positions that score them.
    ``cu``/``longest`` describe the row's sequences (plain rows) and ``tree`` its segments (prompt-shared rows).
    """

    ids: Any
    labels: Any
    positions: Any
    dest: Any
    source: Any
    cu: Any = None
    longest: int = 0
    tree: Any = None


def split_lengths(attention_mask: Any, logits_to_keep: int) -> tuple[Any, Any]:
    """``(prompt_lengths, completion_lengths)`` of TRL's batch; raises unless the prompts are left-padded, the
    completions right-padded and every prompt has a token.

    >>> import torch
    >>> p, c = split_lengths(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), 2)
    >>> p.tolist(), c.tolist()
    ([2, 3], [1, 2])
    >>> split_lengths(torch.tensor([[1, 0, 1, 1, 0]]), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: sequence 0 of the GRPO/RLOO batch: its prompt is not left-padded...
    """
    torch = require("torch", "packtools.prepare_grpo_trainer")
    width = attention_mask.shape[1]
    if not 0 < logits_to_keep <= width:
        raise PackingError(f"logits_to_keep={logits_to_keep} for a batch {width} tokens wide.")
    prompt_mask, completion_mask = (
        attention_mask[:, : width - logits_to_keep],
        attention_mask[:, width - logits_to_keep :],
    )
    p, c = prompt_mask.sum(1), completion_mask.sum(1)
    cols_p = torch.arange(prompt_mask.shape[1], device=attention_mask.device)[None]
    cols_c = torch.arange(logits_to_keep, device=attention_mask.device)[None]
    left = cols_p >= (prompt_mask.shape[1] - p)[:, None]
    right = cols_c < c[:, None]
    bad_p = ~(left == prompt_mask.bool()).all(1)
    bad_c = ~(right == completion_mask.bool()).all(1)
    if bool(bad_p.any()):
        raise PackingError(
            f"sequence {int(bad_p.nonzero()[0])} of the GRPO/RLOO batch: its prompt is not left-padded (the "
            f"attention_mask has holes); packtools unpads the layout TRL's _generate_and_score_completions builds."
        )
    if bool(bad_c.any()):
        raise PackingError(
            f"sequence {int(bad_c.nonzero()[0])} of the GRPO/RLOO batch: its completion is not right-padded (the "
            f"attention_mask has holes); packtools unpads the layout TRL's _generate_and_score_completions builds."
        )
    if bool((p == 0).any()):
        raise PackingError(
            f"sequence {int((p == 0).nonzero()[0])} of the GRPO/RLOO batch has an empty prompt: its first completion "
            f"token has no token before it to be scored from."
        )
    return p, c


def _dest_source(p: Any, c: Any, starts: Any, logits_to_keep: int) -> tuple[Any, Any]:
    torch = require("torch", "packtools.prepare_grpo_trainer")
    cols = torch.arange(logits_to_keep, device=p.device)[None]
    dest = cols < c[:, None]
    source = ((starts + p - 1)[:, None] + cols)[dest]
    return dest, source


def unpad_completions(input_ids: Any, attention_mask: Any, logits_to_keep: int) -> Row:
    """The padding-free :class:`Row` of TRL's padded batch (every sequence its own document).

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7, 0], [2, 3, 4, 8, 9]])
    >>> row = unpad_completions(ids, (ids != 0).long(), 2)
    >>> row.ids.tolist(), row.labels.tolist(), row.positions.tolist(), row.cu.tolist()
    ([5, 6, 7, 2, 3, 4, 8, 9], [-100, -100, 7, -100, -100, -100, 8, 9], [0, 1, 2, 0, 1, 2, 3, 4], [0, 3, 8])
    >>> row.source.tolist(), row.dest.tolist()
    ([1, 5, 6], [[True, False], [True, True]])
    """
    torch = require("torch", "packtools.prepare_grpo_trainer")
    p, c = split_lengths(attention_mask, logits_to_keep)
    lengths = p + c
    valid = attention_mask.bool()
    ids = input_ids[valid]
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=input_ids.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    starts = cu[:-1].long()
    which = torch.repeat_interleave(torch.arange(lengths.shape[0], device=ids.device), lengths)
    positions = torch.arange(ids.shape[0], device=ids.device) - starts[which]
    labels = ids.masked_fill(positions < p[which], -100)  # only completion tokens are scored
    dest, source = _dest_source(p, c, starts, logits_to_keep)
    return Row(ids, labels, positions, dest, source, cu=cu, longest=int(lengths.max()))


def prompt_units(input_ids: Any, attention_mask: Any, logits_to_keep: int) -> tuple[np.ndarray, ...]:
    """``(order, unit_of, prompt_lengths, completion_lengths)``: the sequences grouped by equal prompt tokens.

    ``order`` lists the batch's sequences unit by unit (each unit's in batch order, units by first appearance);
    ``unit_of[b]`` is sequence ``b``'s unit.  Host arrays.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 8], [0, 5, 6, 9]])
    >>> order, unit, p, c = prompt_units(ids, (ids != 0).long(), 1)
    >>> order.tolist(), unit.tolist(), p.tolist()
    ([0, 2, 1], [0, 1, 0], [2, 3, 2])
    """
    p, c = split_lengths(attention_mask, logits_to_keep)
    width = input_ids.shape[1] - logits_to_keep
    host_ids = input_ids[:, :width].cpu().numpy()
    host_p = p.cpu().numpy().astype(np.int64)
    seen: dict[bytes, int] = {}
    unit_of = np.empty(host_ids.shape[0], np.int64)
    for b in range(host_ids.shape[0]):
        key = host_ids[b, width - host_p[b] :].astype(np.int64).tobytes()
        unit_of[b] = seen.setdefault(key, len(seen))
    order = np.argsort(unit_of, kind="stable")
    return order, unit_of, host_p, c.cpu().numpy().astype(np.int64)


def share_prompts(input_ids: Any, attention_mask: Any, logits_to_keep: int) -> Row:
    """The prompt-shared :class:`Row` of TRL's padded batch: each distinct prompt once, its completions after it.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7, 0], [0, 5, 6, 8, 9]])
    >>> row = share_prompts(ids, (ids != 0).long(), 2)
    >>> row.ids.tolist(), row.positions.tolist(), row.source.tolist()
    ([5, 6, 7, 6, 8, 9], [0, 1, 2, 1, 2, 3], [1, 3, 4])
    """
    torch = require("torch", "packtools.prepare_grpo_trainer")
    order, unit_of, p, c = prompt_units(input_ids, attention_mask, logits_to_keep)
    n_units = int(unit_of.max()) + 1 if unit_of.size else 0
    first = np.array([order[np.searchsorted(unit_of[order], u)] for u in range(n_units)], np.int64)
    groups = np.bincount(unit_of, minlength=n_units)
    seg, is_branch = tree_segments(p[first], groups, c[order])
    layout = TreeLayout.build(seg, is_branch, groups)
    width, prompt_width = input_ids.shape[1], input_ids.shape[1] - logits_to_keep
    # Flat position -> padded (row, column) it copies.
    src_row = np.empty(layout.total, np.int64)
    src_col = np.empty(layout.total, np.int64)
    is_completion = np.zeros(layout.total, bool)
    branch_segments = seg[is_branch]
    # Each unit's prefix (its first sequence's prompt but the last token; a one-token prompt has none).
    for u, (start, length) in zip(np.flatnonzero(p[first] > 1), seg[~is_branch][:, :2]):
        src_row[start : start + length] = first[u]
        src_col[start : start + length] = prompt_width - p[first[u]] + np.arange(length)
    dest_flat = np.empty(int(c.sum()), np.int64)  # flat position scoring each completion token, row-major
    offsets = np.zeros(c.shape[0] + 1, np.int64)
    np.cumsum(c, out=offsets[1:])
    for k, b in enumerate(order):  # branch k: the prompt's last token, then sequence b's completion
        start, length = branch_segments[k, 0], branch_segments[k, 1]
        src_row[start : start + length] = b
        src_col[start] = prompt_width - 1
        src_col[start + 1 : start + length] = prompt_width + np.arange(length - 1)
        is_completion[start + 1 : start + length] = True
        dest_flat[offsets[b] : offsets[b + 1]] = start + np.arange(c[b])
    device = input_ids.device
    ids = input_ids.reshape(-1)[torch.from_numpy(src_row * width + src_col).to(device)]
    labels = ids.masked_fill(~torch.from_numpy(is_completion).to(device), -100)
    dest = torch.arange(logits_to_keep, device=device)[None] < torch.from_numpy(c).to(device)[:, None]
    return Row(
        ids,
        labels,
        torch.from_numpy(layout.positions()).to(device),
        dest,
        torch.from_numpy(dest_flat).to(device),
        tree=layout.to(device),
    )


def probe_batch(model: Any) -> tuple[Any, Any, int]:
    """A small TRL-shaped batch ``(input_ids, attention_mask, logits_to_keep)`` on ``model``'s device: left-padded
    prompts (two equal), right-padded completions, one 1-token prompt (the GRPO/RLOO and distillation probes)."""
    torch = require("torch", "packtools.integrations.rl")
    base = base_model(model)
    vocab = int(base.config.get_text_config().vocab_size)
    param = next(base.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts, completions = [4, 4, 2, 1], [4, 1, 6, 3]
    width_p, width_c = max(prompts), max(completions)
    ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    shared_prompt = torch.randint(1, vocab, (prompts[0],), generator=gen)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        prompt = shared_prompt if b < 2 else torch.randint(1, vocab, (p,), generator=gen)
        ids[b, width_p - p : width_p] = prompt[:p]
        ids[b, width_p : width_p + c] = torch.randint(1, vocab, (c,), generator=gen)
        mask[b, width_p - p : width_p + c] = 1
    return ids.to(param.device), mask.to(param.device), width_c
