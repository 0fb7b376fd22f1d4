"""``sdpa`` attention that runs each packed sequence on its own: cost ``sum(L_i²)`` instead of ``(sum L_i)²``.

transformers' ``sdpa`` backend keeps packed sequences apart with a block-diagonal mask over the whole row, so
a row of ``N`` tokens costs ``N²`` in every attention layer however short its sequences are (and the masked
kernel is slower than the causal one).  FlashAttention's varlen kernels cost ``sum(L_i²)``; on the CPU, or
on a GPU without flash-attn, this backend gets the same order:

* it is registered with transformers as :data:`SEGMENTED_SDPA` (``"packtools_sdpa"``), with ``sdpa``'s mask
  function, so a model switched to it (:func:`use_segmented_sdpa`) builds exactly the masks it built before;
* when a call carries ``cu_seq_lens_q``/``cu_seq_lens_k`` (a padding-free batch of one row), each sequence's
  queries attend to its own keys with the **diagonal block of that mask** (plain ``is_causal=True`` when the
  block is the causal triangle, which is what a model without sliding windows or bidirectional spans gets),
  so sliding windows and any other rule of the model's mask are kept, and nothing crosses a boundary;
* every other call (padded batches, generation with a cache, ``position_bias``, ``softcap``) goes to
  transformers' ``sdpa`` unchanged.

The result equals ``sdpa`` with the block-diagonal mask up to float rounding (tested against it, and against
each sequence run alone, forward and backward).
"""

from __future__ import annotations

from typing import Any

from .._optional import require

#: The attention implementation name registered with transformers.
SEGMENTED_SDPA = "packtools_sdpa"
_CAUSAL: dict[tuple[int, Any], Any] = {}
#: The last boundaries read back to the host: every layer of a forward gets the same tensor (one sync).
_LAST: list[Any] = [None, None]


def _causal(length: int, device: Any) -> Any:
    """The ``[length, length]`` lower triangle (cached: rows of a batch repeat lengths)."""
    torch = require("torch", "packtools segmented sdpa")
    key = (length, device)
    mask = _CAUSAL.get(key)
    if mask is None:
        if len(_CAUSAL) > 256:
            _CAUSAL.clear()
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        _CAUSAL[key] = mask
    return mask


def _segments_apply(kwargs: dict[str, Any], query: Any, key: Any) -> list[int] | None:
    """The sequence boundaries when a call can run per segment, else ``None``."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or query.shape[0] != 1:
        return None
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return None
    if kwargs.get("output_attentions", False) or kwargs.get("s_aux") is not None:
        return None
    if _LAST[0] is cu_q:
        bounds = _LAST[1]
    else:
        bounds = cu_q.tolist()
        if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
            bounds = None  # not boundaries: transformers' sdpa with the mask from position_ids
        _LAST[:] = [cu_q, bounds]
    if bounds is None or (cu_k is not cu_q and cu_k.tolist() != bounds):
        return None
    if bounds[-1] != query.shape[2] or key.shape[2] != query.shape[2]:
        return None
    return bounds


def segmented_sdpa_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention function (``query``/``key``/``value`` are ``[batch, heads, tokens, dim]``).

    >>> import torch
    >>> q, k, v = torch.randn(3, 1, 2, 5, 4)
    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # two sequences: tokens 0-2 and 3-4
    >>> out, _ = segmented_sdpa_forward(None, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    >>> second, _ = segmented_sdpa_forward(None, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None)  # alone
    >>> out.shape, torch.allclose(out[:, 3:], second, atol=1e-6)
    (torch.Size([1, 5, 2, 4]), True)
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    torch = require("torch", "packtools segmented sdpa")
    bounds = _segments_apply(kwargs, query, key)
    if bounds is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = repeat_kv(key, groups)
        value = repeat_kv(value, groups)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        block, use_causal = None, causal
        if attention_mask is not None:
            block, use_causal = attention_mask[:, :, start:end, start:end], False
            if block.dtype == torch.bool and block.shape[:2] == (1, 1):
                if torch.equal(block[0, 0], _causal(end - start, block.device)):
                    block, use_causal = None, True
        outs.append(sdpa(q, k, v, attn_mask=block, dropout_p=dropout, scale=scaling, is_causal=use_causal))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`SEGMENTED_SDPA` with transformers (attention and mask functions); returns the name.

    >>> register()
    'packtools_sdpa'
    """
    require("transformers", "packtools segmented sdpa")
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if SEGMENTED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENTED_SDPA, segmented_sdpa_forward)
    if SEGMENTED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTED_SDPA, sdpa_mask)
    return SEGMENTED_SDPA
