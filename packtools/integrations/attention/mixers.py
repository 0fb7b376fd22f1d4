"""Layers that mix tokens outside attention, run one document at a time on a packed row.

Hybrid models (Qwen3.5 and Qwen3-Next's gated DeltaNet, Kimi Linear's delta attention, LFM2's short
convolutions, the Mamba-2 layers of Nemotron-H, Bamba and Falcon-H1) have layers that carry a state or a
convolution window along the row.  They ignore ``position_ids``; they keep packed documents apart only with
``seq_idx`` / ``cu_seq_lens`` *and* a CUDA kernel that reads them (causal-conv1d, mamba-ssm,
flash-linear-attention).  Without one, transformers' PyTorch fallback either refuses such a batch or, given only
``position_ids``, runs the row as one sequence: each document's state starts where the previous one ended.

:func:`run_mixers_per_document` decides once per model, when it is prepared, how each such layer keeps
documents apart, and reports it (:func:`document_mixers` gives the :class:`DocumentMixers`, whose ``summary()``
names the layers; it is also logged at INFO on the ``packtools`` logger):

* ``per-document``: the layer runs on each document's tokens alone, state and convolution window from zero, as
  the model runs a document alone; each output is written into the row's (no ``cat``).  Exact on any device; the
  cost is one layer call per document instead of one per row.  Mamba-2 and short-convolution layers
  (:data:`RECOMPUTED`) would keep more for backward that way than over the whole row (each document's own zero
  start state, partial chunk and convolution edge), so their documents run without keeping anything but the
  layer's input and run again in backward, unless the decoder layer is checkpointed already.
* ``varlen kernel``: on CUDA with the layer family's kernels installed (``causal_conv1d`` for every family, plus
  ``fla`` for DeltaNet / delta attention, ``mamba_ssm`` for Mamba-2), the layer runs once over the row with
  ``seq_idx`` (``[1, T]`` int32, the document index of each token) and ``cu_seq_lens_q`` (int32 boundaries), the
  inputs transformers hands those kernels (``causal_conv1d_fn(seq_idx=)``, ``chunk_gated_delta_rule(cu_seqlens=)``,
  ``mamba_chunk_scan_combined(seq_idx=)``).  A kernel that is missing at run time makes transformers raise
  ("can't keep packed sequences apart"), never run the row as one; a batch of several rows, or inputs off CUDA,
  take the per-document path.

How the boundaries reach the layers: one forward pre-hook on the model's decoder (``get_decoder()``, which its
causal-LM head calls through ``__call__``) reads them from ``position_ids`` (a document starts where a position
does not follow the previous one by 1, the rule transformers' masks use) or, without them, from
``cu_seq_lens_q``, with one host sync per forward, and passes them down that forward's keyword arguments as
:class:`Segments` under :data:`SEGMENTS_KEY`.  transformers hands a decoder's keyword arguments to every layer
and from there to the mixers, and a checkpointed layer keeps them for its recomputation, so the boundaries of
one forward are never those of another (gradient checkpointing, a reference model's forward in between);
attention functions take and ignore unknown keyword arguments.  Rows without a restart carry no segments and run
unchanged.

The same hook gives models whose forward builds its attention masks without ``position_ids`` (GPT-OSS, whose
masks would otherwise let packed documents see each other) the masks built from them
(:data:`POSITIONLESS_MASKS`): transformers' own mask functions, passed as the per-layer-type mapping the model
accepts in place of ``attention_mask``.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._optional import require
from ...compat.torch import forward_hook, forward_pre_hook
from ...compat.transformers import document_scan, packed_position_masks, replace_mixer_forward
from ...constants import VARLEN_KEYS
from ...errors import PackingError
from .backends import base_model, token_mixing_layers

#: The keyword argument that carries a forward's :class:`Segments` from the decoder down to the mixers.
SEGMENTS_KEY = "packtools_segments"
#: Keys a per-document call does not pass on (the row's boundaries, which a single document does not have).
_ROW_KEYS = (*VARLEN_KEYS, "seq_idx", SEGMENTS_KEY)
#: The names transformers passes a layer's cache under (5.25: ``cache``; earlier: ``cache_params``,
#: ``past_key_values``): a cache filled on a packed row would hand each document the previous one's state.
_CACHE_KEYS = ("cache", "cache_params", "past_key_values")
#: Where the model keeps its :class:`DocumentMixers` (read with :func:`document_mixers`).
_ATTR = "_packtools_document_mixers"
#: Model types whose forward builds attention masks without ``position_ids`` (checked in transformers 5.25).
POSITIONLESS_MASKS = ("gpt_oss",)
#: The kernel packages a layer family needs for its varlen path (by a part of the layer's class name).
KERNELS = (
    ("Mamba", ("causal_conv1d", "mamba_ssm")),
    ("Mixer", ("causal_conv1d", "mamba_ssm")),
    ("Delta", ("causal_conv1d", "fla")),
    ("ShortConv", ("causal_conv1d",)),
)

#: Layer families (by a part of the class name) whose per-document calls are recomputed in backward instead of
#: keeping what they save: Mamba-2 (``Mamba``, ``Mixer``: its PyTorch scan keeps a state per chunk, and each
#: document adds a zero start state and a partial chunk) and short convolutions (``ShortConv``: each document keeps
#: its own ``kernel - 1`` edge columns of the padded convolution), which otherwise hold more for backward than the
#: layer run over the whole row (docs/training.md, ``benchmarks/bench_mixers.py``).  The delta-rule layers hold
#: less per document than over the row (the row pads to the scan's chunk) and keep theirs.
RECOMPUTED = ("Mamba", "Mixer", "ShortConv")
#: Layers (by class name) whose forward hands their mixer no ``seq_idx`` / ``cu_seq_lens`` (transformers 5.25's
#: Mamba-1 blocks call it with the hidden states, cache and mask only, and Mamba-1's scan reads no ``seq_idx``):
#: they take the per-document path even where the varlen kernels are installed.
NO_VARLEN = ("MambaBlock", "FalconMambaBlock")


@dataclass(frozen=True)
class Segments:
    """One forward's document boundaries: ``bounds[b]`` are row ``b``'s ``[0, ..., T]``."""

    bounds: tuple[tuple[int, ...], ...]
    length: int


def passed_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache a forward's inputs pass in (``past_key_values``, or ``cache``), or ``None``."""
    cache = kwargs.get("past_key_values")
    return cache if cache is not None else kwargs.get("cache")


