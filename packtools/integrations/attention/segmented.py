"""``sdpa`` attention that runs each packed sequence on its own: cost ``sum(L_i²)`` instead of ``(sum L_i)²``.

transformers' ``sdpa`` backend keeps packed sequences apart with a block-diagonal mask over the whole row, so
a row of ``N`` tokens costs ``N²`` in every attention layer however short its sequences are (and the masked
kernel is slower than the causal one).  FlashAttention's varlen kernels cost ``sum(L_i²)``; on the CPU, or
on a GPU without flash-attn, this backend gets the same order:

* it is registered with transformers as :data:`SEGMENTED_SDPA` (``"packtools_sdpa"``) with its own mask
  function, :func:`document_mask`: a padding-free row's mask is not built (a :class:`DocumentMask`
  materializes each document's diagonal block, one at a time); every other call gets ``sdpa``'s own mask;
* when a call carries ``cu_seq_lens_q``/``cu_seq_lens_k`` (a padding-free batch of one row), each sequence's
  queries attend to its own keys with the **diagonal block of that mask** (plain ``is_causal=True`` when the
  block is the causal triangle, which is what a model without sliding windows or bidirectional spans gets),
  so sliding windows and any other rule of the model's mask are kept, and nothing crosses a boundary;
* attention sinks (``s_aux``, one extra logit per head in the softmax, GPT-OSS's eager form) run per document
  in plain matrix products (:func:`_sink_attention`: one document's ``L_i²`` scores at a time);
* every other call (padded batches, generation with a cache, ``position_bias``, ``softcap``) goes to
  transformers' ``sdpa`` unchanged;
* under ``torch.compile`` (while Dynamo traces) every call goes to transformers' ``sdpa`` with the mask too: the
  per-sequence loop needs the boundaries on the host, a graph break whose Python ints would recompile the graph
  for every new set of boundaries; the compiled step is exact, at the masked ``(sum L_i)²`` cost;
* the boundaries are read back to the host once per forward and which blocks are plain causal once per
  mask (:data:`_LAST_BOUNDS`, :meth:`DocumentMask.plain_causal`, :func:`_causal_blocks`); Gemma 3's per-document
  masks (:class:`~packtools.batches.vision.DocumentBlockMask`) build each image document's block once per forward
  when autograd records it, shared by the layers of its type (``benchmarks/bench_document_masks.py``).

Memory: a forward over one padding-free row holds no ``T × T`` tensor and no copy of the row's keys, values or
output (docs/training.md has both the memory figures and the ``torch.compile`` detail).

The result equals ``sdpa`` with the block-diagonal mask up to float rounding (tested against it, and against
each sequence run alone, forward and backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..._optional import require
from ...batches.vision import DocumentBlockMask
from ...compat.torch import tensor_version as _version
from ...compat.transformers import register_attention, sdpa_functions, sdpa_mask_function
from ...errors import PackingError

#: The attention implementation name registered with transformers.
SEGMENTED_SDPA = "packtools_sdpa"
#: The last boundaries read back to the host, keyed by the tensors *and* their version counters (an in-place
#: change bumps it): every layer of a forward gets the same tensors, so a forward syncs once.  One tuple,
#: replaced whole, so a thread never pairs one call's key with another call's boundaries.
_LAST_BOUNDS: tuple[Any, ...] = ()
#: Per mask (weakly held, same key scheme): which diagonal blocks are the plain causal triangle.  Layers of one
#: type share one mask object; a few types (full, sliding, chunked) are kept.
_BLOCK_KINDS: dict[int, tuple[Any, ...]] = {}


#: ``(torch, transformers' sdpa_attention_forward, repeat_kv, sdpa_mask)``, imported once: an import inside the attention
#: function would be a graph break in every layer under ``torch.compile``.
_FUNCTIONS: tuple[Any, ...] = ()


def _functions() -> tuple[Any, ...]:
    global _FUNCTIONS
    if not _FUNCTIONS:
        torch = require("torch", "packtools segmented sdpa")
        _FUNCTIONS = (torch, *sdpa_functions(), sdpa_mask_function())
    return _FUNCTIONS


def _compiling(torch: Any) -> bool:
    """Whether Dynamo is tracing this call (``torch.compile``): then the host-side boundaries are not read."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _boundaries(cu_q: Any, cu_k: Any) -> list[int] | None:
    """``cu_seq_lens`` as a host list (cached per forward), or ``None`` if they are not one row's boundaries."""
    global _LAST_BOUNDS
    vq, vk = _version(cu_q), _version(cu_k)
    last = _LAST_BOUNDS
    if vq is not None and vk is not None and last and last[0] is cu_q and last[2] is cu_k:
        if (last[1], last[3]) == (vq, vk):
            return last[4]
    bounds = cu_q.tolist()
    if cu_k is not cu_q and cu_k.tolist() != bounds:
        bounds = None
    elif not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        bounds = None  # not boundaries: transformers' sdpa with the mask from position_ids
    _LAST_BOUNDS = (cu_q, vq, cu_k, vk, bounds)
    return bounds


