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
  the model runs a document alone; the outputs are concatenated (one ``cat``, whose backward only slices).  Exact
  on any device; the cost is one layer call per document instead of one per row.
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
from dataclasses import dataclass
from typing import Any

from ..._optional import require
from ...compat.torch import forward_pre_hook
from ...compat.transformers import document_scan, packed_position_masks, replace_mixer_forward
from ...constants import VARLEN_KEYS
from ...errors import PackingError
from .backends import base_model, token_mixing_layers

#: The keyword argument that carries a forward's :class:`Segments` from the decoder down to the mixers.
SEGMENTS_KEY = "packtools_segments"
#: Keys a per-document call does not pass on (the row's boundaries, which a single document does not have).
_ROW_KEYS = (*VARLEN_KEYS, "seq_idx", SEGMENTS_KEY)
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


@dataclass(frozen=True)
class Segments:
    """One forward's document boundaries: ``bounds[b]`` are row ``b``'s ``[0, ..., T]``."""

    bounds: tuple[tuple[int, ...], ...]
    length: int


def segments_of(kwargs: dict[str, Any]) -> Segments | None:
    """The documents of a forward's inputs, or ``None`` when no row holds more than one (one host sync): from
    ``position_ids`` (a document starts where a position does not follow the previous one by 1), else
    ``seq_idx`` (where it changes), else ``cu_seq_lens_q`` (one row).

    >>> import torch
    >>> segments_of({"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
    Segments(bounds=((0, 3, 5),), length=5)
    >>> segments_of({"position_ids": torch.tensor([[0, 1, 2]])}) is None
    True
    """
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return None
    pos, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if pos is not None and getattr(pos, "ndim", 0) == 3:
        pos = pos[0]  # multi-axis rotary positions: the first axis is the token's position
    seq_idx = kwargs.get("seq_idx")
    for ids, step in ((pos, 1), (seq_idx, 0)):  # a document starts where positions jump / seq_idx changes
        if ids is not None and getattr(ids, "ndim", 0) == 2 and ids.shape[1] > 1:
            rows, length = int(ids.shape[0]), int(ids.shape[1])
            starts = ((ids[:, 1:] - ids[:, :-1]) != step).nonzero().tolist()
            if starts:
                per_row: list[list[int]] = [[0] for _ in range(rows)]
                for row, index in starts:
                    per_row[row].append(index + 1)
                return Segments(tuple((*b, length) for b in per_row), length)
    if cu is not None and getattr(cu, "ndim", 0) == 1 and len(cu) > 2:
        bounds = tuple(int(b) for b in cu.tolist())
        return Segments((bounds,), bounds[-1])
    return None


def _kernel_ready(module: Any, device: Any) -> bool:
    """Whether ``module``'s family has its varlen kernels installed and the module is on CUDA."""
    if getattr(device, "type", None) != "cuda":
        return False
    name = type(module).__name__
    for part, packages in KERNELS:
        if part in name:
            return all(importlib.util.find_spec(p) is not None for p in packages)
    return False


class _PerDocument:
    """The ``forward`` of one token-mixing layer on packed rows (see the module docstring)."""

    #: What :func:`packtools.integrations.attention.backends.token_mixing_layers` reads: this layer is handled.
    keeps_documents_apart = True

    def __init__(self, name: str, original: Any, kernel: bool, module: Any = None) -> None:
        self.name, self.original, self.kernel, self.module = name, original, kernel, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        segments = kwargs.pop(SEGMENTS_KEY, None)
        if segments is None:  # every row is one document (segments_of): the row's boundaries say nothing more
            if not self.kernel:
                kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KEYS}
            return self.original(*args, **kwargs)
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
        out = None  # the row's output, each document written into it as it comes (_write_into)
        for row, bounds in enumerate(segments.bounds):
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                local = {k: _slice(v, rows, length, row, start, end) for k, v in kwargs.items()}
                with document_scan(self.module, end - start) as chunk:  # its chunked scan at its own size
                    got = self.original(hidden[row : row + 1, start:end], *rest, **local, **chunk)
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
    """A per-token tensor argument (``[rows, length, ...]``, e.g. a padding mask) cut to one document."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 2 and tuple(shape[:2]) == (rows, length):
        return value[row : row + 1, start:end]
    return value


@dataclass
class DocumentMixers:
    """What :func:`run_mixers_per_document` installed on one model: its layers' modes, and the decoder's hook."""

    model: str
    modes: dict[str, str]
    masks_from_positions: bool

    def summary(self) -> str:
        """One line for ``prepare_trainer``'s report: which layers run per document, which with kernels."""
        parts = []
        for mode in ("per-document", "varlen kernel"):
            names = [n for n, m in self.modes.items() if m == mode]
            if names:
                parts.append(f"{len(names)} token-mixing layer(s) {mode}: {', '.join(names)}")
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
    undoes it.  Calling it again on a prepared model returns the first result.  ``kernels=False`` keeps every
    layer on the per-document path even where the varlen kernels are installed (``benchmarks/gpu_check.py``
    compares the two).
    """
    from ...compat import set_attr

    base = base_model(model)
    done = document_mixers(base)
    if done is not None:
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
    owner = base if owner is None else owner
    modules = dict(base.named_modules())
    modes = {}
    for name in mixers:
        module = modules[name]
        param = next(iter(module.parameters()), None)
        kernel = kernels and _kernel_ready(module, getattr(param, "device", None))
        wrapper = _PerDocument(name, module.forward, kernel, module)
        replace_mixer_forward(module, wrapper, owner=owner)
        modes[name] = "varlen kernel" if kernel else "per-document"

    def hook(
        module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        segments = segments_of(kwargs)
        if segments is None:
            return args, kwargs
        if mixers:
            kwargs[SEGMENTS_KEY] = segments
        if masks and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
            kwargs["attention_mask"] = packed_position_masks(
                base, _stand_in(base, kwargs, args), kwargs["position_ids"]
            )
        return args, kwargs

    forward_pre_hook(decoder, hook, owner=owner)
    result = DocumentMixers(type(base).__name__, modes, masks)
    set_attr(base, _ATTR, result, owner=owner)
    logging.getLogger("packtools").info("packtools: %s", result.summary())
    return result


def _stand_in(base: Any, kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    """A ``[batch, tokens, 1]`` tensor of the model's dtype and device: what the mask functions read of the
    embeddings (their shape, dtype and device), without embedding the tokens twice."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return embeds
    ids = kwargs.get("input_ids", args[0] if args else None)
    weight = base.get_input_embeddings().weight
    return weight.new_empty((*ids.shape[:2], 1))
