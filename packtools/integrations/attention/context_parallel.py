"""``packtools_cp``: exact attention over a packed row split across a context-parallel (CP) group.

Each rank holds its share of the row (:mod:`packtools.batches.context_parallel`: per document, chunks ``r``
and ``2N - 1 - r``).  In every attention layer:

1. the keys and values of the group are **all-gathered** (``torch.distributed``, gloo on CPU, NCCL on CUDA),
   as Llama 3's long-context training did; the gather is an autograd function whose backward sums the key
   and value gradients of every rank and hands each owner its part (reduce-scatter; all-reduce then the own
   slice on backends without reduce-scatter, such as gloo), so ``dK``/``dV`` return to the rank whose tokens
   produced them;
2. each chunk's real queries attend their document's real keys up to their own **true position** (causal,
   aligned to the bottom-right corner), through :func:`packtools.batches.varlen_attention`: flash-attn
   varlen (or ``torch.nn.attention.varlen.varlen_attn``) on CUDA fp16/bf16, the per-sequence PyTorch
   reference elsewhere; padding tokens attend nothing and are attended by nothing (output 0).

Layers asking for what it does not apply (:func:`_cp_attention`) and models with token-mixing layers outside
attention (:func:`use_cp_attention`) are refused by name.  A call without a CP shard (evaluation, generation)
goes to :mod:`packtools.integrations.attention.segmented`, whose mask function this backend shares.

The process group comes with the shard (:func:`shard_group`: the ``cp_group`` of the
:class:`~packtools.integrations.parallel.layout.RankLayout` it was cut for, no module global), so two layouts in
one process each gather over their own group.
"""

from __future__ import annotations

import math
from typing import Any

from ..._optional import require
from ...batches.attention import varlen_attention
from ...batches.context_parallel import CP_KEY
from ...compat.transformers import register_attention, set_attention
from ...errors import PackingError
from . import segmented
from .backends import token_mixing_layers
from .segmented import AttentionCall

#: The attention implementation name registered with transformers.
CP_ATTENTION = "packtools_cp"


