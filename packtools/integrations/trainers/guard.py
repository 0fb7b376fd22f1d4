"""The model's guard: a forward pre-hook that refuses the inputs which make transformers attend across packed
sequences, and turns the KV cache off in training.

FlashAttention-family kernels use ``cu_seq_lens_*`` (or derive segments from ``position_ids``); ``sdpa``,
``eager`` and ``flex_attention`` build a block-diagonal mask from ``position_ids`` -- but only when no
``attention_mask`` and no KV cache are passed.  :func:`guard_model` registers the hook (through
:mod:`packtools.compat.torch`: the model's ``forward`` is never rebound); :func:`check_forward_inputs` is the
check it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

from ..._optional import is_instance
from ...batches import mrope
from ...batches.context_parallel import CP_KEY
from ...batches.vision import DocumentBlockMask, check_batch_images, host_numpy
from ...compat import set_attr
from ...compat.torch import forward_hook, forward_pre_hook
from ...constants import VARLEN_KEYS
from ...errors import PackingError
from ..attention.backends import (
    attention_implementation,
    base_model,
    check_image_inputs,
    check_image_placeholders,
    check_multimodal,
    check_recurrent,
    check_row_pooling,
    is_flash,
    multimodal_parts,
    token_mixing_layers,
)
from ..attention.mixers import (
    POSITIONLESS_MASKS,
    breaks,
    document_mixers,
    generating,
    kernel_ready,
    passed_cache,
)
from ..parallel.distributed import sharded_by
from .router import check_logits_z_loss, check_router_filler

_HOOK_ATTR = "_packtools_guard"
_WATCH_ATTR = "_packtools_watch"  # watch_model's hook

#: ``(batch, owner)`` of the batch a trainer's ``compute_loss``, ``training_step`` or ``prediction_step`` is working
#: on (set by :func:`packed_loss_inputs` around it), else ``None``: a guarded forward of its packed ``input_ids``
#: without what separates their documents, or of a CP shard's without its key, is refused
#: (:func:`check_packed_ids_forward`).
_LOSS_BATCH: ContextVar[tuple[Mapping[str, Any], str] | None] = ContextVar(
    "packtools_loss_batch", default=None
)
#: The token inputs of the watched models' forwards running now, innermost last (:func:`watch_model`): their
#: backbones' own hook leaves a call of the very same input to them (checked once, by the model's hook).
_WATCHED_INPUTS: ContextVar[tuple[Any, ...]] = ContextVar("packtools_watched_inputs", default=())


@contextlib.contextmanager
def packed_loss_inputs(inputs: Mapping[str, Any], owner: str) -> Iterator[None]:
    """While the block runs, a guarded model called on ``inputs["input_ids"]`` of a packed batch must get what
    separates its documents, and on a CP shard's its :data:`CP_KEY` (:func:`check_packed_ids_forward`); ``owner``
    names the method that builds the call (``"MyTrainer.compute_loss"``)."""
    token = _LOSS_BATCH.set((inputs, owner) if isinstance(inputs, Mapping) else None)
    try:
        yield
    finally:
        _LOSS_BATCH.reset(token)


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:  # a view, or a copy ``.to()`` returned as it was: the same storage and shape
        return a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape)
    except (AttributeError, RuntimeError):
        return False


def _byte_span(t: Any) -> tuple[int, int]:
    """The first and one-past-the-last byte of the memory tensor ``t`` reads."""
    start = t.data_ptr()
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _shares_storage(a: Any, b: Any) -> bool:
    """Whether tensor ``a`` is ``b`` or a view of ``b`` (a slice, a reshape): it reads only memory of ``b``'s."""
    try:
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
        (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
        return b0 <= a0 and a1 <= b1
    except (AttributeError, RuntimeError, TypeError):
        return False


#: the most elements :func:`_windows_equal` compares at once (candidate windows x their size)
_COMPARED = 1 << 24


def _windows_equal(haystack: Any, needle: Any) -> list[tuple[int, int]]:
    """Every ``(row, column)`` at which the 2-D ``needle`` equals a window of the 2-D ``haystack`` (same device):
    candidate corners by the needle's first and last tokens, each candidate then compared whole, in chunks."""
    import torch

    (big_h, big_w), (h, w) = haystack.shape, needle.shape
    if not (0 < h <= big_h and 0 < w <= big_w):
        return []
    first = haystack[: big_h - h + 1, : big_w - w + 1] == needle[0, 0]
    first &= haystack[h - 1 :, w - 1 :] == needle[-1, -1]
    corners = first.nonzero().tolist()  # one host sync
    windows = haystack.unfold(0, h, 1).unfold(1, w, 1)  # (rows, columns, h, w): a view, nothing copied
    found: list[tuple[int, int]] = []
    step = max(1, _COMPARED // (h * w))
    for i in range(0, len(corners), step):
        chunk = corners[i : i + step]
        rows = torch.tensor([r for r, _ in chunk], device=haystack.device)
        cols = torch.tensor([c for _, c in chunk], device=haystack.device)
        same = (windows[rows, cols] == needle).flatten(1).all(1).tolist()
        found.extend((r, c) for (r, c), hit in zip(chunk, same, strict=True) if hit)
    return found


def _batch_positions_of(ids: Any, batch_ids: Any, positions_of: Callable[[], Any]) -> tuple[bool, Any]:
    """``(derived, their_positions)``: whether ``ids`` holds the packed batch's tokens -- its ``input_ids``, a view
    of them (``ids[:, :-1]``), a copy of them or of any block of rows and columns of them (``.clone()``,
    ``ids[:, 3:9].clone()``, ``torch.cat`` of pieces that put them back together, tokens decoded and encoded again
    to the same ids), or a wider row holding the whole batch (a token prepended) -- and then the batch's
    ``position_ids`` of exactly those tokens (``None`` where they cannot be told: judge the batch).  A copy is
    recognized by its values (a few host syncs), looked at only for an integer tensor of two dimensions; of several
    places the copied tokens equal, one within a single document is taken (nothing to separate there).
    ``positions_of()`` gives the batch's positions (:func:`_document_positions`), asked for only where ``ids``
    holds the batch's tokens (reading them from ``cu_seq_lens_q`` costs host syncs)."""
    if ids is batch_ids:
        return True, positions_of()

    def laid_out() -> Any:  # the batch's positions where laid out as its input_ids, else None
        positions = positions_of()
        same_layout = (
            positions is not None
            and getattr(positions, "ndim", 0) == 2
            and tuple(positions.shape) == tuple(batch_ids.shape)
            and _same_strides(positions, batch_ids)
        )
        return positions if same_layout else None

    if _shares_storage(ids, batch_ids):
        positions = laid_out()
        if positions is None:
            return True, None
        offset = positions.storage_offset() + ids.storage_offset() - batch_ids.storage_offset()
        try:  # the same view of the positions: the same strides from the same offset
            return True, positions.as_strided(ids.size(), ids.stride(), offset)
        except (RuntimeError, TypeError):
            return True, None
    try:
        fits = ids.ndim == batch_ids.ndim == 2 and not ids.dtype.is_floating_point and ids.numel() > 0
    except (AttributeError, TypeError):
        return False, None
    if not fits:
        return False, None
    (h, w), (big_h, big_w) = tuple(ids.shape), tuple(batch_ids.shape)
    if w == 1:  # one token a row (a decode step's): each row's sequence is one token, nothing to separate
        return False, None
    ids = ids.to(batch_ids.device)
    if h <= big_h and w <= big_w:  # a block of the batch's tokens
        places = _windows_equal(batch_ids, ids)
        if not places:
            return False, None
        positions = laid_out()
        if positions is None:
            return True, None
        found = (positions[r : r + h, c : c + w] for r, c in places)  # a common token's places: not all built
        first = next(found)
        if not is_packed({"position_ids": first}):
            return True, first
        return True, next((p for p in found if not is_packed({"position_ids": p})), first)
    if h >= big_h and w >= big_w and _windows_equal(ids, batch_ids):  # the whole batch, and more
        return True, laid_out()
    return False, None


def _same_strides(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` of one shape put every element at the same offset: their strides agree on
    each dimension longer than 1 (a collator's ``[1, T]`` row has stride ``(0, 1)``, a fresh one ``(T, 1)``).

    >>> import torch
    >>> row, square = torch.zeros(1, 4), torch.zeros(2, 2)
    >>> _same_strides(row.as_strided((1, 4), (0, 1)), row), _same_strides(square.t(), square)
    (True, False)
    """
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride(), strict=True))


def _cu_positions(batch: Mapping[str, Any]) -> Any:
    """The positions of a batch that separates its documents by ``cu_seq_lens_q`` alone (FlashAttention,
    ``return_position_ids=False``): each token's place in its document, laid out as ``input_ids`` (``None`` where
    ``cu_seq_lens_q`` does not cover every token).  Without them a copy of tokens within one document, or of one
    token, would be judged by the whole batch (packed) and refused."""
    import torch

    ids, cu = batch.get("input_ids"), batch.get("cu_seq_lens_q")
    if not (isinstance(ids, torch.Tensor) and isinstance(cu, torch.Tensor)) or cu.ndim != 1 or len(cu) < 2:
        return None
    cu = cu.to(ids.device, torch.long)
    total = ids.numel()
    lengths = cu.diff()
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):  # (host syncs)
        return None
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return (torch.arange(total, device=ids.device) - starts).reshape(ids.shape)


def _document_positions(batch: Mapping[str, Any], own: Any) -> Any:
    """``[B, T]`` positions of the batch that restart at each document, laid out as its ``input_ids``: its 2-D
    ``position_ids``, the text row of ``(4, B, T)`` ones (:func:`text_positions`), else read from its
    ``cu_seq_lens_q`` (:func:`_cu_positions`: FlashAttention without ``position_ids``, ``(3, B, T)`` rotary ones);
    ``None`` where none fits (a copy is then judged by the whole batch)."""
    text, ids = text_positions(own), batch.get("input_ids")
    if text is not None and tuple(getattr(text, "shape", ())) == tuple(getattr(ids, "shape", ())):
        return text
    return _cu_positions(batch)


def check_packed_ids_forward(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse a forward of a packed batch's ``input_ids`` (inside :func:`packed_loss_inputs`) that carries neither
    ``cu_seq_lens_q`` nor ``position_ids`` restarting per document: the model then runs each packed row as one
    sequence, its documents attending to each other, with no error (a ``compute_loss`` that calls
    ``model(input_ids=inputs["input_ids"], labels=...)`` instead of ``model(**inputs)``).  The batch's tokens are
    recognized as the tensor itself, a view of it, or a copy of any block of it or a wider row holding it
    (:func:`_batch_positions_of`), and ``inputs_embeds`` of the row's shape as its embedding; such a call is refused
    when the tokens it holds span two documents of the batch (told by its ``position_ids``, or by its
    ``cu_seq_lens_q`` where they are no ``[B, T]`` text positions: :func:`_document_positions`).  The batch's own
    keys pass from their identity; only another call's values are read (host syncs).  A context-parallel shard's
    tokens (the batch carries :data:`CP_KEY`) forwarded without the shard's key are judged by a stricter rule
    instead: no positions make them right, only a block of document heads passes (:func:`_check_cp_key`)."""
    found = _LOSS_BATCH.get()
    if found is None:
        return
    batch, owner = found
    ids = kwargs.get("input_ids", args[0] if args else None)
    batch_ids = batch.get("input_ids")
    if batch_ids is None:
        return
    embeds = kwargs.get("inputs_embeds") if ids is None else None
    if embeds is not None:  # the embedded packed row (a noise of one's own, NEFTune-style): one per token
        ids = batch_ids if tuple(getattr(embeds, "shape", ())[:2]) == tuple(batch_ids.shape) else None
    if ids is None:
        return
    own, shard = batch.get("position_ids"), batch.get(CP_KEY)
    if (
        shard is not None and kwargs.get(CP_KEY) is None
    ):  # heads pass (no packed block either), the rest refused
        _check_cp_key(ids, batch_ids, lambda: _real_positions(_document_positions(batch, own), shard), owner)
        return
    if kwargs.get("cu_seq_lens_q") is not None:
        return
    given = kwargs.get("position_ids")
    if given is not None and own is not None and _same_tensor(given, own):
        return
    derived, positions = _batch_positions_of(ids, batch_ids, lambda: _document_positions(batch, own))
    if not derived or is_packed(kwargs):
        return
    if not (is_packed(batch) if positions is None else is_packed({"position_ids": positions})):
        return
    keys = sorted(k for k, v in kwargs.items() if v is not None)
    raise PackingError(
        f"{owner} called the model on the packed batch's input_ids (or their embeddings) with {keys}, without the "
        f"batch's position_ids or cu_seq_lens_q: the model then runs each packed row as one sequence and its documents "
        f"attend to each other, with no error. Pass the batch's separating keys (position_ids, and "
        f"cu_seq_lens_q/k, max_length_q/k when the batch has them) -- model(**inputs) does -- or train unpacked, "
        f"without prepare_trainer."
    )


def _check_cp_key(ids: Any, batch_ids: Any, positions_of: Callable[[], Any], owner: str) -> None:
    """Refuse a forward, without :data:`CP_KEY`, of a context-parallel shard's tokens (``ids``: the shard's
    ``input_ids``, a view or a copy of any block of them, as :func:`_batch_positions_of` tells; the shard's row
    itself for its embeddings).  The shard holds chunks of the row that are not adjacent (a head-tail pair of each
    document), and only the key makes the attention gather the other ranks' keys and place each chunk: without it
    every token attends to the wrong tokens, whatever ``position_ids`` or ``cu_seq_lens`` the call passes, with no
    error.  Only a block of document heads (positions ``0..w-1`` in every row, no padding among them:
    ``positions_of`` gives the shard's with its padding's as ``-1``, :func:`_real_positions`) attends right alone:
    left to pass."""
    derived, positions = _batch_positions_of(ids, batch_ids, positions_of)
    if not derived or (positions is not None and _document_heads(positions)):
        return
    raise PackingError(
        f"{owner} called the model on a context-parallel shard's tokens (its input_ids, a view or a copy of them, "
        f"or their embeddings) without its {CP_KEY!r} input: the shard's chunks are not adjacent tokens of the row, "
        f"and that key is what tells the attention where each chunk sits (and gathers the other ranks' keys), so "
        f"without it every token attends to the wrong tokens, whatever positions are passed, with no error. Pass "
        f"the inputs whole (model(**inputs), or super().compute_loss(...)); a second model run on the shard needs "
        f"the key too, and packtools_cp attention (packtools.integrations.use_cp_attention(model)); or train "
        f"without context_parallel.",
        param="context_parallel",
    )


def _real_positions(positions: Any, shard: Any) -> Any:
    """A CP shard's ``[1, T]`` ``positions`` with its padding tokens' as ``-1`` (``None`` stays ``None``).  Padding
    positions restart at 0 after their document's last real token (``CPLayout.positions``), so a block of a shard
    could read ``0..w-1`` across a padding token into the next document's chunk: no document's head.  The real
    tokens are the shard's queries (``CPShard.q_index``), read on the host (no device sync).

    >>> import torch
    >>> from packtools.batches.context_parallel import CPLayout, CPShard
    >>> shard = CPShard.build(CPLayout.build([2, 6], 2, balance=True), 0)  # a token, padding, tokens 2..5
    >>> _real_positions(torch.arange(6)[None], shard).tolist()
    [[0, -1, 2, 3, 4, 5]]
    """
    if positions is None:
        return None
    import torch

    real = torch.zeros(positions.numel(), dtype=torch.bool)
    real[torch.as_tensor(shard.q_index, dtype=torch.long)] = True
    return positions.masked_fill(~real.reshape(positions.shape).to(positions.device), -1)


def _document_heads(positions: Any) -> bool:
    """Whether every row of ``[B, w]`` ``positions`` is ``0, 1, ..., w-1``: the first tokens of one document.

    >>> import torch
    >>> _document_heads(torch.tensor([[0, 1, 2], [0, 1, 2]])), _document_heads(torch.tensor([[0, 1, 0]]))
    (True, False)
    """
    if getattr(positions, "ndim", 0) != 2:
        return False
    import torch

    head = torch.arange(positions.shape[1], device=positions.device)
    return bool((positions == head).all())


def has_restarts(position_ids: Any, attention_mask: Any = None) -> bool:
    """True when some row of ``position_ids`` steps by anything but +1 between two attended tokens.

    That is how transformers recognizes packed sequences; with ``attention_mask`` only steps between two
    unmasked tokens count, so left or right padding is not mistaken for packing.  Works on NumPy and torch.

    >>> import numpy as np
    >>> has_restarts(np.array([[0, 1, 2, 0, 1]])), has_restarts(np.array([[0, 1, 2, 3, 4]]))
    (True, False)
    >>> has_restarts(np.array([[1, 1, 0, 1, 2]]), attention_mask=np.array([[0, 0, 1, 1, 1]]))
    False
    """
    return bool(breaks(position_ids, attention_mask).any())


#: Model types whose causal-LM loss does not shift its labels (they are to come shifted already), checked in
#: transformers 5.25: WhisperForCausalLM's ``CrossEntropyLoss(logits, labels)``.  PaddingFreeCollator's labels are
#: the tokens themselves (a next-token loss shifts them), so that loss would train each token to predict itself:
#: ``prepare_trainer`` installs packtools' loss (``step.use_causal_lm_loss``), ``guard_model`` refuses the labels
#: (:func:`check_unshifted_labels`).
UNSHIFTED_LOSS = ("whisper",)


def check_unshifted_labels(kwargs: Mapping[str, Any], model_type: str | None) -> None:
    """Refuse ``labels`` laid out for a next-token loss (each labelled token is the input token at its position,
    as PaddingFreeCollator makes them) passed to a model whose own loss does not shift them
    (:data:`UNSHIFTED_LOSS`): it would train each token to predict itself, with no error.  One host sync, only
    for those models and only when labels are passed; labels shifted by the caller pass, and so do labels TRL's
    fused LM head scores (``fused_lm_head=True``: DPO's and GRPO's forwards), which shifts them itself.

    >>> import numpy as np
    >>> ids = np.array([[5, 6, 7]])
    >>> check_unshifted_labels({"input_ids": ids, "labels": np.array([[6, 7, -100]])}, "whisper")
    >>> check_unshifted_labels({"input_ids": ids, "labels": ids, "fused_lm_head": True}, "whisper")  # TRL's head
    >>> check_unshifted_labels({"input_ids": ids, "labels": np.array([[-100, 6, 7]])}, "whisper")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: WhisperForCausalLM-type model (model_type 'whisper') scores position i...
    """
    if model_type not in UNSHIFTED_LOSS or kwargs.get("fused_lm_head") is True:
        return  # (TRL's fused LM head scores next-token labels itself: the model's own loss never sees them)
    labels, ids = kwargs.get("labels"), kwargs.get("input_ids")
    if labels is None or ids is None or getattr(labels, "shape", None) != getattr(ids, "shape", None):
        return
    scored = labels != -100
    if not bool(scored.any()) or not bool((labels[scored] == ids[scored]).all()):
        return
    raise PackingError(
        f"WhisperForCausalLM-type model (model_type {model_type!r}) scores position i against labels[i] without "
        f"shifting them, and these labels are the input tokens themselves (PaddingFreeCollator's layout for a "
        f"next-token loss): the model's loss would train each token to predict itself. Do not pass labels to the "
        f"model; compute the loss from its logits with packtools.integrations.trainers.sft.causal_lm_loss (or "
        f"prepare_trainer(trainer), which installs it).",
        param="labels",
    )


def check_forward_inputs(
    kwargs: Mapping[str, Any], implementation: str | None, mixers: tuple[str, ...] = ()
) -> None:
    """Raise :class:`PackingError` on keyword inputs that make transformers attend across packed sequences.

    Inputs of a generation step (a cache holding tokens passed in) are not checked; an empty cache is (a packed
    row with one is refused, :func:`check_cache_on_packed`).  Only the suspicious combinations read
    tensor values (one host sync); correct padding-free batches are checked from their keys alone.

    >>> import numpy as np
    >>> check_forward_inputs({"position_ids": np.array([[0, 1, 0]])}, "sdpa")
    >>> check_forward_inputs(
    ...     {"position_ids": np.array([[0, 1, 0]]), "attention_mask": np.array([[1, 1, 1]])}, "sdpa"
    ... )  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: the batch has packed position_ids (they restart inside a row) and an attention_mask...
    """
    if generating(kwargs):
        return
    check_cp_attention(kwargs, implementation)
    check_cut_boundaries(kwargs)
    given = kwargs.get("position_ids")
    pos = text_positions(given)
    mask = kwargs.get("attention_mask")
    if given is not None and pos is None:
        check_rotary_only(kwargs, implementation)
        check_cache_on_packed(kwargs, implementation)  # a packed row told by its cu_seq_lens
        return  # other position layouts: not ours to judge
    check_unseparated_rows(kwargs)
    if pos is not None and mask is not None and getattr(mask, "ndim", 0) == 2 and has_restarts(pos, mask):
        raise PackingError(
            "the batch has packed position_ids (they restart inside a row) and an attention_mask: transformers "
            "then ignores position_ids and every token attends across the sequence boundaries of its row. Drop "
            "'attention_mask' from packed batches (packtools.PaddingFreeCollator never returns it with packed "
            "rows); check that the collator is not wrapped in one that adds it."
        )
    if (
        mixers
        and kwargs.get("seq_idx") is None
        and kwargs.get("cu_seq_lens_q") is None
        and (any(kwargs.get(k) is not None for k in VARLEN_KEYS) or (pos is not None and has_restarts(pos)))
    ):
        raise PackingError(
            f"the batch is packed but has neither seq_idx nor cu_seq_lens, and the model's layers "
            f"{list(mixers)[:3]} mix tokens outside attention: they ignore position_ids and would run every "
            f"packed row as one sequence. Keep seq_idx and cu_seq_lens in the batch "
            f"(PaddingFreeCollator(return_seq_idx=True, return_flash_attn_kwargs=True)), or do not pack."
        )
    flash = is_flash(implementation)
    check_cache_on_packed(kwargs, implementation)
    if pos is None and not flash and any(kwargs.get(k) is not None for k in VARLEN_KEYS):
        raise PackingError(
            f"the batch has cu_seq_lens/max_length but no position_ids: the {implementation!r} attention ignores "
            f"cu_seq_lens and needs position_ids to separate packed sequences. Keep 'position_ids' in the batch."
        )
    if (
        flash
        and pos is not None
        and mask is None
        and pos.shape[0] > 1
        and any(kwargs.get(k) is None for k in VARLEN_KEYS)
        and has_restarts(pos)
    ):
        raise PackingError(
            f"the batch holds {pos.shape[0]} packed rows without cu_seq_lens: with {implementation!r} transformers "
            f"infers sequences from position_ids only for a single row, so these rows would attend across "
            f"sequences. Use PaddingFreeCollator(padding_free=True) (one flat row with cu_seq_lens)."
        )


def check_cache_on_packed(kwargs: Mapping[str, Any], implementation: str | None) -> None:
    """Refuse ``use_cache=True``, or a cache passed in that holds no tokens yet (an empty ``DynamicCache``: no
    generation step, :func:`~packtools.integrations.attention.mixers.generating`), on a packed batch
    (:func:`is_packed`) for attention other than FlashAttention's: with a cache transformers builds no
    per-sequence mask from ``position_ids``.

    >>> import numpy as np
    >>> from transformers import DynamicCache
    >>> check_cache_on_packed(
    ...     {"position_ids": np.array([[0, 1, 0]]), "past_key_values": DynamicCache()}, "sdpa"
    ... )  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: the batch is packed and a cache was passed in (past_key_values=DynamicCache...
    """
    if is_flash(implementation) or kwargs.get("packtools_cp") is not None:
        return  # (a CP shard: packtools_cp attends per document from its layout, cache or not)
    cache = passed_cache(kwargs)
    if cache is not None and is_packed(kwargs):
        key = "past_key_values" if kwargs.get("past_key_values") is not None else "cache"
        raise PackingError(
            f"the batch is packed and a cache was passed in ({key}={type(cache).__name__}, holding no tokens: no "
            f"generation step): with a cache the {implementation!r} attention gets no per-sequence mask from "
            f"position_ids (transformers builds it only without a cache), so packed sequences would attend to "
            f"each other. Pass no cache with packed rows (train without {key}=), or generate from one sequence "
            f"per row.",
            param=key,
        )
    if kwargs.get("use_cache") is True and is_packed(kwargs):
        raise PackingError(
            f"the batch is packed and use_cache=True: with a cache the {implementation!r} attention gets no "
            f"per-sequence mask from position_ids (transformers builds it only without a cache), so packed "
            f"sequences would attend to each other. Pass use_cache=False, or leave it out (the guard then "
            f"passes use_cache=False).",
            param="use_cache",
        )


def text_positions(position_ids: Any) -> Any:
    """The ``[B, T]`` positions transformers tells packed sequences from: 2-D ``position_ids`` themselves, or
    the first (text) row of the ``(4, B, T)`` layout of Qwen2-VL & co., which their text model builds its masks
    from (``MultimodalCollator``'s); ``None`` for any other layout.

    >>> import numpy as np
    >>> text_positions(np.zeros((4, 1, 5), int)).shape, text_positions(np.zeros((3, 1, 5), int))
    ((1, 5), None)
    """
    ndim = getattr(position_ids, "ndim", 0)
    if ndim == 2:
        return position_ids
    if ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def rotary_restarts(position_ids: Any, attention_mask: Any = None) -> bool:
    """True when ``(3, B, T)`` rotary positions (temporal, height, width; no text row) return to ``(0, 0, 0)``
    after a row's first attended token: a new document.  Inside one sample they never do (text counts on from
    the previous maximum, an image starts at the next position), so images are no restarts.

    Wider on purpose than :func:`~packtools.integrations.attention.mixers.rotary_starts`, which says where the
    model's attention splits such a row (the per-document mixers must split it there and nowhere else): here any
    return to zero after the first attended token counts, after padding too (the model then attends across the
    gap: ``tests/test_hf.py::test_guard_refuses_rotary_restart_after_padding_gap``) and after ``-1`` (a row
    counting up through 0 cannot be told from two documents).  A packed row is refused, never passed.

    >>> import numpy as np
    >>> one = np.array([[[0, 1, 1, 1, 3]], [[0, 1, 1, 2, 3]], [[0, 1, 2, 1, 3]]])  # text, a 2x2 image, text
    >>> rotary_restarts(one), rotary_restarts(np.concatenate([one, one], axis=-1))
    (False, True)
    """
    zero = (position_ids == 0).all(0)  # [B, T]
    if attention_mask is not None:
        attended = attention_mask != 0
        first = attended.cumsum(-1) == 1
        return bool((zero & attended & ~first).any())
    return bool(zero[..., 1:].any())


def is_packed(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's inputs hold several sequences in a row: ``cu_seq_lens_q`` with more than one
    segment, ``position_ids`` whose ``[B, T]`` text positions (:func:`text_positions`: 2-D, or the text row of
    ``(4, B, T)``) restart inside a row between attended tokens (:func:`has_restarts`), or ``(3, B, T)`` rotary
    positions that start again at zero (:func:`rotary_restarts`).

    >>> import numpy as np
    >>> is_packed({"cu_seq_lens_q": np.array([0, 3, 5])}), is_packed({"cu_seq_lens_q": np.array([0, 5])})
    (True, False)
    >>> is_packed({"position_ids": np.array([[0, 1, 0, 1]] * 4)[:, None]})
    True
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and getattr(cu, "ndim", 0) == 1 and len(cu) > 2:
        return True
    given, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    mask = mask if getattr(mask, "ndim", 0) == 2 else None
    pos = text_positions(given)
    if pos is not None:
        return has_restarts(pos, mask)
    if getattr(given, "ndim", 0) == 3 and given.shape[0] == 3:
        return rotary_restarts(given, mask)
    return False


def check_rotary_only(kwargs: Mapping[str, Any], implementation: str | None) -> None:
    """Refuse packed ``(3, B, T)`` rotary positions without a text row unless FlashAttention gets
    ``cu_seq_lens``: Qwen2-VL & co. build per-sequence masks only from the text row of ``(4, B, T)``, so every
    other backend (and FlashAttention without ``cu_seq_lens``) runs the row as one sequence.  Packed: the
    positions start again at zero (:func:`rotary_restarts`), or ``cu_seq_lens_q`` holds several sequences (positions
    counted on across them separate nothing either: 0.15 in a tiny Qwen2-VL's logits on ``sdpa``)."""
    pos = kwargs.get("position_ids")
    if getattr(pos, "ndim", 0) != 3 or pos.shape[0] != 3:
        return
    cu = kwargs.get("cu_seq_lens_q")
    if is_flash(implementation) and cu is not None:
        return
    mask = kwargs.get("attention_mask")
    restarts = rotary_restarts(pos, mask if getattr(mask, "ndim", 0) == 2 else None)
    if restarts or (getattr(cu, "ndim", 0) == 1 and len(cu) > 2):
        said = (
            "start again at 0 inside a row" if restarts else "sit in a row that cu_seq_lens_q cuts in several"
        )
        raise PackingError(
            f"the batch's (3, B, T) rotary position_ids {said} (packed sequences) but have no text row: the model "
            f"then builds no per-sequence mask, so on {implementation!r} the sequences would attend to each other. "
            f"Use packtools.batches.MultimodalCollator (its (4, 1, T) positions lead with the text row), or "
            f"FlashAttention with cu_seq_lens.",
            param="position_ids",
        )


def check_cut_boundaries(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``cu_seq_lens_q`` with fewer than 2 entries: a padding-free batch whose boundaries were cut, as
    accelerate's ``dispatch_batches`` does to every tensor of a batch (sliced along dim 0 to the batch size)."""
    shape = tuple(getattr(kwargs.get("cu_seq_lens_q"), "shape", (2,)))  # no tensor there: nothing to judge
    if len(shape) == 1 and shape[0] >= 2:
        return
    raise PackingError(
        f"cu_seq_lens_q has shape {shape}, not (n + 1,) with n >= 1: the batch's sequence boundaries were cut on "
        "the way (accelerate's dispatch_batches=True, on for an IterableDataset, slices every tensor along dim 0). "
        "Pass DataLoaderConfiguration(dispatch_batches=False) (Trainer: accelerator_config).",
        param="cu_seq_lens_q",
    )


def check_unseparated_rows(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``seq_lengths`` (the packed rows' column) reaching the model with several sequences in a row but
    nothing that separates them (no ``cu_seq_lens_q``, no restarting ``position_ids``): the collator passed
    the column through instead of building the padding-free batch, and the model would run each row whole."""
    lengths = kwargs.get("seq_lengths")
    if lengths is None or is_packed(kwargs) or most_per_row(lengths) < 2:
        return
    raise PackingError(
        "the batch carries seq_lengths (rows holding several packed sequences) but neither cu_seq_lens nor "
        "position_ids that restart per sequence: the model would run each row as one sequence. Collate the "
        "rows with packtools.PaddingFreeCollator.",
        param="seq_lengths",
    )


def most_per_row(seq_lengths: Any) -> int:
    """The most non-empty sequences any row of a ``seq_lengths`` value holds (a list of lists, a list of
    tensors, a padded ``[B, K]`` tensor; 1-D: one row).

    >>> most_per_row([[3, 2], [5]]), most_per_row([4, 1]), most_per_row([[5], [6]])
    (2, 2, 1)
    """
    rows = seq_lengths.tolist() if hasattr(seq_lengths, "tolist") else list(seq_lengths)
    if rows and not isinstance(rows[0], (list, tuple)) and not hasattr(rows[0], "tolist"):
        rows = [rows]
    return max((sum(1 for n in (r.tolist() if hasattr(r, "tolist") else r) if n) for r in rows), default=0)


def check_unhandled_mixers(model: Any, kwargs: Mapping[str, Any], mixers: tuple[str, ...]) -> None:
    """Refuse a packed batch for a model whose token-mixing layers ``mixers`` are neither run per document nor
    have their varlen kernels here (CUDA and the family's packages,
    :func:`~packtools.integrations.attention.mixers.kernel_ready`): transformers' PyTorch fallback cannot keep
    the documents apart (it raises a ``ValueError`` that names no fix, or, before 5.20, runs the row as one)."""
    row_keys = ("seq_idx", *VARLEN_KEYS)  # transformers' fallback refuses these even for one sequence
    if not mixers or generating(kwargs):
        return  # (generation: each decode step would read the positions, a host sync, for nothing)
    shard = kwargs.get("packtools_cp") is not None  # one verdict on every rank (their positions differ)
    if not (shard or any(kwargs.get(k) is not None for k in row_keys) or is_packed(kwargs)):
        return
    base = base_model(model)
    missing = []
    for name in mixers:
        module = base.get_submodule(name)
        param = next(iter(module.parameters()), None)
        if not kernel_ready(module, getattr(param, "device", None)):
            missing.append(name)
    if missing:
        raise PackingError(
            f"{type(base).__name__}'s layers {missing[:3]} mix tokens outside attention and have no varlen "
            f"kernels on this machine (CUDA with causal-conv1d, plus flash-linear-attention or mamba-ssm): on a "
            f"packed batch each document would start from the previous one's state. Call "
            f"packtools.integrations.attention.mixers.run_mixers_per_document(model) before training (it runs "
            f"them one document at a time; prepare_trainer does), or do not pack.",
            param="model",
        )


def packed_training_input(kwargs: Mapping[str, Any]) -> bool:
    """A packed batch (:func:`is_packed`) that is no generation step (:func:`generating`)."""
    return not generating(kwargs) and is_packed(kwargs)


def ready_made_masks(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward that is no generation step carries masks as ``MultimodalCollator`` makes them for
    :data:`~packtools.batches.mrope.IMAGE_BLOCK_TYPES` (``attention_mask`` a dict by layer type of boolean tensors
    or :class:`~packtools.batches.vision.DocumentBlockMask`): the backend must read them as they are, whether the
    batch holds one document or several (``eager`` would add the booleans to its scores).  transformers' own
    masks for ``eager`` are additive floats, so a generation prefill of its own is not one of them.

    >>> import numpy as np
    >>> ready_made_masks({"attention_mask": {"full_attention": np.ones((1, 1, 2, 2), bool)}})
    True
    >>> ready_made_masks({"attention_mask": {"full_attention": np.zeros((1, 1, 2, 2), np.float32)}})
    False
    """
    masks = kwargs.get("attention_mask")
    if not isinstance(masks, Mapping) or generating(kwargs):
        return False
    return any(
        isinstance(m, DocumentBlockMask) or str(getattr(m, "dtype", "")) in ("bool", "torch.bool")
        for m in masks.values()
    )


def check_positionless_masks(model: Any, kwargs: Mapping[str, Any], implementation: str | None) -> None:
    """Refuse a packed batch for a model whose forward builds its attention masks without ``position_ids``
    (:data:`~packtools.integrations.attention.mixers.POSITIONLESS_MASKS`, GPT-OSS) unless
    :func:`~packtools.integrations.attention.mixers.run_mixers_per_document` builds them from ``position_ids``:
    otherwise every packed sequence attends to the ones before it in its row, with no error."""
    if (
        is_flash(implementation)
        or kwargs.get("attention_mask") is not None
        or kwargs.get("packtools_cp") is not None
    ):
        return  # (a CP shard: packtools_cp attends per document from its layout, whatever the masks)
    base = base_model(model)
    if getattr(getattr(base, "config", None), "model_type", None) not in POSITIONLESS_MASKS:
        return
    done = document_mixers(base)
    if done is not None and done.masks_from_positions:
        return
    if not packed_training_input(kwargs):
        return
    raise PackingError(
        f"{type(base).__name__} builds its attention masks without position_ids, so on {implementation!r} the "
        f"sequences of a packed row would attend to each other. Call "
        f"packtools.integrations.attention.mixers.run_mixers_per_document(model) before training (it builds "
        f"the masks from position_ids; prepare_trainer does), or do not pack.",
        param="model",
    )


#: Vision-language model types whose text model turns 2-D ``position_ids`` into its 3 rotary rows with no text
#: row, and so builds no per-sequence mask from them (transformers 5.25: Qwen2-VL and Qwen2.5-VL expand them to 3
#: rows; Qwen3-VL to 4, the text row first, which separates the sequences).
NO_TEXT_ROW_FROM_2D = ("qwen2_vl", "qwen2_5_vl")


def check_text_row(model: Any, kwargs: Mapping[str, Any], implementation: str | None) -> None:
    """Refuse packed 2-D ``position_ids`` (``PaddingFreeCollator``'s) for a :data:`NO_TEXT_ROW_FROM_2D` model
    unless FlashAttention gets ``cu_seq_lens``: the model builds per-sequence masks only from the text row of
    ``(4, B, T)`` positions, so the sequences of a packed row would attend to each other (0.15 in a tiny
    Qwen2-VL's logits on ``sdpa``) with no error."""
    pos = kwargs.get("position_ids")
    if getattr(pos, "ndim", 0) != 2 or (is_flash(implementation) and kwargs.get("cu_seq_lens_q") is not None):
        return
    base = base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in NO_TEXT_ROW_FROM_2D or not packed_training_input(kwargs):
        return
    raise PackingError(
        f"{type(base).__name__} ({model_type}) turns 2-D position_ids into its 3 rotary rows without "
        f"the text row it builds per-sequence masks from, so on {implementation!r} the packed sequences of a row "
        f"would attend to each other. Collate with packtools.batches.MultimodalCollator (its (4, 1, T) positions "
        f"lead with the text row), or use FlashAttention with cu_seq_lens.",
        param="position_ids",
    )


def check_cp_attention(kwargs: Mapping[str, Any], implementation: str | None) -> None:
    """Refuse a context-parallel shard (``packtools_cp``) given to any attention but ``packtools_cp``: ``sdpa``,
    flash or ``packtools_sdpa`` would take the kwarg into ``**kwargs`` and attend only within this rank's chunks.

    >>> check_cp_attention({"packtools_cp": object()}, "sdpa")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: a context-parallel shard (packtools_cp) reached a model on 'sdpa' attention...
    """
    if kwargs.get("packtools_cp") is not None and implementation != "packtools_cp":
        raise PackingError(
            f"a context-parallel shard (packtools_cp) reached a model on {implementation!r} attention, which would "
            f"attend only within this rank's chunks of the row; switch the model with "
            f"packtools.integrations.use_cp_attention(model) (prepare_trainer(..., context_parallel=N) does).",
            param="packtools_cp",
        )


def guard_model(model: Any, *, owner: Any = None, check_isolation: bool = True) -> Any:
    """Register (once) a forward pre-hook on ``model`` that checks packed inputs and disables the KV cache.

    The hook raises :class:`PackingError` through :func:`check_forward_inputs`, and passes
    ``use_cache=False`` when the caller did not choose (or when training): transformers' ``sdpa``/``eager``
    backends detect packed sequences only without a cache, and ``LlamaConfig`` and friends default to
    ``use_cache=True``.  Register it on the outermost module that the trainer calls (a PEFT model forwards
    to its base with ``.forward``, which skips hooks on the base).  The hook is recorded on ``owner`` (default:
    the model): ``packtools.integrations.unprepare(owner)`` removes it.  Returns the hook handle.

    Those checks read the batch's keys only, and many families do not separate packed sequences whatever the
    keys: their forward builds its masks or positions without ``position_ids`` (OPT, BLOOM, MPT, BART-style
    decoders, ...: their packed sequences would attend to each other with no error).  So with
    ``check_isolation=True`` the first packed batch the hook sees also runs
    :func:`~packtools.integrations.attention.isolation.check_isolation` once (a few short sequences packed and
    alone, with the batch's own keys), which raises :class:`PackingError` naming the model, backend and fix.
    The prepare functions pass ``False``: they run their own probe before training.  The probe runs outside
    ``torch.compile``'s trace and, under ``DistributedDataParallel``, on the module it wraps: no collective, since
    the ranks may reach their first packed batch at different steps.  A context-parallel shard (``packtools_cp``)
    is the exception: every rank of its CP group probes the first shard (they reach it in the same forward, their
    own positions restarting or not) and one all-reduce over that group agrees on the verdict, so the group
    refuses on every rank or on none, never leaving a rank waiting in the CP attention's all-gather.  A sharded
    model's forward (FSDP's, ZeRO-3's) gathers its parameters, a collective the probe cannot avoid: such a model
    is refused with ``check_isolation=True`` (:func:`check_sharded_probe`; the ranks' mismatched gathers hung),
    here and at its first packed batch when it was sharded after this call; probe the model before sharding it
    and pass ``False``.  A model with layers that pool fixed windows of the row (DeepSeek-V4's compressed attention,
    :func:`~packtools.integrations.attention.backends.check_row_pooling`) is refused here, from its config: its
    windows are longer than the probe's rows.
    """
    # vars(), not getattr(): PEFT models forward unknown attributes to the base model, whose hook they skip.
    handle = vars(model).get(_HOOK_ATTR)
    if handle is not None:
        return handle
    hook = _guard_hook(model, check_isolation)
    owner = model if owner is None else owner
    handle = forward_pre_hook(model, hook, owner=owner)
    set_attr(model, _HOOK_ATTR, handle, owner=owner)
    return handle


def _guard_hook(model: Any, check_isolation: bool) -> GuardHook:
    """:func:`guard_model`'s checks of ``model`` itself (refusing it by name), then its hook."""
    refuse_encoder_decoder(model, "guard_model")
    check_row_pooling(model)  # a leak the probe's short rows cannot measure: refused from the config
    check_recurrent(model)  # its state runs across documents and nothing can split it: refused by type
    if check_isolation:
        check_sharded_probe(model)
    return GuardHook(model, check_isolation)


class GuardHook:
    """:func:`guard_model`'s forward pre-hook: a module-level class holding its state (what it read of the model
    once), so a guarded model pickles (``torch.save(model)``) and deep-copies (``copy.deepcopy``, TRL's
    ``create_reference_model``) with its guard.  A copy's hook holds the copy's own layers (the deep copy maps
    them) and a copy of the probe's state: the copy is guarded as the model was, checks included."""

    def __init__(self, model: Any, check_isolation: bool) -> None:
        self.mixers = tuple(token_mixing_layers(model))
        self.probe = FirstPackedProbe() if check_isolation else None
        self.rope = length_dependent_rope(model)
        # The model type decides two checks; read once here, not on every forward.
        self.model_type = getattr(getattr(base_model(model), "config", None), "model_type", None)
        self.positionless = self.model_type in POSITIONLESS_MASKS
        self.text_row = self.model_type in NO_TEXT_ROW_FROM_2D
        self.multimodal = bool(
            multimodal_parts(model)
        )  # its packed rows' placeholder tokens need their pixels
        try:  # an unverified multimodal model: its text-only forwards pass, its image inputs are refused
            check_multimodal(model)
            # Gemma 3: its images need masks; Idefics3 / SmolVLM: their tiles need their pixel_attention_mask;
            # LLaVA-NeXT / OneVision: their images need their image_sizes
            self.images_checked = self.model_type in (
                *mrope.IMAGE_BLOCK_TYPES,
                *mrope.TILE_MODEL_TYPES,
                *mrope.ANYRES_MODEL_TYPES,
            )
            self.image_blocks = self.model_type in mrope.IMAGE_BLOCK_TYPES
        except PackingError:
            self.images_checked, self.image_blocks = True, False
        self.image_spec = _image_spec(model, self.model_type)

    def __call__(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        impl = attention_implementation(module)
        done = document_mixers(module)  # run_mixers_per_document after the guard: its layers are handled now
        left = self.mixers if done is None else tuple(m for m in self.mixers if m not in done.modes)
        check_packed_ids_forward(args, kwargs)  # first: the other checks judge the keys the call was given
        check_unhandled_mixers(module, kwargs, left)  # without kernels, seq_idx alone is no fix
        check_forward_inputs(kwargs, impl, left)
        # a sample alone is built right by the model itself, and a generation step is no packed row; but one
        # document with the collator's masks (Gemma 3) is read as they say, so the backend must read them
        if self.images_checked and (
            packed_training_input(kwargs) or (self.image_blocks and ready_made_masks(kwargs))
        ):
            check_image_inputs(module, kwargs, impl)  # refused by name (the probe packs text only)
        if self.multimodal and packed_training_input(kwargs):  # a placeholder token without its pixels
            check_image_placeholders(module, kwargs)
            check_document_images(module, self.image_spec, kwargs)  # each document's images its own
        if self.positionless:
            check_positionless_masks(module, kwargs, impl)
        if self.text_row:
            check_text_row(module, kwargs, impl)
        check_length_dependent_rope(self.rope, kwargs)
        check_unshifted_labels(kwargs, self.model_type)
        if packed_training_input(kwargs):
            check_router_filler(module, kwargs)
            if kwargs.get("labels") is not None:  # the z-loss is added to the loss of labels
                check_logits_z_loss(module)
        if self.probe is not None:
            self.probe(module, kwargs)
        if passed_cache(kwargs) is None and (kwargs.get("use_cache") is None or module.training):
            kwargs["use_cache"] = False
        return args, kwargs


def _image_spec(model: Any, model_type: Any) -> Any:
    """The :class:`~packtools.batches.mrope.MropeSpec` of a verified vision-language model (what its collator reads
    from the config), or ``None`` (another model, or a config the collator refuses: no batch of it is built)."""
    if model_type not in mrope.VERIFIED_MODEL_TYPES:
        return None
    try:
        return mrope.MropeSpec.from_config(base_model(model).config)
    except (PackingError, AttributeError):
        return None


#: The forward inputs that give a verified vision-language model's images, by which :func:`check_document_images`
#: matches them to the image tokens.
_PER_IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes")


def check_document_images(model: Any, spec: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a packed forward into a verified vision-language model (``spec``, its
    :class:`~packtools.batches.mrope.MropeSpec`) whose images do not match each document's image tokens, by the
    collator's own rules (:func:`~packtools.batches.vision.check_batch_images`): Qwen-VL's ``image_grid_thw``
    against each document's runs, LLaVA-NeXT's / OneVision's ``image_sizes`` (and ``batch_num_images``) against
    each document's tokens, the LLaVA-style types' (Idefics3 / SmolVLM tiles included) runs whole images.  The
    models match images to image tokens by order and check only the totals, so two images' sizes or grids swapped
    (a collator of one's own) gave features to the wrong document with no error.  Documents are told by the
    batch's positions restarting (or its ``cu_seq_lens_q``); only ``input_ids``, the positions and the small
    per-image inputs are read (one host copy each), never the pixels."""
    ids = kwargs.get("input_ids")
    if (
        spec is None
        or ids is None
        or not hasattr(ids, "shape")
        or all(kwargs.get(n) is None for n in _PER_IMAGE_INPUTS)
    ):
        return
    flat_ids = np.asarray(host_numpy(ids)).reshape(-1)
    width = int(ids.shape[-1]) if getattr(ids, "ndim", 0) else 1
    starts = set(range(0, flat_ids.shape[0], max(width, 1)))  # each row starts a document
    positions = _document_positions(kwargs, kwargs.get("position_ids"))
    if positions is not None:
        pos = np.asarray(host_numpy(positions)).reshape(-1)
        starts.update(np.flatnonzero(pos == 0).tolist())
    try:
        check_batch_images(spec, flat_ids, sorted(starts), kwargs)
    except PackingError as err:
        raise PackingError(
            f"{type(base_model(model)).__name__} (model_type {spec.model_type!r}) got a packed forward whose images "
            f"do not match its documents' image tokens: {err} The model matches images to image tokens by order "
            f"alone, so it would give their features to the wrong tokens (another document's, or other tiles) with "
            f"no error. Collate packed rows with packtools.batches.MultimodalCollator(model, pad_token_id), which "
            f"keeps each document's images with it in row order.",
            param=err.param,
        ) from None


def watch_model(model: Any, *, owner: Any) -> None:
    """Guard ``model`` lazily: a model the trainer holds besides the ones packtools prepares (a reward model, a
    judge, a critic of the user's ``compute_loss``), which may well run only on unpacked inputs of its own.

    Its forwards are checked by :func:`check_packed_ids_forward` (inside a trainer's ``compute_loss``,
    ``training_step`` or ``prediction_step``, the packed batch's tokens without what separates their documents,
    or a CP shard's without its key, are refused), and from its first packed input
    (:func:`packed_training_input`) on by the whole guard of :func:`guard_model`, the isolation probe included:
    a model it would refuse is refused then, at that forward, not before -- a model never given a packed row is
    never refused, and its forwards are left as they are (no ``use_cache`` set) until then.  Nothing is done for
    a model :func:`guard_model` guards already; the hooks are recorded on ``owner`` (``unprepare`` removes them).
    Its backbone (``judge.model``) called on its own gets the same checks (:class:`BackboneHook`), judged as the
    model's; from inside the model's forward it is not checked twice.  The hooks (:class:`WatchHook`) pickle
    and deep-copy with the model, as :class:`GuardHook` does."""
    if _HOOK_ATTR in vars(model) or _WATCH_ATTR in vars(model):
        return
    backbone = _backbone(model)
    watch = WatchHook(tracks=backbone is not None)
    set_attr(model, _WATCH_ATTR, forward_pre_hook(model, watch, owner=owner), owner=owner)
    if backbone is not None:  # self.judge.model(input_ids=...): the backbone called on its own is watched too
        forward_hook(model, _LeaveWatched(), owner=owner)
        forward_pre_hook(backbone, BackboneHook(model, watch), owner=owner)


def _backbone(model: Any) -> Any:
    """The transformers backbone of ``model`` (``LlamaForCausalLM.model``: ``PreTrainedModel.base_model``), or
    ``None`` where it is the model itself."""
    base = base_model(model)
    inner = getattr(base, "base_model", None)
    if (
        inner is None
        or inner is base
        or inner is model
        or not callable(getattr(inner, "register_forward_pre_hook", None))
    ):
        return None
    return inner


def _token_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if ids is not None else kwargs.get("inputs_embeds")


class WatchHook:
    """:func:`watch_model`'s forward pre-hook: the packed-ids check until the first packed input, the whole
    :class:`GuardHook` (built then) from it on."""

    def __init__(self, tracks: bool = False) -> None:
        self.full: GuardHook | None = None
        #: the model's backbone is watched too (:class:`BackboneHook`): each forward's token input is recorded
        self.tracks = tracks

    def __call__(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.tracks:  # popped by _LeaveWatched, even when a check below refuses
            _WATCHED_INPUTS.set((*_WATCHED_INPUTS.get(), _token_input(args, kwargs)))
        return self.check(module, args, kwargs)

    def check(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if _HOOK_ATTR in vars(module):  # guarded since (guard_model): its guard checks
            return args, kwargs
        if self.full is None:
            check_packed_ids_forward(args, kwargs)
            if not packed_training_input(kwargs):
                return args, kwargs
            self.full = _guard_hook(module, check_isolation=True)
        return self.full(module, args, kwargs)


class _LeaveWatched:
    """After a watched model's forward (called even when it raised): its token input off :data:`_WATCHED_INPUTS`."""

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if running := _WATCHED_INPUTS.get():
            _WATCHED_INPUTS.set(running[:-1])


class BackboneHook:
    """The forward pre-hook of a watched model's backbone: a call of it on its own (not from inside the model's
    forward, told by the very token input) gets the model's checks (:meth:`WatchHook.check`, judged as the
    model's), so ``self.judge.model(input_ids=packed_ids)`` without the batch's positions is refused as
    ``self.judge(input_ids=packed_ids)`` is; from inside the model's forward it does nothing (checked there)."""

    def __init__(self, model: Any, watch: WatchHook) -> None:
        self.model, self.watch = model, watch

    def __call__(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        token = _token_input(args, kwargs)
        if token is not None and any(token is t for t in _WATCHED_INPUTS.get()):
            return args, kwargs
        return self.watch.check(self.model, args, kwargs)


def refuse_encoder_decoder(model: Any, caller: str) -> None:
    """Refuse an encoder-decoder model (``config.is_encoder_decoder``: Whisper, T5, BART, Florence-2, ...) by
    name.  packtools' packed rows are decoder-only: their labels are laid out for a next-token loss (position
    ``i`` predicts ``labels[i + 1]``, ``-100`` on every sequence start) and their documents are told apart by
    ``position_ids``.  An encoder-decoder model shifts ``labels`` right into its decoder inputs itself and scores
    position ``i`` against ``labels[i]``, and reads no ``position_ids`` (Whisper: ``decoder_position_ids``), so a
    packed row reached it with no error: each sequence's first token dropped from the loss, the previous
    sequence's last label fed as its first decoder input, and the documents attending each other in the
    decoder.  Its causal-LM sibling (``BartForCausalLM`` & co.) is a decoder-only model and is not refused.

    >>> from types import SimpleNamespace as NS
    >>> refuse_encoder_decoder(NS(config=NS(is_encoder_decoder=False)), "guard_model")
    >>> refuse_encoder_decoder(NS(config=NS(is_encoder_decoder=True)), "guard_model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: guard_model: SimpleNamespace is an encoder-decoder model...
    """
    base = base_model(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False) is not True:
        return
    raise PackingError(
        f"{caller}: {type(base).__name__} is an encoder-decoder model (config.is_encoder_decoder): packtools packs "
        f"rows for decoder-only models, whose loss predicts labels[i + 1] at position i and whose documents are "
        f"told apart by position_ids. This model shifts its labels into the decoder inputs itself and reads no "
        f"position_ids, so a packed row would train each document with the previous one's tokens in view and its "
        f"first token dropped from the loss, with no error. Train it on unpacked, padded batches.",
        param="model",
    )


def length_dependent_rope(model: Any) -> tuple[tuple[str, str, int], ...]:
    """``(model name, rope_type, threshold)`` of each rotary embedding of ``model`` whose frequencies transformers
    picks from the longest sequence of the forward (``max(position_ids) + 1``), not per sequence: ``longrope``
    (Phi-3/3.5/4-mini: the long factors for every token once it exceeds ``original_max_position_embeddings``) and
    the ``dynamic`` NTK types (frequencies rescaled once it exceeds ``max_position_embeddings``).

    >>> from types import SimpleNamespace as NS
    >>> config = NS(rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 4096},
    ...     max_position_embeddings=131072)
    >>> length_dependent_rope(NS(config=config))
    (('SimpleNamespace', 'longrope', 4096),)
    """
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        return ()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, Mapping):
        return ()
    every = params.values() if all(isinstance(v, Mapping) for v in params.values()) and params else [params]
    found = []
    for entry in every:  # one entry, or one per layer type (sliding / full attention)
        kind = str(entry.get("rope_type", ""))
        if kind == "longrope":
            limit = entry.get("original_max_position_embeddings")
            limit = limit if limit is not None else getattr(text, "original_max_position_embeddings", None)
        elif "dynamic" in kind:
            limit = getattr(text, "max_position_embeddings", None)
        else:
            continue
        if isinstance(limit, int):
            found.append((type(base).__name__, kind, limit))
    return tuple(dict.fromkeys(found))


def document_lengths(position_ids: Any) -> Any:
    """The length of every sequence of a packed batch from its 2-D ``position_ids`` (each restarts at 0 and steps
    by 1): the last position of each run, plus one.

    >>> import torch
    >>> document_lengths(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])).tolist()
    [3, 2, 4, 1]
    """
    pos = position_ids
    following = pos.new_full(pos.shape, -1)
    following[:, :-1] = pos[:, 1:]
    return pos[following != pos + 1] + 1


def check_length_dependent_rope(rope: tuple[tuple[str, str, int], ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a packed batch on which a :func:`length_dependent_rope` embedding would rotate some sequence with
    other frequencies than it alone: transformers picks them from ``max(position_ids) + 1`` of the forward, so
    ``longrope`` is wrong for a sequence on the other side of its threshold than that length (short sequences
    packed with a longer one), ``dynamic`` once either exceeds it (every sequence rotated for that length).
    Nothing else shows it; the isolation probe's short sequences never reach the threshold.

    A context-parallel shard (``packtools_cp``) is judged by its row's true document lengths against each rank's
    own ``max(position_ids)``: a rank holding the middle chunks of a document over the threshold sees positions
    under it and would rotate them with the short factors (one document, no restart in the rank's positions),
    while a rank holding the head and tail chunks of documents all over it is right (its positions restart).
    Every rank of the CP group judges every rank's positions (from the layout they share) and refuses alike:
    a refusal on some ranks only would leave the others waiting in the CP attention's all-gather."""
    pos = kwargs.get("position_ids")
    if not rope or pos is None or getattr(pos, "ndim", 0) != 2 or not hasattr(pos, "new_full"):
        return
    if generating(kwargs):
        return
    shard = kwargs.get("packtools_cp")
    layout = getattr(shard, "layout", None)
    if layout is not None:  # the documents' lengths are the layout's, not the positions' runs
        lengths = [int(n) for n in layout.lengths]
        # Every rank of the CP group judged alike, from the layout they share: a refusal on some ranks only
        # would leave the others waiting in the CP attention's all-gather (a hang).
        for rank in range(int(layout.cp_size)):
            seen = int(layout.positions(rank).max()) + 1
            found = rope_mismatch(rope, lengths, seen)
            if found is not None:
                name, limit, why = found
                raise PackingError(
                    f"{name}: the context-parallel shard of rank {rank} of the CP group would train with wrong "
                    f"positions, with no error (every rank of the group refuses the row): {why}. Pack with "
                    f"max_length <= {limit} (pack_dataset(..., max_length={limit})) so that no sequence crosses "
                    f"it, or train the longer sequences unpacked, in batches of their own and without context "
                    f"parallelism.",
                    param="model",
                )
        return
    if is_packed(kwargs):
        lengths = [int(n) for n in document_lengths(pos).tolist()]
        seen = max(lengths)
    else:
        return
    found = rope_mismatch(rope, lengths, seen)
    if found is None:
        return
    name, limit, why = found
    raise PackingError(
        f"{name}: packed sequences would train with wrong positions, with no error: {why}. Pack with "
        f"max_length <= {limit} (pack_dataset(..., max_length={limit})) so that no sequence crosses it, or "
        f"train the longer sequences unpacked, in batches of their own.",
        param="model",
    )


def rope_mismatch(
    rope: tuple[tuple[str, str, int], ...], lengths: Sequence[int], seen: int
) -> tuple[str, int, str] | None:
    """The rule of :func:`check_length_dependent_rope` on plain numbers: ``(model name, threshold, why)`` when a
    forward holding sequences of ``lengths`` whose positions reach ``seen`` (``max(position_ids) + 1``) would
    rotate one of them with other frequencies than it alone gets, else ``None``.

    >>> rope = (("Phi3ForCausalLM", "longrope", 10),)
    >>> rope_mismatch(rope, [12, 4], 12)[:2], rope_mismatch(rope, [12, 14], 14)
    (('Phi3ForCausalLM', 10), None)
    """
    for name, kind, limit in rope:
        if kind == "longrope":
            other = [n for n in lengths if (n > limit) != (seen > limit)]
            if not other:
                continue
            why = (
                f"its longrope rotary embedding uses the long factors for every token of a forward once "
                f"max(position_ids) + 1 exceeds original_max_position_embeddings={limit}, the short ones "
                f"otherwise: this forward's positions reach {seen}, and it holds a sequence of {other[0]} tokens, "
                f"which alone would get the {'short' if seen > limit else 'long'} factors"
            )
        elif seen > limit or max(lengths) > limit:
            why = (
                f"its {kind!r} rotary embedding rescales its frequencies for max(position_ids) + 1 of a forward "
                f"once it exceeds max_position_embeddings={limit}: this forward's positions reach {seen} and its "
                f"longest sequence holds {max(lengths)} tokens, so its sequences would be rotated for another "
                f"length than their own"
            )
        else:
            continue
        return name, limit, why
    return None


class FirstPackedProbe:
    """The guard's isolation probe: run once, on the first packed batch (:func:`is_packed`) outside generation,
    with that batch's keys; the probe's own forwards pass through the guard without probing again.  A batch of
    multimodal (3-D) rotary positions is left to the vision probe (``prepare_trainer``'s), which builds them.
    A context-parallel shard is probed on every rank of its CP group, the verdict agreed (:func:`agreed_refusal`)."""

    def __init__(self) -> None:
        self.done = False
        #: a context-parallel shard's probe passed, apart from ``done``: every rank of the CP group joins the
        #: agreement (one all-reduce) on its first shard, whatever non-CP batch a rank alone probed before
        self.cp_done = False
        self.running = False

    def __call__(self, module: Any, kwargs: Mapping[str, Any]) -> None:
        if self.running or generating(kwargs):
            return
        pos = kwargs.get("position_ids")
        shard = kwargs.get("packtools_cp")
        if shard is not None and int(getattr(getattr(shard, "layout", None), "cp_size", 1)) > 1:
            if self.cp_done:
                return
            # A context-parallel shard: whether this rank's positions restart depends on the chunks it holds
            # (the middle chunks of one document do not), so the first shard is probed on every rank of the CP
            # group, which reach it in the same forward, and the verdict is agreed on before any raises.
            self._probe_shard(module, kwargs, shard)
            return
        if self.done:
            return
        if not is_packed(kwargs) or (pos is not None and getattr(pos, "ndim", 2) != 2):
            return  # (3-D multimodal rotary positions: the vision probe's, as in check_forward_inputs)
        self._probe(module, kwargs)
        self.done = True

    def _probe_shard(self, module: Any, kwargs: Mapping[str, Any], shard: Any) -> None:
        """Probe on the first CP shard, then agree over the shard's CP group (one all-reduce, once): every rank
        raises if any rank's probe refused or failed (the failing rank its own error, the others a
        :class:`PackingError` naming another rank), so none is left waiting in the agreement or in the CP
        attention's all-gather."""
        from ..attention.context_parallel import shard_group

        # Whatever the probe raises (a refusal, or any other error of its forwards: out of memory, a model
        # that fails on the probe's rows), this rank joins the agreement before raising it: a rank that raised
        # past the all-reduce left the others waiting in it for ever.
        refused: BaseException | None = None
        try:
            self._probe(module, kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the agreement
            refused = err
        if not agreed_refusal(refused is not None, shard_group(shard)):
            self.done = self.cp_done = True  # (refused: every rank refused, and every rank probes again)
            return
        if refused is None:
            raise PackingError(
                f"guard_model: the first context-parallel batch's probe failed on another rank of the CP group "
                f"(a refusal of {type(base_model(module)).__name__}, or an error of the probe: see that rank's "
                f"error), so this rank stops too: training on packed rows there would be silently wrong, and "
                f"this rank would wait for it for ever.",
                param="model",
            )
        raise refused

    def _probe(self, module: Any, kwargs: Mapping[str, Any]) -> None:
        """Run :func:`~packtools.integrations.attention.isolation.check_isolation` with the batch's keys."""
        check_sharded_probe(module)  # sharded after guard_model: refused before the probe's first gather
        import torch

        from ...batches.collate import PaddingFreeCollator
        from ..attention.isolation import check_isolation

        config = getattr(base_model(module), "config", None)
        pad = getattr(config, "pad_token_id", None)
        keys = {k for k, v in kwargs.items() if v is not None} | {"input_ids", "labels"}
        collator = PaddingFreeCollator(pad if isinstance(pad, int) else 0)

        def same_keys(rows: list[dict[str, Any]]) -> dict[str, Any]:
            return {k: v for k, v in collator(rows).items() if k in keys}

        # Outside Dynamo's trace: under torch.compile(model) the hook is traced, and the probe's numpy and nested
        # forwards are no graph (it failed in tracing: 'Dynamo failed to run FX node' on np.split).
        probe = torch.compiler.disable(check_isolation)
        # Under DistributedDataParallel the probe runs its module: DDP's own forward broadcasts the buffers, a
        # collective, and the ranks reach their first packed batch at different steps (a row of one document is no
        # packed batch), so the probe's extra forwards on one rank met the real forward of another (gloo: 'Received
        # data size doesn't match expected size', the process aborted).
        target = module
        while is_instance(target, "torch", "DistributedDataParallel") or is_instance(
            target, "torch", "DataParallel"
        ):
            target = target.module
        self.running = True
        try:
            probe(target, same_keys)
        except PackingError as err:
            raise PackingError(
                f"guard_model: the first packed batch's probe found that {type(base_model(module)).__name__} does "
                f"not keep packed sequences apart, so training on packed rows would be silently wrong. "
                f"{segmented_hint(module)}{err}",
                param="model",
            ) from err
        finally:
            self.running = False


def agreed_refusal(refused: bool, group: Any) -> bool:
    """Whether any rank of ``group`` (a ``torch.distributed`` process group, ``None``: the default one) refused:
    one all-reduce of a flag, on the device the group's backend takes.  Without an initialized process group:
    this rank's own verdict."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return refused
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    flag = torch.tensor([1 if refused else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def check_sharded_probe(model: Any) -> None:
    """Refuse the guard's isolation probe on a model whose forward gathers its sharded parameters (FSDP2's
    ``fully_shard``, FSDP1, DeepSpeed ZeRO-3: :func:`~packtools.integrations.parallel.distributed.sharded_by`).
    The probe runs extra forwards on the first packed batch a process sees, and the processes reach theirs at
    different steps (a row of one document is no packed batch): one process's probe gathers met another's real
    forward and backward, and both waited for ever (``fully_shard`` on 2 gloo processes: a hang, no error).
    Where every process happened to probe at the same step it ran, but nothing makes it so.

    >>> import torch
    >>> check_sharded_probe(torch.nn.Linear(2, 2))  # nothing sharded: nothing to refuse
    """
    how = sharded_by(model)
    if how is None:
        return
    raise PackingError(
        f"guard_model: {type(base_model(getattr(model, 'module', model))).__name__} is sharded by {how}, whose every forward gathers the "
        f"parameters from all processes (a collective); the isolation probe runs extra forwards on the first "
        f"packed batch each process sees, and the processes reach it at different steps, so their gathers would "
        f"not match (a hang). Probe the model before sharding it -- "
        f"packtools.integrations.check_isolation(model) on the unsharded model, on every process -- then guard "
        f"the sharded one with guard_model(model, check_isolation=False).",
        param="check_isolation",
    )


def segmented_hint(model: Any) -> str:
    """For an ``sdpa`` model: packtools' per-sequence sdpa, which separates sequences whatever the model builds."""
    if attention_implementation(model) != "sdpa":
        return ""
    return (
        "On 'sdpa', packtools.integrations.use_segmented_sdpa(model) (what prepare_trainer does) runs attention "
        "per sequence from position_ids/cu_seq_lens and may make it exact; call guard_model after it. "
    )


def refuse_prompt_learning(model: Any, param: str | None = "model") -> None:
    """Raise when ``model`` carries a prompt-learning PEFT adapter: its virtual tokens go in front of every
    sequence, which a padding-free row cannot hold."""
    peft_config = getattr(model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        raise PackingError(
            "prompt-learning PEFT adapters add virtual tokens in front of every sequence, which a padding-free "
            "row cannot hold; use LoRA-style adapters.",
            param=param,
        )