def _causal_blocks(mask: Any, bounds: list[int]) -> list[bool]:
    """For each sequence, whether its diagonal block of ``mask`` is exactly the causal triangle (one sync)."""
    torch = require("torch", "packtools segmented sdpa")
    if mask.dtype != torch.bool or mask.shape[:2] != (1, 1):
        return [False] * (len(bounds) - 1)
    version = _version(mask)
    entry = _BLOCK_KINDS.get(id(mask))
    if version is not None and entry is not None and entry[0]() is mask and entry[1:3] == (version, bounds):
        return entry[3]
    differs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        block = mask[0, 0, start:end, start:end]
        triangle = torch.ones(end - start, end - start, dtype=torch.bool, device=mask.device).tril_()
        differs.append((block != triangle).any())
    kinds = [not d for d in torch.stack(differs).tolist()] if differs else []
    if version is not None:
        if len(_BLOCK_KINDS) >= 4:
            _BLOCK_KINDS.clear()
        _BLOCK_KINDS[id(mask)] = (weakref.ref(mask), version, list(bounds), kinds)
    return kinds


#: How many mask entries :meth:`DocumentMask.plain_causal` builds at once (a band of query rows).
_CHECK_ELEMENTS = 1 << 20


class DocumentMask:
    """The mask of one padding-free row, not built: ``sdpa``'s mask arguments, materialized per document block.

    transformers hands the object that the mask function returned to every attention call of the layers of
    one type; :func:`segmented_sdpa_forward` asks it for the documents' diagonal blocks (:meth:`block`, or
    whether they are plain causal, :meth:`plain_causal`), and for the whole mask (:meth:`full`, built once,
    ``sdpa_mask``'s own result) only when a call goes to transformers' ``sdpa``.
    """

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments
        self.shape = (1, 1, arguments["q_length"], arguments["kv_length"])
        self._full: tuple[Any, ...] = ()
        self._kinds: dict[tuple[int, ...], list[bool]] = {}

    def full(self) -> Any:
        """``sdpa_mask``'s mask for the whole row (``None`` where it is the plain causal triangle)."""
        if not self._full:
            self._full = (_functions()[3](**self.arguments),)
        return self._full[0]

    def block(self, start: int, end: int) -> Any:
        """The ``[1, 1, L, L]`` diagonal block of tokens ``start:end`` (the full mask's block, built alone)."""
        arguments = dict(self.arguments, q_length=end - start, kv_length=end - start, q_offset=start)
        arguments.update(kv_offset=start, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return _functions()[3](**arguments)

    def plain_causal(self, bounds: list[int]) -> list[bool]:
        """For each document, whether its block is exactly the causal triangle (cached per boundaries).

        Checked a band of query rows at a time (at most :data:`_CHECK_ELEMENTS` mask entries), so the check
        never holds a whole ``L × L`` block.
        """
        key = tuple(bounds)
        if key not in self._kinds:
            torch, sdpa_mask = _functions()[0], _functions()[3]
            kinds = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                length, plain = end - start, True
                band = max(1, _CHECK_ELEMENTS // max(length, 1))
                for first in range(start, end, band):
                    rows = min(band, end - first)
                    arguments = dict(self.arguments, q_length=rows, kv_length=length, q_offset=first)
                    arguments.update(
                        kv_offset=start, allow_is_causal_skip=False, allow_is_bidirectional_skip=False
                    )
                    got = sdpa_mask(**arguments)[0, 0]
                    query = torch.arange(first, first + rows, device=got.device)[:, None]
                    keys = torch.arange(start, end, device=got.device)[None, :]
                    if not torch.equal(got, keys <= query):
                        plain = False
                        break
                kinds.append(plain)
            self._kinds = {key: kinds}
        return self._kinds[key]


def document_mask(**arguments: Any) -> Any:
    """:data:`SEGMENTED_SDPA`'s mask function: a :class:`DocumentMask` for one row without padding or cache.

    Every other call (several rows, a 2-D padding mask, a cache's offsets, tracing under ``torch.compile``)
    returns ``sdpa_mask(**arguments)``, the mask ``sdpa`` builds.
    """
    torch, sdpa_mask = _functions()[0], _functions()[3]
    one_row = (
        arguments.get("batch_size") == 1
        and arguments.get("attention_mask") is None
        and type(arguments.get("q_offset", 0)) is int
        and type(arguments.get("kv_offset", 0)) is int
        and arguments.get("q_offset", 0) == 0
        and arguments.get("kv_offset", 0) == 0
        and arguments.get("q_length") == arguments.get("kv_length")
    )
    if not one_row or _compiling(torch):
        return sdpa_mask(**arguments)
    return DocumentMask(arguments)


def _plain_call(kwargs: dict[str, Any]) -> bool:
    """Whether a call asks for nothing that only transformers' ``sdpa`` path gives (a position bias, a logit
    softcap, the attention weights): then it may run per document."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    return not kwargs.get("output_attentions", False)


def _one_row(query: Any, key: Any, mask: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a plain call (:func:`_plain_call`) is one row whose queries and keys are the tokens of ``mask``
    (no cache, no padding)."""
    one = query.shape[0] == 1 and query.shape[2] == key.shape[2] == mask.shape[-1]
    return one and _plain_call(kwargs)


def _segments_apply(kwargs: dict[str, Any], query: Any, key: Any) -> list[int] | None:
    """The sequence boundaries when a call can run per segment, else ``None``."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or query.shape[0] != 1:
        return None
    if not hasattr(cu_q, "tolist") or not hasattr(cu_k, "tolist") or getattr(cu_q, "ndim", 0) != 1:
        return None
    if not _plain_call(kwargs):
        return None
    bounds = _boundaries(cu_q, cu_k)
    if bounds is None or bounds[-1] != query.shape[2] or key.shape[2] != query.shape[2]:
        return None
    return bounds


@dataclass(frozen=True)
class AttentionCall:
    """One call of a transformers attention function, as :func:`attention_function` hands it to a backend."""

    module: Any
    query: Any
    key: Any
    value: Any
    attention_mask: Any
    dropout: float = 0.0
    scaling: float | None = None
    is_causal: bool | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def segmented(self) -> tuple[Any, None]:
        """This call run by packtools' per-sequence ``sdpa`` (:data:`SEGMENTED_SDPA`)."""
        return _segmented_sdpa(self)


def attention_function(
    run: Callable[[AttentionCall], tuple[Any, None]], name: str
) -> Callable[..., tuple[Any, None]]:
    """The transformers attention function ``name``: its arguments as one :class:`AttentionCall` to ``run``.

    The signature is transformers' ``sdpa_attention_forward``'s, which ``AttentionInterface`` calls with
    ``dropout``/``scaling`` (and ``is_causal`` where the model gives it) as keywords; packtools' backends (the
    per-sequence ``sdpa``, the tree, context parallelism) write it here once.
    """

    def forward(
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
        return run(
            AttentionCall(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        )

    # found where ``run`` is defined, under ``name`` (as pickle and the docs look a function up)
    forward.__name__ = forward.__qualname__ = name
    forward.__module__, forward.__doc__ = run.__module__, run.__doc__
    return forward


def keyed_attention(
    payload_key: str, run: Callable[[AttentionCall, Any], tuple[Any, None]], name: str
) -> Callable[..., tuple[Any, None]]:
    """The attention function ``name`` of a backend whose batches carry the keyword ``payload_key``.

    A call carrying it (a tree layout, a CP shard) goes to ``run(call, payload)``, the keyword taken out of
    ``call.kwargs``; every other call (evaluation, generation, a plain batch) to the per-sequence ``sdpa``.
    """

    def dispatch(call: AttentionCall) -> tuple[Any, None]:
        kwargs = dict(call.kwargs)
        payload = kwargs.pop(payload_key, None)
        call = replace(call, kwargs=kwargs)
        return call.segmented() if payload is None else run(call, payload)

    dispatch.__module__, dispatch.__doc__ = run.__module__, run.__doc__
    return attention_function(dispatch, name)


def _segmented_sdpa(call: AttentionCall) -> tuple[Any, None]:
    """transformers attention function (``query``/``key``/``value`` are ``[batch, heads, tokens, dim]``).

    >>> import torch
    >>> q, k, v = torch.randn(3, 1, 2, 5, 4)
    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # two sequences: tokens 0-2 and 3-4
    >>> out, _ = segmented_sdpa_forward(None, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    >>> second, _ = segmented_sdpa_forward(None, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None)  # alone
    >>> out.shape, torch.allclose(out[:, 3:], second, atol=1e-6)
    (torch.Size([1, 5, 2, 4]), True)
    """
    module, query, key, value = call.module, call.query, call.key, call.value
    attention_mask, kwargs = call.attention_mask, call.kwargs
    dropout, scaling, is_causal = call.dropout, call.scaling, call.is_causal
    if kwargs.get("packtools_tree") is not None:  # a prompt-shared batch on a model not switched to the tree
        raise PackingError(
            "a prompt-shared batch (packtools_tree) reached the packtools_sdpa attention, which would ignore the "
            "tree; switch the model with packtools.integrations.attention.tree.use_tree_attention(model)."
        )
    if kwargs.get("packtools_cp") is not None:  # a context-parallel shard: this rank's chunks are not a row
        raise PackingError(
            "a context-parallel shard (packtools_cp) reached the packtools_sdpa attention, which would attend only "
            "within this rank's chunks; switch the model with packtools.integrations.use_cp_attention(model).",
            param="packtools_cp",
        )
    torch, sdpa_attention_forward, repeat_kv, _ = _functions()
    bounds = None if _compiling(torch) else _segments_apply(kwargs, query, key)
    blocks = isinstance(attention_mask, DocumentBlockMask)
    if blocks and bounds is None and not _compiling(torch) and _one_row(query, key, attention_mask, kwargs):
        bounds = attention_mask.bounds  # no cu_seq_lens in the batch: the mask's own documents
    if bounds is None:
        if isinstance(attention_mask, DocumentMask):
            attention_mask = attention_mask.full()
        elif blocks:  # several rows, or traced: the whole row's mask, built (T² bytes)
            attention_mask = attention_mask.full(query.device)
        # transformers' sdpa has no sinks: the same softmax, over the call
        if kwargs.get("s_aux") is not None:
            groups = getattr(module, "num_key_value_groups", 1)
            k, v = (repeat_kv(key, groups), repeat_kv(value, groups)) if groups > 1 else (key, value)
            plain = attention_mask is None and query.shape[2] == key.shape[2] and is_causal is not False
            qkv = (query, k, v)
            out = _sink_attention(
                torch,
                qkv,
                attention_mask,
                plain,
                scaling=scaling,
                sinks=kwargs["s_aux"],
                dropout=dropout,
                module=module,
            )
            return out.transpose(1, 2).contiguous(), None
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
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    lazy = isinstance(attention_mask, (DocumentMask, DocumentBlockMask))
    if attention_mask is None:
        plain = None
    elif lazy:
        plain = attention_mask.plain_causal(bounds)
    else:
        plain = _causal_blocks(attention_mask, bounds)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sinks = kwargs.get("s_aux")  # attention sinks (GPT-OSS): one extra logit per head in every softmax
    # Autograd on: the documents' outputs are concatenated (its backward splits the gradient into views); off:
    # each is written into one output buffer as it comes, so no second copy of the row's output exists.
    tracked = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    outs, out = [], None
    # One split per tensor (its backward is one concatenation), not a slice per document (each slice's backward
    # writes a zero tensor the size of the whole row: documents x row work).
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    parts = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    for i, ((start, end), (q, k, v)) in enumerate(zip(zip(bounds[:-1], bounds[1:]), parts)):
        if end == start:
            continue
        if plain is None:
            block, use_causal = None, causal
        elif plain[i]:
            block, use_causal = None, True
        elif blocks:
            # tracked: one additive block per document for all the layers of the type (each saves it for backward)
            block = attention_mask.block(start, end, query.device, query.dtype if tracked else None)
            use_causal = False
        elif lazy:
            block, use_causal = attention_mask.block(start, end), False
        else:
            block, use_causal = attention_mask[:, :, start:end, start:end], False
        # Grouped keys/values: sdpa's own GQA where transformers' sdpa uses it (no mask, equal head dims up to
        # 256: the kernels that take it), else this document's keys/values repeated -- never the whole row's.
        gqa = groups > 1 and block is None and k.shape[-1] == v.shape[-1] <= 256 and sinks is None
        if groups > 1 and not gqa:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if sinks is not None:
            got = _sink_attention(
                torch,
                (q, k, v),
                block,
                use_causal,
                scaling=scaling,
                sinks=sinks,
                dropout=dropout,
                module=module,
            )
        else:
            got = sdpa(
                q,
                k,
                v,
                attn_mask=block,
                dropout_p=dropout,
                scale=scaling,
                is_causal=use_causal,
                enable_gqa=gqa,
            )
        got = got.transpose(1, 2)
        if tracked:
            outs.append(got)
            continue
        if out is None:
            out = got.new_empty((got.shape[0], query.shape[2], *got.shape[2:]))
        out[:, start:end] = got
    if tracked and outs:  # one copy, straight into ``[batch, tokens, heads, dim]``
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()
    if out is None:  # a row of no tokens
        out = query.new_empty((query.shape[0], 0, query.shape[1], value.shape[-1]))
    return out, None


#: transformers' attention function for :data:`SEGMENTED_SDPA` (:func:`_segmented_sdpa` behind the signature).
segmented_sdpa_forward = attention_function(_segmented_sdpa, "segmented_sdpa_forward")


def _sink_attention(
    torch: Any,
    qkv: tuple[Any, Any, Any],
    block: Any,
    causal: bool,
    *,
    scaling: Any,
    sinks: Any,
    dropout: float,
    module: Any,
) -> Any:
    """One document's attention with sinks: the softmax over its keys and one extra logit per head (``sinks``,
    dropped after the softmax), as GPT-OSS's eager attention computes it; ``[1, heads, L, L]`` scores, one
    document at a time (never the row's)."""
    q, k, v = qkv
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    length = q.shape[2]
    if block is not None:
        scores = scores.masked_fill(~block, float("-inf")) if block.dtype == torch.bool else scores + block
    elif causal:
        keep = torch.ones(length, length, dtype=torch.bool, device=q.device).tril_()
        scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, length, 1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    training = bool(getattr(module, "training", False))
    probs = torch.nn.functional.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v)


def register(*, owner: Any = None) -> str:
    """Register :data:`SEGMENTED_SDPA` with transformers (:func:`segmented_sdpa_forward`, :func:`document_mask`).

    With an ``owner``, undoing it (``unprepare``) takes the entries out again once no owner needs them.

    >>> register()
    'packtools_sdpa'
    """
    _functions()
    return register_attention(SEGMENTED_SDPA, segmented_sdpa_forward, owner=owner, mask=document_mask)
