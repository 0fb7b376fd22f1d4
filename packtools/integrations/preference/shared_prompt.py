"""TRL's ``DPOTrainer`` with each pair's prompt forwarded once (``prepare_dpo_trainer(..., share_prompt=True)``).

TRL's loss code receives its padded ``[2 * pairs, T]`` layout as always; the model's fused-LM-head forward
folds that batch into one prompt-shared row (:func:`fold_pairs`), runs the backbone on it with the tree
attention (:mod:`packtools.integrations.attention.tree`) and gathers the per-token outputs back into the padded
layout.  Everything else is :mod:`packtools.integrations.preference.dpo`'s, which imports this module (never
the other way round).  The layout: ``docs/preference.md`` (*The prompt once*).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._optional import require
from ...batches.tree import TREE_KEY, TreeLayout, tree_segments, unshared_index
from ...compat import set_attr
from ...compat.trl import wrap_fused_forward
from ...errors import PackingError
from ..attention.backends import attention_implementation
from ..attention.backends import base_model as _base_model
from ..attention.segmented import SEGMENTED_SDPA
from ..attention.tree import check_tree_model, use_tree_attention
from ..trainers.guard import check_length_dependent_rope, length_dependent_rope
from .calls import padded_preference_call, padding_free_layout, scatter_per_token

_WRAPPED = "_packtools_shared_prompt"


def fold_pairs(ids: Any, mask: Any, labels: Any) -> dict[str, Any]:
    """The prompt-shared flat row of TRL's padded pair batch, and the gather back to its layout.

    Returns ``input_ids``, ``labels``, ``position_ids`` (``[1, T]``), ``tree`` (the :class:`TreeLayout`) and
    ``back`` (for every padded position ``(b, j)`` with ``j < len_b - 1``, row-major: the flat position whose
    output scores token ``j + 1`` of sequence ``b``).  Each branch starts again at the prompt's last token,
    whose output scores the branch's first completion token:

    >>> import torch
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]])  # chosen 7, rejected 8 9 after the prompt 5 6
    >>> labels = torch.tensor([[-100, -100, 7, -100], [-100, -100, 8, 9]])
    >>> flat = fold_pairs(ids, (ids > 0).long(), labels)
    >>> flat["input_ids"].tolist(), flat["position_ids"].tolist(), flat["back"].tolist()
    ([[5, 6, 7, 6, 8, 9]], [[0, 1, 2, 1, 2, 3]], [0, 1, 0, 3, 4])
    """
    torch = require("torch", "packtools.prepare_dpo_trainer")
    lengths, valid, _ = padding_free_layout(mask)
    n_seq, width = ids.shape
    if n_seq % 2:
        raise PackingError(f"a preference batch holds chosen then rejected sequences; got {n_seq} sequences.")
    pairs = n_seq // 2
    target = labels != -100
    first = torch.where(target.any(1), target.long().argmax(1), lengths)
    same = (ids[:pairs] == ids[pairs:]) | (
        torch.arange(width, device=ids.device)[None] >= first[:pairs, None]
    )
    host = torch.stack([lengths, first]).cpu().numpy().astype(np.int64)
    length, prompt = host[0], host[1]
    if (prompt[:pairs] != prompt[pairs:]).any() or not bool(same.all()):
        bad = int(np.flatnonzero((prompt[:pairs] != prompt[pairs:]) | ~same.all(1).cpu().numpy())[0])
        raise PackingError(
            f"pair {bad} of the batch: its chosen and rejected sequences do not start with the same prompt, so "
            f"the prompt cannot be shared; use share_prompt=False."
        )
    p = prompt[:pairs]
    comp = np.stack([length[:pairs] - p, length[pairs:] - p], 1).reshape(-1)
    if comp.size and comp.min() < 1:
        raise PackingError("a preference batch has an empty completion; every completion needs a token.")
    seg, is_branch = tree_segments(p, np.full(pairs, 2), comp)
    layout = TreeLayout.build(seg, is_branch, np.full(pairs, 2))
    index, seq_len = unshared_index(seg, is_branch)  # branch m = pair m // 2, chosen if m is even
    row = np.arange(2 * pairs).reshape(2, pairs).T.reshape(-1)  # padded row of each branch: m, pairs + m, ...
    cu = np.zeros(seq_len.shape[0] + 1, np.int64)
    np.cumsum(seq_len, out=cu[1:])
    which = np.repeat(np.arange(seq_len.shape[0]), seq_len)
    col = np.arange(int(cu[-1])) - cu[:-1][which]
    source = np.empty(layout.total, np.int64)
    source[index] = row[which] * width + col  # a prefix position is read from either sequence: equal tokens
    device = ids.device
    src = torch.from_numpy(source).to(device)
    flat_ids = ids.reshape(-1)[src]
    flat_labels = labels.reshape(-1)[src].clone()
    flat_labels[torch.from_numpy(seg[:, 0]).to(device)] = -100
    order = np.arange(2 * pairs).reshape(pairs, 2).T.reshape(-1)  # branch of each padded row: row's inverse
    parts = [index[cu[m] : cu[m + 1] - 1] for m in order]
    back = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return {
        "input_ids": flat_ids[None],
        "labels": flat_labels[None],
        "position_ids": torch.from_numpy(layout.positions()).to(device)[None],
        "tree": layout.to(device),
        "back": torch.from_numpy(back).to(device),
        "valid": valid,
    }


def _shared_forward(inner: Any) -> Any:
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        call = padded_preference_call(args, kwargs, fused_lm_head)
        if call is None:
            return inner(*args, fused_lm_head=fused_lm_head, **kwargs)
        ids, mask, labels, kwargs = call
        folded = fold_pairs(ids, mask, labels)
        # the guard's hook sees TRL's padded call, not this tree: a length-dependent RoPE is checked here
        check_length_dependent_rope(length_dependent_rope(self), {"position_ids": folded["position_ids"]})
        kwargs["use_cache"] = False
        out = inner(
            fused_lm_head=True,
            input_ids=folded["input_ids"],
            labels=folded["labels"],
            position_ids=folded["position_ids"],
            **{TREE_KEY: folded["tree"]},
            **kwargs,
        )
        folded["tree"].reads.take(None, "prepare_dpo_trainer(share_prompt=True)")  # it ran the tree
        refusal = "models that add virtual tokens cannot share prompts."
        tokens = folded["input_ids"].shape[1]
        scatter_per_token(out, tokens, folded["valid"][:, 1:], folded["back"], refusal)
        return out

    return forward


def prepare_shared_prompt(trainer: Any, models: list[Any], check_isolation: bool = True) -> None:
    """Put ``models`` on the tree attention and fold their batches; all or none.

    Every model is checked first (:func:`~packtools.integrations.attention.tree.check_tree_model`: refused by
    name if the tree cannot serve it), then switched and probed; if one fails, all go back to ``sdpa`` (or
    their own backend) and nothing is wrapped.
    """
    for model in models:
        check_tree_model(model)
    switched = []
    try:
        for model in models:
            switched.append((model, attention_implementation(model)))
            use_tree_attention(model, check_isolation=check_isolation, owner=trainer)
    except BaseException:
        for model, before in switched:
            _base_model(model).set_attn_implementation("sdpa" if before == SEGMENTED_SDPA else before)
        raise
    for model in models:  # the fused-LM-head forward TRL put on each model folds its pair batches (once)
        base = _base_model(model)
        if not vars(base).get(_WRAPPED):
            wrap_fused_forward(base, _shared_forward, owner=trainer)
            set_attr(base, _WRAPPED, True, owner=trainer)