def generating(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's inputs are a generation step: a cache passed in that holds tokens
    (:func:`holds_tokens`), or with one token per row (a decode step: no row to judge, and a count held on the GPU
    is not read).  :func:`segments_of` and the guard's checks (``integrations.trainers.guard``) leave those
    alone.  An empty cache is no generation step: with a packed row it is what the guard refuses (with a cache
    transformers builds no per-sequence mask from ``position_ids``), so those inputs are checked.

    >>> generating({"past_key_values": None}), generating({"cache": object()}), generating({"cache": ()})
    (False, True, False)
    """
    cache = passed_cache(kwargs)
    if cache is None:
        return False
    return query_width(kwargs) == 1 or holds_tokens(cache)


def query_width(kwargs: Mapping[str, Any]) -> int | None:
    """Tokens per row of a forward's inputs (``input_ids``' last dimension, ``inputs_embeds``' one before), or
    ``None`` when neither is given.

    >>> import numpy as np
    >>> query_width({"input_ids": np.zeros((2, 1))}), query_width({"inputs_embeds": np.zeros((1, 5, 8))})
    (1, 5)
    """
    ids = kwargs.get("input_ids")
    if getattr(ids, "ndim", 0) >= 1:
        return int(ids.shape[-1])
    embeds = kwargs.get("inputs_embeds")
    if getattr(embeds, "ndim", 0) >= 2:
        return int(embeds.shape[-2])
    return None


def holds_tokens(cache: Any) -> bool:
    """Whether a cache passed to a forward holds tokens: a transformers ``Cache`` by ``get_seq_length()``, an int
    or a 0-d tensor (``StaticCache``'s layers count in a tensor on the cache's device once initialized: on the
    GPU it is read with one host sync, only for a forward of several tokens per row, :func:`generating`); a
    legacy tuple by its length; any other object, or a count that is no number, counts as holding tokens (a
    generation step).

    >>> import torch
    >>> from types import SimpleNamespace as NS
    >>> holds_tokens(NS(get_seq_length=lambda: torch.tensor(0))), holds_tokens(NS(get_seq_length=lambda: 3))
    (False, True)
    """
    if isinstance(cache, (tuple, list)):
        return len(cache) > 0
    if not callable(getattr(cache, "get_seq_length", None)):
        return True
    # (before: a count on the GPU was taken for tokens held without reading it, so an empty StaticCache on CUDA
    # -- reset, or initialized early -- let a packed row through unchecked)
    count = cache.get_seq_length()
    try:
        return int(count) > 0
    except (TypeError, ValueError, RuntimeError):  # no count (None, several): as any other object
        return True


def breaks(ids: Any, attention_mask: Any = None, step: int = 1) -> Any:
    """Where a row's ``ids`` do not step by ``step`` from one token to the next (position ids by 1: a packed
    sequence starts; ``seq_idx`` by 0), shape ``[..., T - 1]``; with ``attention_mask`` only between two attended
    tokens, as transformers' masks read them, so left or right padding is no boundary.  NumPy or torch.

    >>> import numpy as np
    >>> bool(breaks(np.array([[1, 1, 0, 1, 2]]), np.array([[0, 0, 1, 1, 1]])).any())
    False
    """
    broken = (ids[..., 1:] - ids[..., :-1]) != step
    if attention_mask is not None:
        broken = broken & (attention_mask[..., 1:] != 0) & (attention_mask[..., :-1] != 0)
    return broken


def rotary_starts(positions: Any, attention_mask: Any = None) -> Any:
    """Where ``(3, B, T)`` rotary positions (temporal, height, width: Qwen-VL's, as the model computes them
    without a text row) return to ``(0, 0, 0)`` from anywhere but ``-1``, shape ``[B, T - 1]`` like
    :func:`breaks`: a new document.  Inside one document they never do (text counts on from the previous maximum,
    an image's tokens share its temporal position and start at the next one), so an image is no boundary; and a
    document starts after the previous one's last position, never after ``-1``: positions that count up through
    0 (transformers' ``arange + rope_deltas`` for a forward given ``inputs_embeds`` alone after one with images,
    the deltas negative) are one sequence, as the model's attention reads them.  NumPy or torch.

    >>> import numpy as np
    >>> one = np.array([[[0, 1, 1, 1, 3]], [[0, 1, 1, 2, 3]], [[0, 1, 2, 1, 3]]])  # text, a 2x2 image, text
    >>> bool(rotary_starts(one).any()), rotary_starts(np.concatenate([one, one], -1)).nonzero()[1].tolist()
    (False, [4])
    >>> bool(rotary_starts(np.arange(-2, 3)[None, None].repeat(3, 0)).any())  # -2, -1, 0, 1, 2
    False
    """
    zero = (positions == 0).all(0)  # [B, T]
    starts = zero[..., 1:] & (positions[0, ..., :-1] != -1)
    if attention_mask is not None:
        starts = starts & (attention_mask[..., 1:] != 0) & (attention_mask[..., :-1] != 0)
    return starts


def segments_of(kwargs: dict[str, Any]) -> Segments | None:
    """The documents of a forward's inputs, or ``None`` when no row holds more than one (one host sync): from
    ``position_ids`` (a document starts where a position does not follow the previous one by 1: 2-D ones, or the
    text row of Qwen-VL's ``(4, B, T)``; the ``(3, B, T)`` temporal/height/width rows the model computes itself
    stay put or jump inside an image, so there a document starts only where all three are 0 again,
    :func:`rotary_starts`), else ``seq_idx`` (where it changes), else ``cu_seq_lens_q`` (one row).  With a 2-D ``attention_mask`` only a
    step between two attended tokens counts, as in transformers' masks: the positions a left-padded prefill gives
    its padding (``[1, 1, 0, 1, 2]``) are no documents, and the row runs whole, its cache included.

    >>> import torch
    >>> segments_of({"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
    Segments(bounds=((0, 3, 5),), length=5)
    >>> segments_of({"position_ids": torch.tensor([[0, 1, 2]])}) is None
    True
    >>> pads = torch.tensor([[0, 0, 1, 1, 1]])  # a left-padded row's mask, and the positions its prefill gives
    >>> segments_of({"position_ids": torch.tensor([[1, 1, 0, 1, 2]]), "attention_mask": pads}) is None
    True
    >>> image = torch.tensor([[[0, 1, 1, 1, 1, 3]], [[0, 1, 1, 2, 2, 3]], [[0, 1, 2, 1, 2, 3]]])  # text, 2x2, text
    >>> segments_of({"position_ids": image}) is None, segments_of({"position_ids": torch.cat([image, image], -1)})
    (True, Segments(bounds=((0, 6, 12),), length=12))
    """
    if generating(kwargs):
        return None
    pos, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    zeros = None  # (3, B, T) rotary positions: a document starts where all three are 0 again
    if pos is not None and getattr(pos, "ndim", 0) == 3:
        if pos.shape[0] == 3:  # temporal, height, width: the temporal row stays put over an image
            zeros, pos = pos, None
        else:  # (4, B, T): the first axis is the text row, the token's position
            pos = pos[0]
    seq_idx = kwargs.get("seq_idx")
    mask = kwargs.get("attention_mask")  # padding starts no document (the positions a prefill gives its pads)
    for ids, step in ((pos, 1), (seq_idx, 0), (zeros, None)):  # where positions jump / seq_idx changes
        if (
            ids is not None
            and getattr(ids, "ndim", 0) == (2 if step is not None else 3)
            and ids.shape[-1] > 1
        ):
            rows, length = int(ids.shape[-2]), int(ids.shape[-1])
            fits = getattr(mask, "ndim", 0) == 2 and tuple(mask.shape) == (rows, length)
            starts = (
                rotary_starts(ids, mask if fits else None)
                if step is None
                else breaks(ids, mask if fits else None, step)
            )
            starts = starts.nonzero().tolist()
            if starts:
                per_row: list[list[int]] = [[0] for _ in range(rows)]
                for row, index in starts:
                    per_row[row].append(index + 1)
                return Segments(tuple((*b, length) for b in per_row), length)
    if cu is not None and getattr(cu, "ndim", 0) == 1 and len(cu) > 2:
        bounds = tuple(int(b) for b in cu.tolist())
        return Segments((bounds,), bounds[-1])
    return None


def kernel_ready(module: Any, device: Any) -> bool:
    """Whether ``module``'s family has its varlen kernels installed and the module is on CUDA."""
    if getattr(device, "type", None) != "cuda":
        return False
    name = type(module).__name__
    if name in NO_VARLEN:
        return False
    for part, packages in KERNELS:
        if part in name:
            return all(importlib.util.find_spec(p) is not None for p in packages)
    return False


class _PerDocument:
    """The ``forward`` of one token-mixing layer on packed rows (see the module docstring)."""

    #: What :func:`packtools.integrations.attention.backends.token_mixing_layers` reads: this layer is handled.
    keeps_documents_apart = True

    def __init__(self, name: str, original: Any, kernel: bool, module: Any = None, layer: Any = None) -> None:
        self.name, self.original, self.kernel, self.module = name, original, kernel, module
        #: recomputed in backward (:data:`RECOMPUTED`); ``layer``: the decoder layer holding it (a weak reference)
        self.recompute = any(part in type(module).__name__ for part in RECOMPUTED)
        self.layer = weakref.ref(layer) if layer is not None else None
        #: the documents of the call of ``layer`` running now, set around it by :func:`_layer_hooks`
        self.from_layer: Segments | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied with its model: the decoder layer held strongly there (a weak reference can be
        neither pickled nor mapped to the copy's layer), weakly again after (:meth:`__setstate__`); the layer's
        own ``forward`` as its function and module (pickle would look ``forward`` up again: this wrapper)."""
        state = dict(vars(self))
        state["layer"] = None if self.layer is None else self.layer()
        state["from_layer"] = None
        if isinstance(self.original, types.MethodType):  # pickled as getattr(module, "forward"): this wrapper
            state["original"] = (self.original.__func__, self.original.__self__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        layer = state.pop("layer")
        if isinstance(state["original"], tuple):
            state["original"] = types.MethodType(*state["original"])
        vars(self).update(state)
        self.layer = weakref.ref(layer) if layer is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        segments = kwargs.pop(SEGMENTS_KEY, None)
        if segments is None:  # a decoder layer that does not hand its keyword arguments on (_layer_hooks)
            segments = self.from_layer
        if segments is None:  # every row is one document (segments_of): the row's boundaries say nothing more
            if not self.kernel:
                kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KEYS}
            return self.original(*args, **kwargs)
        cache = next((k for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
        if cache is not None:
            raise PackingError(
                f"the token-mixing layer {self.name} got a cache ({cache}=) with a packed row: it would carry its "
                f"state and convolution window from each document into the next. Pass use_cache=False on packed "
                f"batches (packtools.integrations.trainers.guard.guard_model(model) passes it whenever the caller "
                f"does not choose; the model's config defaults to use_cache=True)."
            )
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = args[1:]
        rows, length = int(hidden.shape[0]), int(hidden.shape[1])
        if length != segments.length or rows != len(segments.bounds):
            raise PackingError(
                f"the token-mixing layer {self.name} got hidden states of shape {tuple(hidden.shape[:2])} while "
                f"its forward's documents cover {len(segments.bounds)} row(s) of {segments.length} tokens; "
                f"packtools cannot tell which tokens belong together. Do not pack for this model, or report it."
            )
        if self.kernel and rows == 1 and hidden.is_cuda:
            return self.original(hidden, *rest, **self._varlen(kwargs, segments.bounds[0], hidden.device))
        kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KEYS}
        torch = require("torch", "packtools per-document mixers")
        params = [p for p in self.module.parameters() if p.requires_grad] if self.recompute else []
        others = [v for v in (*rest, *kwargs.values()) if getattr(v, "requires_grad", False)]
        if self.recompute and not others:  # weights the layer reads that are no registered parameter (FSDP1's
            # views of its flat parameter, use_orig_params=False): the recomputation would not hand them theirs
            others = [
                v
                for m in self.module.modules()
                for v in vars(m).values()
                if isinstance(v, torch.Tensor) and v.requires_grad
            ]
        if (
            self.recompute
            and (params or hidden.requires_grad)
            and not others  # a tensor needing gradients the recomputation would not hand back: kept instead
            and torch.is_grad_enabled()
            and not self._layer_recomputes()
        ):
            run = lambda h: self._documents(torch, segments, h, rest, kwargs)  # noqa: E731
            return _recomputed(torch).apply(run, hidden, *params)
        return self._documents(torch, segments, hidden, rest, kwargs)

    def _layer_recomputes(self) -> bool:
        """Whether the decoder layer holding this one is checkpointed (transformers' gradient checkpointing,
        ``GradientCheckpointingLayer``): its backward runs the layer again, so what it saves is held only then."""
        layer = self.layer() if self.layer is not None else None
        return bool(getattr(layer, "gradient_checkpointing", False) and getattr(layer, "training", False))

    def _documents(self, torch: Any, segments: Segments, hidden: Any, rest: tuple, kwargs: dict) -> Any:
        """The layer run on each document of each row, written into one output of the row's shape."""
        rows, length = int(hidden.shape[0]), int(hidden.shape[1])
        out = None  # the row's output, each document written into it as it comes (_write_into)
        for row, bounds in enumerate(segments.bounds):
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                local = {k: _slice(v, rows, length, row, start, end) for k, v in kwargs.items()}
                with document_scan(self.module, end - start) as chunk:  # its chunked scan at its own size
                    args = tuple(_slice(v, rows, length, row, start, end) for v in rest)
                    got = self.original(hidden[row : row + 1, start:end], *args, **local, **chunk)
                if not hasattr(got, "shape") or tuple(got.shape[:2]) != (1, end - start):
                    raise PackingError(
                        f"the token-mixing layer {self.name} returned {type(got).__name__} for a document of "
                        f"{end - start} tokens, not a [1, {end - start}, hidden] tensor: packtools cannot run it "
                        f"per document. Do not pack for this model, or report it."
                    )
                if out is None:
                    out = got.new_empty((rows, length, *got.shape[2:]))
                out = _write_into(torch).apply(out, got, row, start)
        return out

    @staticmethod
    def _varlen(kwargs: dict[str, Any], bounds: tuple[int, ...], device: Any) -> dict[str, Any]:
        torch = require("torch", "packtools varlen mixers")
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        lengths = cu[1:] - cu[:-1]
        seq_idx = torch.repeat_interleave(
            torch.arange(len(lengths), device=device, dtype=torch.int32), lengths
        )
        out = {k: v for k, v in kwargs.items() if k not in _ROW_KEYS}
        out.update(seq_idx=seq_idx[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        return out


_WRITE: list[Any] = []
_RECOMPUTE: list[Any] = []


def _recomputed(torch: Any) -> Any:
    """An autograd function running a layer's documents without keeping what they save for backward: forward
    under ``no_grad``, holding only the layer's input; backward runs them again with the same random state and
    autocast, and hands the gradients of the input and of the layer's parameters (its inputs, so gradients reach
    them under ``backward()`` and ``autograd.grad`` alike) on.  What torch's ``checkpoint`` does, without its
    bookkeeping of every saved tensor, which cost more than the recomputation itself on the benchmark's tiny models."""
    if not _RECOMPUTE:

        class Recomputed(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, run: Any, hidden: Any, *params: Any) -> Any:
                device = hidden.device.type
                ctx.run, ctx.params, ctx.device = run, params, device
                ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                ctx.rng = (
                    torch.get_rng_state(),
                    (torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None),
                )
                ctx.save_for_backward(hidden)
                with torch.no_grad():
                    return run(hidden)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
                (hidden,) = ctx.saved_tensors
                wants_input = ctx.needs_input_grad[1]
                again = hidden.detach().requires_grad_(wants_input)
                cuda = [hidden.device] if ctx.rng[1] is not None else []
                enabled, dtype = ctx.autocast
                with torch.random.fork_rng(devices=cuda), torch.enable_grad():
                    torch.set_rng_state(ctx.rng[0])
                    if cuda:
                        torch.cuda.set_rng_state(ctx.rng[1], hidden.device)
                    with torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
                        out = ctx.run(again)
                wanted = ([again] if wants_input else []) + list(ctx.params)
                got = list(torch.autograd.grad(out, wanted, grad, allow_unused=True))
                return (None, got.pop(0) if wants_input else None, *got)

        _RECOMPUTE.append(Recomputed)
    return _RECOMPUTE[0]


def _write_into(torch: Any) -> Any:
    """An autograd function writing one document's output into the row's buffer, in place (``mark_dirty``).

    Its backward hands the document its slice of the gradient (a view) and passes the rest on unchanged: the
    documents' slices are disjoint, so no slice needs zeroing and nothing is copied.  Each document's output is
    freed once written, so the row's output is never held twice (a ``cat`` would hold it with its pieces).
    """
    if not _WRITE:

        class WriteInto(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, out: Any, piece: Any, row: int, start: int) -> Any:
                ctx.where = (row, start, start + piece.shape[1])
                ctx.mark_dirty(out)
                out[row : row + 1, start : start + piece.shape[1]] = piece
                return out

            @staticmethod
            def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
                row, start, end = ctx.where
                return grad, grad[row : row + 1, start:end], None, None

        _WRITE.append(WriteInto)
    return _WRITE[0]


def _slice(value: Any, rows: int, length: int, row: int, start: int, end: int) -> Any:
    """A per-token tensor argument (``[rows, length, ...]``, e.g. a padding mask or ``position_ids``) cut to one
    document; a 4-D attention mask over the row (``[rows, heads, length, length]``, which a decoder layer run per
    document gets, e.g. RecurrentGemma's) cut to the document's own block of it."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 2 and tuple(shape[:2]) == (rows, length):
        return value[row : row + 1, start:end]
    if shape is not None and len(shape) == 4 and shape[0] == rows and tuple(shape[2:]) == (length, length):
        if type(value).__name__ == "BlockMask":  # flex_attention's: no cut of it can be used
            raise PackingError(
                f"a layer run per document gets the packed row's {type(value).__name__} attention mask, which "
                f"packtools cannot cut to one document: use attn_implementation='sdpa' or 'eager' for this model.",
                param="attn_implementation",
            )
        return value[row : row + 1, :, start:end, start:end]
    return value


@dataclass
class DocumentMixers:
    """What :func:`run_mixers_per_document` installed on one model: its layers' modes, and the decoder's hook."""

    model: str
    modes: dict[str, str]
    masks_from_positions: bool
    #: the per-document layers recomputed in backward (:data:`RECOMPUTED`)
    recomputed: tuple[str, ...] = ()
    #: who uses them (the ``id`` of each owner that asked, :func:`run_mixers_per_document`); the changes that
    #: install them are recorded on this object and undone when the last user goes
    users: set[int] = field(default_factory=set, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied with its model, without its users: they are the original's (each user's undo
        record holds the original), so a copy keeping their ids would outlive every user it gets itself
        (``unprepare`` of its last one would leave its layers on) and take an owner whose id is reused for one
        already counted (nothing recorded for it)."""
        return {**vars(self), "users": set()}

    def summary(self) -> str:
        """One line for ``prepare_trainer``'s report: which layers run per document, which with kernels."""
        parts = []
        for mode in ("per-document", "varlen kernel"):
            names = [n for n, m in self.modes.items() if m == mode]
            if names:
                parts.append(f"{len(names)} token-mixing layer(s) {mode}: {', '.join(names)}")
                again = [n for n in names if n in self.recomputed]
                if mode == "per-document" and again:
                    parts[-1] += (
                        f" ({len(again)} of them recomputed in backward, holding no more than the row)"
                    )
        if self.masks_from_positions:
            parts.append("attention masks built from position_ids (the model's forward builds them without)")
        return f"{self.model}: " + ("; ".join(parts) if parts else "nothing to change")


def document_mixers(model: Any) -> DocumentMixers | None:
    """What :func:`run_mixers_per_document` did to ``model`` (its ``summary()`` names the layers), or ``None``."""
    found = vars(base_model(model)).get(_ATTR)
    return found if isinstance(found, DocumentMixers) else None


def run_mixers_per_document(model: Any, *, owner: Any = None, kernels: bool = True) -> DocumentMixers | None:
    """Make the token-mixing layers of ``model`` keep packed documents apart (and, for
    :data:`POSITIONLESS_MASKS` models, its attention masks); returns what was done, or ``None`` when the model
    has nothing to change.  Recorded on ``owner`` (default: the model): ``packtools.integrations.unprepare``
    undoes it.  Calling it again on a prepared model returns the first result and counts
    the new owner as one more user: trainers sharing a model (a policy, a reference model) each undo only their own
    use, and the layers go back when the last one is unprepared.  ``kernels=False`` keeps every layer on the
    per-document path even where the varlen kernels are installed (``benchmarks/gpu_check.py`` compares the two).
    """
    from ...compat import set_attr, undo

    base = base_model(model)
    owner = base if owner is None else owner
    done = document_mixers(base)
    if done is not None:
        _use(done, owner)
        return done
    mixers = token_mixing_layers(base, include_handled=True)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    masks = model_type in POSITIONLESS_MASKS
    if not mixers and not masks:
        return None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or not callable(getattr(decoder, "register_forward_pre_hook", None)):
        raise PackingError(
            f"{type(base).__name__} has token-mixing layers {mixers[:3]} but no decoder module (get_decoder()) "
            f"whose forward packtools can read the documents from. Do not pack for this model."
        )

    running = _Running()
    hook = _DecoderHook(running, base, bool(mixers), masks)

    result = DocumentMixers(type(base).__name__, {}, masks)  # what the changes are recorded on (_use)
    try:
        modules = dict(base.named_modules())
        modes, recomputed = {}, []
        forward_pre_hook(decoder, hook, owner=result)  # before the layer hooks: a decoder may be that layer
        if (
            mixers and decoder is not base
        ):  # a model that does not hand its decoder the position_ids (Mamba-1)
            forward_pre_hook(base, _TopHook(running), owner=result)
            forward_hook(base, _TopDone(running), owner=result)
        for name in mixers:
            module = modules[name]
            param = next(iter(module.parameters()), None)
            kernel = kernels and kernel_ready(module, getattr(param, "device", None))
            wrapper = _PerDocument(name, module.forward, kernel, module, _enclosing_layer(modules, name))
            replace_mixer_forward(module, wrapper, owner=result)
            if wrapper.layer is not None:
                _layer_hooks(wrapper, owner=result)
            modes[name] = "varlen kernel" if kernel else "per-document"
            if wrapper.recompute and not kernel:
                recomputed.append(name)

        result.modes, result.recomputed = modes, tuple(recomputed)
        set_attr(base, _ATTR, result, owner=result)
    except BaseException:
        undo(result)  # a layer refused midway: the ones changed before it go back
        raise
    _use(result, owner)
    logging.getLogger("packtools").info("packtools: %s", result.summary())
    return result


class _Running:
    """Per thread, the running forwards of a model above its decoder, innermost last (a probe may run one inside
    another, from a pre-hook): their documents, and the inputs they came from (_BOUNDARY_KEYS, _INPUT_KEYS).  An
    entry outlives its forward when a KeyboardInterrupt (no Exception: always-called hooks do not run) stops it;
    _decoder_segments uses an entry only for the very input tensor it came from.  Pickled or deep-copied (with
    its model), it starts empty."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"local": None}  # not empty: pickle calls __setstate__ only for a true state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.local = threading.local()

    def stack(self) -> list[dict[str, Any]]:
        if not hasattr(self.local, "outer"):
            self.local.outer = []
        return self.local.outer


# The hooks below are module-level classes holding their state, not closures: a prepared model pickles
# (torch.save(model)) and deep-copies (TRL's create_reference_model) with them, the copy's hooks holding its own
# layers and wrappers.


class _TopHook:
    """Before the model's forward (above its decoder): push that forward's documents and inputs."""

    def __init__(self, running: _Running) -> None:
        self.running = running

    def __call__(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        entry = {k: kwargs.get(k) for k in _BOUNDARY_KEYS}
        entry["input"] = _input_of(args, kwargs)
        entry["segments"] = segments_of(kwargs)
        self.running.stack().append(entry)
        return args, kwargs


class _TopDone:
    """After the model's forward, called even when it raised an Exception (``forward_hook``): pop its entry."""

    def __init__(self, running: _Running) -> None:
        self.running = running

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        outer = self.running.stack()
        if outer:
            outer.pop()


class _DecoderHook:
    """Before the decoder's forward: hand its layers the documents (:data:`SEGMENTS_KEY`; ``split``: the model has
    per-document layers), and build the masks from ``position_ids`` (``masks``: :data:`POSITIONLESS_MASKS`)."""

    def __init__(self, running: _Running, base: Any, split: bool, masks: bool) -> None:
        self.running, self.base, self.split, self.masks = running, base, split, masks

    def __call__(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        outer = self.running.stack()
        segments = _decoder_segments(args, kwargs, outer[-1] if outer else None)
        if self.split:  # None too: the layers then know the row has no documents to split (_layer_hooks)
            kwargs[SEGMENTS_KEY] = segments
        if segments is None:
            return args, kwargs
        if self.masks and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
            kwargs["attention_mask"] = packed_position_masks(
                self.base, _stand_in(self.base, kwargs, args), kwargs["position_ids"]
            )
        return args, kwargs


#: The inputs :func:`segments_of` reads the documents from.
_BOUNDARY_KEYS = ("position_ids", "seq_idx", "cu_seq_lens_q", "attention_mask")


def _input_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The token input of a forward: ``input_ids`` (first positional argument or keyword), else
    ``inputs_embeds``; ``None`` when it has neither."""
    ids = args[0] if args else kwargs.get("input_ids")
    return ids if ids is not None else kwargs.get("inputs_embeds")


def _decoder_segments(
    args: tuple[Any, ...], kwargs: dict[str, Any], outer: Mapping[str, Any] | None
) -> Segments | None:
    """The documents of a decoder forward's inputs (:func:`segments_of`); those of the model's forward running
    above it (``outer``) where the decoder got the very token input that forward got and the very inputs its
    documents came from (no second host sync), or no boundaries at all (no ``position_ids``, ``seq_idx`` or
    ``cu_seq_lens_q``, its mask that forward's or none: transformers 5.25's MambaForCausalLM hands its backbone
    none).  A decoder called on its own (TRL's reward and value models call the backbone) gets its own."""
    token_input = _input_of(args, kwargs)
    if token_input is None or outer is None or token_input is not outer["input"]:
        return segments_of(kwargs)
    if not generating(kwargs):
        got = [kwargs.get(k) for k in _BOUNDARY_KEYS]
        if all(g is outer[k] for g, k in zip(got, _BOUNDARY_KEYS)):
            return outer["segments"]
        if all(g is None for g in got[:3]) and (got[3] is None or got[3] is outer["attention_mask"]):
            return outer["segments"]
    return segments_of(kwargs)


def _use(done: DocumentMixers, owner: Any) -> None:
    """Count ``owner`` as a user of the model's per-document layers (once); undoing its changes
    (``packtools.integrations.unprepare``) takes it off, and the last user's undo takes the layers off."""
    from ...compat import record

    if id(owner) in done.users:
        return
    done.users.add(id(owner))
    record(owner, f"{done.model} per-document token-mixing layers (a user)", _Release(done, id(owner)))


class _Release:
    """The undo of one user's :func:`_use`: take it off, and the layers off with the last user."""

    def __init__(self, done: DocumentMixers, user: int) -> None:
        self.done, self.user = done, user

    def __call__(self) -> None:
        from ...compat import undo

        self.done.users.discard(self.user)
        if not self.done.users:
            undo(self.done)


def _layer_hooks(wrapper: _PerDocument, *, owner: Any) -> None:
    """Hand the documents to ``wrapper`` from its decoder layer's call, for layers that call their token-mixing
    layer with fixed arguments instead of handing their keyword arguments on (transformers 5.15's Nemotron-H,
    Falcon-H1 and LFM2 blocks): the layer's :data:`SEGMENTS_KEY`, or, where its decoder does not hand that on
    either (5.15's Falcon-H1), the documents of its own ``position_ids``.  Set before each call of the layer
    (a checkpointed layer's recomputation included, with the arguments it saved) and cleared after it."""
    from ...compat.torch import forward_hook

    forward_pre_hook(wrapper.layer(), _TakeSegments(wrapper), owner=owner)
    forward_hook(wrapper.layer(), _DropSegments(wrapper), owner=owner)


class _TakeSegments:
    """Before a decoder layer's call: its documents to its token-mixing layer's ``wrapper`` (:func:`_layer_hooks`)."""

    def __init__(self, wrapper: _PerDocument) -> None:
        self.wrapper = wrapper

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.wrapper.from_layer = kwargs[SEGMENTS_KEY] if SEGMENTS_KEY in kwargs else segments_of(kwargs)


class _DropSegments:
    """After a decoder layer's call (even one that raised): its documents cleared from ``wrapper``."""

    def __init__(self, wrapper: _PerDocument) -> None:
        self.wrapper = wrapper

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        self.wrapper.from_layer = None


def _enclosing_layer(modules: dict[str, Any], name: str) -> Any:
    """The innermost module above ``name`` that transformers may checkpoint (has ``gradient_checkpointing``)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        found = modules.get(".".join(parts[:end]))
        if hasattr(found, "gradient_checkpointing"):
            return found
    return None


def _stand_in(base: Any, kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    """A ``[batch, tokens, 1]`` tensor of the model's dtype and device: what the mask functions read of the
    embeddings (their shape, dtype and device), without embedding the tokens twice."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return embeds
    ids = kwargs.get("input_ids", args[0] if args else None)
    weight = base.get_input_embeddings().weight
    return weight.new_empty((*ids.shape[:2], 1))
