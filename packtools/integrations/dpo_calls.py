"""Which forward calls of TRL's ``DPOTrainer`` packtools rewrites: one helper for both padding-free forwards.

TRL's DPO loss calls the policy (and the reference) with a padded ``[2B, T]`` preference batch and
``fused_lm_head=True``.  Both packtools forwards (one padding-free row, :mod:`packtools.integrations.trl`, and
the prompt-shared tree, :mod:`packtools.integrations.shared_dpo`) take exactly those calls and pass every
other call (generation, evaluation helpers, a call with embeddings) to the model unchanged.
"""

from __future__ import annotations

from typing import Any

from ..errors import PackingError


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
