"""What both packtools forwards of TRL's ``DPOTrainer`` share (one padding-free row,
:mod:`packtools.integrations.preference.dpo`; the prompt-shared tree, :mod:`packtools.integrations.preference.shared_prompt`):
which calls they rewrite (TRL's padded ``[2B, T]`` preference batch with ``fused_lm_head=True``; every other
call, e.g. generation, passes unchanged), the layout they read and the per-token outputs put back.
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ...errors import PackingError

#: Per-token fields of TRL's fused LM head output, scattered back to the padded layout.
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def padded_preference_call(args: tuple, kwargs: dict[str, Any], fused_lm_head: bool) -> tuple | None:
    """``(input_ids, attention_mask, labels, other kwargs)`` of a padded preference call, or ``None`` for a call
    to pass through as it is.

    >>> padded_preference_call((), {"input_ids": None}, True) is None
    True
    """
    ids, mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if (
        not fused_lm_head
        or args
        or ids is None
        or mask is None
        or labels is None
        or ids.dim() != 2
        or kwargs.get("inputs_embeds") is not None
        or kwargs.get("shift_labels") is not None
    ):
        return None
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "labels")}
    if rest.pop("position_ids", None) is not None:
        raise PackingError("a padded preference batch came with position_ids; packtools builds them itself.")
    return ids, mask, labels, rest


def scatter_per_token(out: Any, tokens: int, target: Any, index: Any, refusal: str) -> None:
    """Put the per-token outputs of a flat call on ``tokens`` tokens back into TRL's padded layout, in place:
    each :data:`PER_TOKEN` field of ``out`` (``[1, tokens - 1]``) becomes ``target.shape``, the positions of
    ``target`` read from ``index``, zero elsewhere (as TRL's are on padding).  A field of another length is
    refused, ``refusal`` naming the models that make one."""
    for name in PER_TOKEN:
        value = getattr(out, name, None)
        if value is None:
            continue
        if value.shape[-1] != tokens - 1:
            raise PackingError(
                f"the model's {name} has {value.shape[-1]} positions for {tokens} tokens; {refusal}"
            )
        full = value.new_zeros(target.shape)
        full[target] = value[0, index]
        out[name] = full


def padding_free_layout(attention_mask: Any) -> tuple[Any, Any, Any]:
    """``(lengths, valid, cu_seq_lens)`` of a right-padded ``[B, T]`` mask; raises if it is not right-padded.

    >>> import torch
    >>> lengths, valid, cu = padding_free_layout(torch.tensor([[1, 1, 1], [1, 1, 0]]))
    >>> lengths.tolist(), cu.tolist()
    ([3, 2], [0, 3, 5])
    """
    torch = require("torch", "packtools.prepare_dpo_trainer")
    lengths = attention_mask.sum(1)
    valid = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    if not torch.equal(valid, attention_mask.bool()):
        raise PackingError(
            "the preference batch is not right-padded (its attention_mask has holes or left padding); packtools "
            "flattens TRL's DataCollatorForPreference layout. Use TRL's collator or packtools.dpo.PreferenceCollator."
        )
    if bool((lengths == 0).any()):
        raise PackingError("the preference batch has an empty sequence; every sequence needs a token.")
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return lengths, valid, cu