def _gather_function() -> Any:
    torch = require("torch", "packtools context parallelism")
    dist = torch.distributed

    class GatherTokens(torch.autograd.Function):
        """All-gather along the token dimension (2 of ``[batch, heads, tokens, dim]``); backward sums the
        gradients over the group and returns this rank's slice."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            size = dist.get_world_size(group)
            ctx.group, ctx.size, ctx.rank = group, size, dist.get_rank(group)
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=2)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            chunks = [c.contiguous() for c in grad.chunk(ctx.size, dim=2)]
            if dist.get_backend(ctx.group) == "nccl":
                out = torch.empty_like(chunks[0])
                dist.reduce_scatter(out, chunks, group=ctx.group)
                return out, None
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=ctx.group)
            return total.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None

    return GatherTokens


_GATHER: list[Any] = []


def gather_tokens(x: Any, group: Any = None) -> Any:
    """``x`` of every rank of ``group`` concatenated along dim 2, autograd-correct (see the module docstring)."""
    if not _GATHER:
        _GATHER.append(_gather_function())
    return _GATHER[0].apply(x, group)


def _indices(shard: Any, device: Any) -> tuple[Any, ...]:
    torch = require("torch", "packtools context parallelism")
    cached = getattr(shard, "_tensors", None)
    if cached is not None and cached[0] == device:
        return cached[1:]
    tensors = (
        torch.from_numpy(shard.q_index).to(device),
        torch.from_numpy(shard.k_index).to(device),
        torch.from_numpy(shard.cu_q).to(device),
        torch.from_numpy(shard.cu_k).to(device),
    )
    object.__setattr__(shard, "_tensors", (device, *tensors))  # the shard lives for one batch
    return tensors


def shard_group(shard: Any) -> Any:
    """The CP process group a shard is gathered over: its layout's (``shard.bound.cp_group``), else the default
    group (``None``).  A shard whose layout disagrees with the CP size or rank it was cut for is refused."""
    bound = getattr(shard, "bound", None)
    if bound is None:
        return None
    if (bound.cp_size, bound.cp_rank) != (shard.layout.cp_size, shard.rank):
        raise PackingError(
            f"a CP shard cut for rank {shard.rank} of {shard.layout.cp_size} carries a layout of rank "
            f"{bound.cp_rank} of {bound.cp_size}; cut shards with ContextParallelCollator(inner, layout=layout).",
            param="layout",
        )
    return bound.cp_group


def check_group(shard: Any, group: Any) -> None:
    """Refuse a shard cut for another CP size or rank than this process has in ``group``."""
    torch = require("torch", "packtools context parallelism")
    dist = torch.distributed
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if size > 1 else 0
    if shard.layout.cp_size != size or shard.rank != rank:
        raise PackingError(
            f"the batch was cut for CP rank {shard.rank} of {shard.layout.cp_size}, but this process is rank "
            f"{rank} of a CP group of {size}: its keys would be gathered from the wrong tokens. Build the "
            f"ContextParallelCollator with this process's layout (ContextParallelCollator(inner, "
            f"layout=RankLayout...)), whose CP group the keys are gathered over.",
            param="cp_rank",
        )


def _cp_attention(call: AttentionCall, shard: Any) -> tuple[Any, None]:
    """transformers attention function (``query``/``key``/``value`` are ``[1, heads, local_tokens, dim]``)."""
    module, query, key, value = call.module, call.query, call.key, call.value
    if query.shape[0] != 1 or query.shape[2] != shard.layout.local_tokens:
        raise PackingError(
            f"a CP shard of {shard.layout.local_tokens} tokens reached attention with queries of shape "
            f"{tuple(query.shape)}; CP batches are one row of the shard's tokens.",
            param=CP_KEY,
        )
    unsupported = [
        k for k in ("sliding_window", "softcap", "s_aux", "position_bias") if call.kwargs.get(k) is not None
    ]
    if unsupported or call.is_causal is False or not getattr(module, "is_causal", True):
        raise PackingError(
            f"packtools_cp attends each document causally and in full; this layer asks for "
            f"{unsupported or ['non-causal attention']}, which the CP attention does not apply. Train this model "
            f"without context_parallel.",
            param="context_parallel",
        )
    group = shard_group(shard)
    check_group(shard, group)
    if shard.layout.cp_size > 1:
        key, value = gather_tokens(key, group), gather_tokens(value, group)
    scale = 1.0 / math.sqrt(query.shape[-1]) if call.scaling is None else float(call.scaling)
    return shard_attention(query, key, value, shard, scale, float(call.dropout)), None


#: The transformers attention function: :func:`_cp_attention` for a call carrying a CP shard, else packtools'
#: per-sequence ``sdpa``.
cp_attention_forward = segmented.keyed_attention(CP_KEY, _cp_attention, "cp_attention_forward")


def shard_attention(
    query: Any,
    keys: Any,
    values: Any,
    shard: Any,
    scale: float,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
) -> Any:
    """One rank's attention output ``[1, local_tokens, heads, dim]`` from its queries and the **gathered**
    keys/values of the whole CP group (``[1, kv_heads, cp_size * local_tokens, dim]``, rank after rank).

    Separate from the gather so that one process can check it against the unsplit row (``backend`` as in
    :func:`packtools.batches.varlen_attention`; ``benchmarks/gpu_check.py`` runs it with ``"flash"``).

    >>> import torch
    >>> from packtools.batches.context_parallel import CPLayout, CPShard
    >>> q, k, v = torch.randn(3, 1, 2, 4, 8)  # one document of 4 tokens, CP size 1 (no padding)
    >>> out = shard_attention(q, k, v, CPShard.build(CPLayout.build([4], 1), 0), scale=8**-0.5)
    >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    >>> torch.allclose(out, want, atol=1e-6)
    True
    """
    torch = require("torch", "packtools context parallelism")
    q_index, k_index, cu_q, cu_k = _indices(shard, query.device)
    out = torch.zeros(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device)
    if q_index.numel():
        q = query[0].transpose(0, 1).index_select(0, q_index)  # (real queries, heads, dim)
        k = keys[0].transpose(0, 1).index_select(0, k_index)
        v = values[0].transpose(0, 1).index_select(0, k_index)
        real = varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            shard.max_q,
            shard.max_k,
            causal=True,
            softmax_scale=scale,
            dropout_p=dropout,
            backend=backend,
            check=False,
        )
        out = out.index_copy(0, q_index, real.to(out.dtype))
    return out[None]  # [1, tokens, heads, dim], as transformers' attention functions return


def register(*, owner: Any = None) -> str:
    """Register :data:`CP_ATTENTION` (:func:`cp_attention_forward`, the segmented mask function)."""
    segmented.register(owner=owner)
    return register_attention(CP_ATTENTION, cp_attention_forward, owner=owner, mask=segmented.document_mask)


def use_cp_attention(model: Any, *, owner: Any = None) -> None:
    """Switch ``model`` to :data:`CP_ATTENTION` (the CP group comes with each shard, from its layout).

    Refuses a model with layers that mix tokens outside attention (convolutions, state-space or linear
    attention scans): on a CP shard they would run over chunks of different documents as one sequence.
    """
    mixers = token_mixing_layers(model, include_handled=True)  # a document's chunks sit on several ranks
    if mixers:
        raise PackingError(
            f"{type(model).__name__} mixes tokens outside attention ({mixers[:3]}); under context parallelism those "
            f"layers would see each rank's chunks as one sequence. Train it without context_parallel.",
            param="context_parallel",
        )
    set_attention(model, register(owner=owner), owner=owner)
