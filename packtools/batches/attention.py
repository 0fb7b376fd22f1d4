"""Variable-length (padding-free) attention: flash-attn when it can run, an exact PyTorch reference otherwise.

Tokens of several sequences are laid end to end: ``q`` is ``(total_q, heads, head_dim)`` and sequence ``i``
owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` (likewise for ``k``/``v`` with ``cu_seqlens_k``).  No token
attends outside its own sequence.  With ``causal=True`` and sequences of different query/key lengths, the
causal mask is aligned to the bottom-right corner, as flash-attn >= 2.1 does; query rows that see no key give 0.

The reference runs ``scaled_dot_product_attention`` once per sequence (memory ``O(sum L^2)``, not ``O(T^2)``),
so it is correct forward and backward on CPU in any dtype; grouped-query attention (fewer k/v heads, query
head ``h`` reading k/v head ``h // (heads_q // heads_k)``) is supported by both paths.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import ModuleType
from typing import Any

from .._optional import require
from ..errors import PackingError

BACKENDS = ("auto", "flash", "torch", "reference")


def _torch() -> ModuleType:
    return require("torch", "packtools.batches.varlen_attention")


def _flash_module() -> ModuleType | None:
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def check_cu_seqlens(cu: Any, name: str, total: int, max_seqlen: object, max_name: str) -> list[int]:
    """Validate ``cu_seqlens`` (int32, 1-D, 0 first, strictly increasing, ``total`` last) and ``max_seqlen``.

    A tail repeating ``total`` (empty trailing sequences: the fixed-size ``cu_seqlens`` that
    ``PaddingFreeCollator(pad_cu_seq_lens_to=...)`` writes for CUDA graphs) is allowed.  Returns the
    boundaries as Python ints, without that tail.
    """
    torch = _torch()
    if not isinstance(cu, torch.Tensor):
        raise PackingError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}.")
    if cu.dtype != torch.int32:
        raise PackingError(
            f"{name} has dtype {cu.dtype}; flash-attn needs int32. Use {name}.to(torch.int32)."
        )
    if cu.dim() != 1 or cu.numel() < 2:
        raise PackingError(f"{name} must be 1-D with n + 1 >= 2 entries, got shape {tuple(cu.shape)}.")
    bounds = cu.tolist()
    while len(bounds) > 2 and bounds[-1] == bounds[-2] == total:
        bounds.pop()
    if bounds[0] != 0:
        raise PackingError(f"{name}[0] = {bounds[0]}; cumulative sequence lengths start at 0.")
    steps = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    bad = next((i for i, s in enumerate(steps) if s <= 0), None)
    if bad is not None:
        raise PackingError(
            f"{name} is not strictly increasing at index {bad + 1} ({bounds[bad]} -> {bounds[bad + 1]}); "
            f"sequence {bad} would be empty or negative. Drop empty sequences."
        )
    if bounds[-1] != total:
        raise PackingError(
            f"{name}[-1] = {bounds[-1]} but the tensor has {total} tokens; the last boundary must be the total."
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise PackingError(
            f"{max_name} must be a Python int, got {max_seqlen!r} ({type(max_seqlen).__name__})."
        )
    longest = max(steps)
    if max_seqlen < longest:
        raise PackingError(
            f"{max_name}={max_seqlen} is smaller than the longest sequence ({longest} tokens, sequence "
            f"{steps.index(longest)}); flash-attn would silently skip rows. Pass {max_name}={longest}."
        )
    return bounds


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    torch = _torch()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise PackingError(f"{name} must be a (total_tokens, heads, head_dim) tensor, got {shape}.")
    if k.shape[:2] != v.shape[:2]:
        raise PackingError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same tokens and heads.")
    if q.shape[2] != k.shape[2]:
        raise PackingError(f"q head_dim {q.shape[2]} differs from k head_dim {k.shape[2]}.")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk:
        raise PackingError(
            f"q has {hq} heads and k/v have {hk}; grouped-query attention needs heads_q to be a multiple of heads_k."
        )


def _reference(
    q: Any, k: Any, v: Any, bq: list[int], bk: list[int], causal: bool, scale: float, dropout_p: float = 0.0
) -> Any:
    torch = _torch()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    outs = []
    for i in range(len(bq) - 1):
        qs = q[bq[i] : bq[i + 1]].transpose(0, 1)  # (heads, Lq, D)
        ks = k[bk[i] : bk[i + 1]].transpose(0, 1)
        vs = v[bk[i] : bk[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        if not causal:
            out = sdpa(qs, ks, vs, scale=scale, dropout_p=dropout_p)
        elif lq == lk:
            out = sdpa(qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout_p)
        else:
            # Bottom-right aligned causal mask: query i sees keys j <= i + (lk - lq); rows seeing none give 0.
            first = max(0, lq - lk)
            rows = torch.arange(first, lq, device=q.device)[:, None]
            mask = torch.arange(lk, device=q.device)[None, :] <= rows + (lk - lq)
            seen = sdpa(qs[:, first:], ks, vs, attn_mask=mask, scale=scale, dropout_p=dropout_p)
            out = torch.cat([seen.new_zeros(seen.shape[0], first, seen.shape[2]), seen], dim=1)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _torch_varlen() -> Any:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, CUDA kernels only), or None."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def torch_varlen_kwargs(fn: Any, causal: bool, scale: float, heads_q: int, heads_k: int) -> dict[str, Any]:
    """Keyword arguments for the installed ``varlen_attn`` (its keywords changed across torch releases).

    torch 2.13: ``window_size=(-1, 0)`` is causal (bottom-right aligned, as flash-attn), ``(-1, -1)`` full;
    ``enable_gqa`` for fewer k/v heads; ``scale``.  Older releases took ``is_causal``.  Raises
    :class:`PackingError` when the signature offers neither, rather than guess.
    """
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        raise PackingError(
            f"torch.nn.attention.varlen.varlen_attn{inspect.signature(fn)} takes neither window_size nor "
            f"is_causal; packtools cannot tell it causality. Install flash-attn, or use backend='reference'."
        )
    if "scale" not in params:
        raise PackingError(
            f"torch.nn.attention.varlen.varlen_attn{inspect.signature(fn)} takes no scale; install flash-attn, "
            f"or use backend='reference'."
        )
    kwargs["scale"] = scale
    if heads_q != heads_k:
        if "enable_gqa" not in params:
            raise PackingError(
                f"q has {heads_q} heads and k/v {heads_k}, but this torch's varlen_attn has no enable_gqa; "
                f"install flash-attn, or use backend='reference'."
            )
        kwargs["enable_gqa"] = True
    return kwargs


def _flash_eligible(q: Any, k: Any, v: Any) -> bool:
    torch = _torch()
    half = (torch.float16, torch.bfloat16)
    return bool(q.is_cuda and q.dtype in half and k.dtype == q.dtype and v.dtype == q.dtype)


#: Keys of a PaddingFreeCollator batch that varlen_attention accepts and ignores (``**batch`` works).
BATCH_KEYS = ("input_ids", "labels", "position_ids", "seq_idx", "use_cache")
#: Collator spellings of the boundary arguments, and flash-attn's.
ALIASES = {
    "cu_seq_lens_q": "cu_seqlens_q",
    "cu_seq_lens_k": "cu_seqlens_k",
    "max_length_q": "max_seqlen_q",
    "max_length_k": "max_seqlen_k",
}


def _boundaries(given: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Merge flash-attn names and collator names into flash-attn names; refuse unknown or doubled ones."""
    unknown = sorted(k for k in extra if k not in ALIASES and k not in BATCH_KEYS)
    if unknown:
        raise TypeError(
            f"varlen_attention() got unexpected keyword arguments {unknown}; it takes cu_seqlens_q/k and "
            f"max_seqlen_q/k (or the collator's cu_seq_lens_q/k and max_length_q/k), then keyword-only "
            f"causal, softmax_scale, dropout_p, backend, check."
        )
    out = dict(given)
    for alias, name in ALIASES.items():
        if extra.get(alias) is None:
            continue
        if out[name] is not None and out[name] is not extra[alias]:
            raise PackingError(f"varlen_attention got both {name} and {alias}; pass one of them.")
        out[name] = extra[alias]
    missing = [name for name, value in out.items() if value is None]
    if missing:
        raise PackingError(
            f"varlen_attention needs {missing} (or the collator's {[a for a, n in ALIASES.items() if n in missing]}); "
            f"pass them, e.g. varlen_attention(q, k, v, **batch) with a PaddingFreeCollator batch."
        )
    return out


def varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    check: bool = True,
    **batch: Any,
) -> Any:
    """Attention over sequences laid end to end, never crossing a sequence boundary.

    ``q`` is ``(total_q, heads_q, head_dim)``, ``k``/``v`` are ``(total_k, heads_k, head_dim)`` with
    ``heads_q`` a multiple of ``heads_k``; ``cu_seqlens_*`` are int32 boundaries ``[0, ..., total]`` and
    ``max_seqlen_*`` Python ints >= the longest sequence.  Returns ``(total_q, heads_q, head_dim)``.

    The boundaries may also be passed under the collator's names (``cu_seq_lens_q``, ``cu_seq_lens_k``,
    ``max_length_q``, ``max_length_k``), so ``varlen_attention(q, k, v, **batch)`` works with a
    ``PaddingFreeCollator`` batch (its ``input_ids``, ``labels``, ``position_ids`` and ``seq_idx`` are
    ignored).  Everything after the boundaries is keyword-only: ``causal`` (default True),
    ``softmax_scale``, ``dropout_p`` (default 0), so flash-attn's positional call shape
    ``(q, k, v, cu, cu, m, m, dropout_p)`` raises instead of silently turning causality off.

    ``backend="auto"`` calls ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed and the tensors
    are CUDA float16/bfloat16; without flash-attn, on those tensors, PyTorch's own
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9; keywords read from the installed signature,
    :func:`torch_varlen_kwargs`; not with dropout); else the PyTorch reference.  ``"flash"``, ``"torch"`` or
    ``"reference"`` force one.  ``check``
    validates ``cu_seqlens`` and ``max_seqlen`` (on CUDA this reads the boundaries back to the host once).

    >>> import torch
    >>> q = k = v = torch.randn(5, 2, 4)
    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> out = varlen_attention(q, k, v, cu, cu, max_seqlen_q=3, max_seqlen_k=3)
    >>> out.shape
    torch.Size([5, 2, 4])
    >>> alone = torch.tensor([0, 2], dtype=torch.int32)  # the second sequence on its own
    >>> torch.allclose(out[3:], varlen_attention(q[3:], k[3:], v[3:], alone, alone, 2, 2), atol=1e-6)
    True
    >>> batch = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 3, "max_length_k": 3}
    >>> torch.equal(varlen_attention(q, k, v, **batch), out)
    True
    """
    args = _boundaries(
        {
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k,
        },
        batch,
    )
    cu_seqlens_q, cu_seqlens_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    max_seqlen_q, max_seqlen_k = args["max_seqlen_q"], args["max_seqlen_k"]
    if backend not in BACKENDS:
        raise PackingError(f"backend={backend!r}; use one of {', '.join(BACKENDS)}.")
    if not isinstance(causal, bool):
        raise PackingError(f"causal must be True or False, got {causal!r}.", param="causal")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise PackingError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}.", param="dropout_p")
    _check_qkv(q, k, v)
    bq = bk = None
    if check or backend != "flash":
        bq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        bk = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
        if len(bq) != len(bk):
            raise PackingError(
                f"cu_seqlens_q has {len(bq) - 1} sequences but cu_seqlens_k has {len(bk) - 1}; they must match."
            )
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    flash = None
    if backend == "flash":
        flash = require("flash_attn", "varlen_attention(backend='flash')")
    elif backend == "auto" and _flash_eligible(q, k, v):
        flash = _flash_module()
    torch_fn = None
    if backend == "torch" or (backend == "auto" and flash is None and _flash_eligible(q, k, v)):
        torch_fn = _torch_varlen()
        if backend == "torch" and (torch_fn is None or not _flash_eligible(q, k, v)):
            raise PackingError(
                "backend='torch' needs torch.nn.attention.varlen.varlen_attn (torch >= 2.9) and CUDA "
                "float16/bfloat16 tensors (it has no CPU kernel); use backend='reference' elsewhere.",
                param="backend",
            )
        if dropout_p > 0.0:  # varlen_attn has no dropout
            if backend == "torch":
                raise PackingError("varlen_attn has no dropout; use dropout_p=0 or another backend.")
            torch_fn = None
    if torch_fn is not None:
        return torch_fn(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            **torch_varlen_kwargs(torch_fn, causal, scale, q.shape[1], k.shape[1]),
        )
    if flash is not None:
        return flash.flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            dropout_p=float(dropout_p),
            softmax_scale=scale,
            causal=causal,
        )
    assert bq is not None and bk is not None
    return _reference(q, k, v, bq, bk, causal, scale, float(dropout_p))
