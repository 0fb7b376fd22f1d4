"""Padding-free batches from packed rows: the collator that feeds FlashAttention varlen training.

A batch of rows (each a packed row with ``seq_lengths``, or one plain sequence) becomes one flat sequence of
``T`` tokens with the segment boundaries a varlen attention kernel needs.  The contract (see the project's
MISSION): ``cu_seq_lens`` int32, starting at 0, strictly increasing, ending at ``T``; ``position_ids``
restarting at 0 in every segment; ``labels`` -100 at every segment start and on all padding; no
``attention_mask`` with packed input; padding for ``pad_to_multiple_of`` forming **one** extra segment.

Everything is built with NumPy on rows laid end to end (:class:`~packtools.batches.flatten.FlatRows`, by
:func:`assemble_padding_free`, :func:`assemble_padded`), so the Arrow-native paths (``PackedRows``,
``PackedView``) reuse it; torch is imported only to wrap the result.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._optional import require
from ..constants import IGNORE_INDEX, VARLEN_KEYS
from ..core.ragged import offsets_of
from ..errors import PackingError
from .buckets import bucket_for, check_buckets, pad_cu_seq_lens
from .flatten import FlatRows, check_carried, check_leave_out, flatten_rows, restart_positions
from .labels import ignore_starts, mask_keys


def _padded_total(total: int, multiple: int | None) -> int:
    return total if multiple is None else -(-total // multiple) * multiple


def assemble_padding_free(
    flat: FlatRows, pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, Any]:
    """The padding-free batch, as NumPy arrays (``max_length_*`` as Python ints).

    >>> f = flatten_rows([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])
    >>> b = assemble_padding_free(f, pad_token_id=0, pad_to_multiple_of=4)
    >>> b["labels"].tolist(), b["position_ids"].tolist(), b["cu_seq_lens_q"].tolist()
    ([[-100, 6, -100, -100]], [[0, 1, 0, 0]], [0, 2, 3, 4])
    """
    total = int(flat.input_ids.shape[0])
    padded = _padded_total(total, pad_to_multiple_of)
    seg = flat.seg_lengths
    if padded > total:
        seg = np.append(seg, padded - total)
    cu = offsets_of(seg, np.int32)
    if padded > total:
        input_ids = np.full(padded, pad_token_id, np.int64)
        input_ids[:total] = flat.input_ids
        labels = np.full(padded, IGNORE_INDEX, np.int64)
        labels[:total] = flat.labels
    else:
        input_ids = flat.input_ids
        labels = flat.labels.copy() if flat.labels is flat.input_ids else flat.labels
    ignore_starts(labels, cu[:-1])
    max_len = int(seg.max())
    return {
        "input_ids": input_ids[None],
        "labels": labels[None],
        "position_ids": restart_positions(seg)[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
        "seq_idx": np.repeat(np.arange(seg.shape[0], dtype=np.int32), seg)[None],
    }


def assemble_padded(
    flat: FlatRows, pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, Any]:
    """Rows right-padded to ``[B, T]``; positions restart per packed sequence (padding is one more segment).

    ``attention_mask`` is returned only when no row holds more than one sequence: without it, the backends of
    :data:`MASK_FROM_POSITIONS` build the block-diagonal mask from ``position_ids`` (:func:`check_padded_attention`).

    >>> f = flatten_rows([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}, {"input_ids": [8]}])
    >>> b = assemble_padded(f, pad_token_id=0)
    >>> b["input_ids"].tolist(), b["position_ids"].tolist(), "attention_mask" in b
    ([[5, 6, 7], [8, 0, 0]], [[0, 1, 0], [0, 0, 1]], False)
    """
    b = flat.row_lengths.shape[0]
    width = _padded_total(int(flat.row_lengths.max()), pad_to_multiple_of)
    pads = width - flat.row_lengths
    # Segments of every row, followed by that row's padding segment (when it has padding).
    counts = flat.segs_per_row + (pads > 0)
    seg = np.zeros(int(counts.sum()), np.int64)
    ends = np.cumsum(counts)
    is_pad = np.zeros(seg.shape[0], bool)
    is_pad[(ends - 1)[pads > 0]] = True
    seg[~is_pad] = flat.seg_lengths
    seg[is_pad] = pads[pads > 0]
    positions = restart_positions(seg).reshape(b, width)
    valid = np.arange(width)[None, :] < flat.row_lengths[:, None]
    input_ids = np.full((b, width), pad_token_id, np.int64)
    input_ids[valid] = flat.input_ids
    labels = np.full((b, width), IGNORE_INDEX, np.int64)
    labels[valid] = flat.labels
    ignore_starts(labels, positions == 0)
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "position_ids": positions}
    if int(flat.segs_per_row.max()) <= 1:
        out["attention_mask"] = valid.astype(np.int64)
    return out


def check_static_args(
    pad_to_buckets: object, pad_cu_seq_lens_to: object, pad_to_multiple_of: int | None, padding_free: bool
) -> tuple[tuple[int, ...] | None, int | None]:
    """Validate the static-shape options; bucket sizes come back rounded up to ``pad_to_multiple_of``."""
    if pad_to_buckets is None and pad_cu_seq_lens_to is None:
        return None, None
    if not padding_free:
        raise PackingError(
            "pad_to_buckets / pad_cu_seq_lens_to make padding-free batches static; padded batches [B, T] also "
            "vary in B. Use padding_free=True (one [1, T] row) for static shapes.",
            param="padding_free",
        )
    buckets = None
    if pad_to_buckets is not None:
        sizes = check_buckets(pad_to_buckets, "pad_to_buckets")
        buckets = tuple(sorted({_padded_total(b, pad_to_multiple_of) for b in sizes}))
    if pad_cu_seq_lens_to is not None and (
        isinstance(pad_cu_seq_lens_to, bool)
        or not isinstance(pad_cu_seq_lens_to, (int, np.integer))
        or pad_cu_seq_lens_to < 2
    ):
        raise PackingError(
            f"pad_cu_seq_lens_to must be None or an int >= 2 (entries of cu_seq_lens), got {pad_cu_seq_lens_to!r}.",
            param="pad_cu_seq_lens_to",
        )
    return buckets, None if pad_cu_seq_lens_to is None else int(pad_cu_seq_lens_to)


def assemble_static(
    flat: FlatRows,
    pad_token_id: int,
    pad_to_multiple_of: int | None,
    buckets: tuple[int, ...] | None,
    cu_size: int | None,
) -> dict[str, Any]:
    """A padding-free batch with static shapes: ``T`` rounded up to a bucket, ``cu_seq_lens`` to ``cu_size``.

    The bucket padding is one segment, as for ``pad_to_multiple_of``; ``max_length_q/k`` become the bucket size
    (an upper bound on every segment, and one value per bucket, so compilers see one shape per bucket).
    ``cu_seq_lens`` is padded by repeating its last value (empty trailing segments, which FlashAttention skips).

    >>> f = flatten_rows([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])
    >>> b = assemble_static(f, 0, None, (4, 8), cu_size=6)
    >>> b["input_ids"].tolist(), b["cu_seq_lens_q"].tolist(), b["max_length_q"]
    ([[5, 6, 7, 0]], [0, 2, 3, 4, 4, 4], 4)
    """
    if buckets is None:
        batch = assemble_padding_free(flat, pad_token_id, pad_to_multiple_of)
    else:
        target = bucket_for(int(flat.input_ids.shape[0]), buckets)
        batch = assemble_padding_free(flat, pad_token_id, target)  # pads to exactly `target`, one segment
        batch["max_length_q"] = batch["max_length_k"] = target
    if cu_size is not None:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = pad_cu_seq_lens(batch["cu_seq_lens_q"], cu_size)
    return batch


def check_pad_args(pad_token_id: object, pad_to_multiple_of: object) -> tuple[int, int | None]:
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
        raise PackingError(
            f"pad_token_id must be an int, got {pad_token_id!r}; use tokenizer.pad_token_id "
            f"(or tokenizer.eos_token_id when the tokenizer has no pad token)."
        )
    if pad_token_id < 0:  # the padding is a token the model embeds: a negative id fails there, far from here
        raise PackingError(
            f"pad_token_id={int(pad_token_id)} is not a token id (ids are >= 0; -100 is the labels' ignore index, "
            f"which the collator puts in the labels of padding by itself); use tokenizer.pad_token_id (or "
            f"tokenizer.eos_token_id when the tokenizer has no pad token).",
            param="pad_token_id",
        )
    if pad_to_multiple_of is not None and (
        isinstance(pad_to_multiple_of, bool)
        or not isinstance(pad_to_multiple_of, (int, np.integer))
        or pad_to_multiple_of < 1
    ):
        raise PackingError(f"pad_to_multiple_of must be None or a positive int, got {pad_to_multiple_of!r}.")
    return int(pad_token_id), None if pad_to_multiple_of is None else int(pad_to_multiple_of)


def to_tensors(batch: dict[str, Any], return_tensors: str) -> dict[str, Any]:
    """Wrap NumPy arrays as torch tensors (zero copy); Python ints stay ints."""
    if return_tensors == "np":
        return batch
    torch = require("torch", "PaddingFreeCollator(return_tensors='pt')")
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


#: Attention backends of transformers that build a block-diagonal mask from ``position_ids`` when no
#: ``attention_mask`` is given (and no cache is used), whatever the batch size: packed ``[B, T]`` rows are exact
#: there.  FlashAttention infers sequences from ``position_ids`` only for a single row.
MASK_FROM_POSITIONS = ("sdpa", "eager", "flex_attention", "packtools_sdpa")


def check_padded_attention(flat: FlatRows, attn_implementation: str | None) -> None:
    """Packed rows in a padded ``[B, T]`` batch (B > 1) are separated only by the backends of
    :data:`MASK_FROM_POSITIONS`; refuse unless one is named."""
    if flat.row_lengths.shape[0] < 2 or int(flat.segs_per_row.max()) <= 1:
        return
    if attn_implementation in MASK_FROM_POSITIONS:
        return
    named = "no attention backend was named" if attn_implementation is None else f"{attn_implementation!r}"
    raise PackingError(
        f"the batch holds {flat.row_lengths.shape[0]} rows of which some are packed, padded to [B, T] without an "
        f"attention_mask; only {list(MASK_FROM_POSITIONS)} build the block-diagonal mask from position_ids for "
        f"several rows (FlashAttention infers sequences from them for a single row only, so packed sequences "
        f"would attend to each other), and {named}. Use PaddingFreeCollator(padding_free=True) (one flat row "
        f"with cu_seq_lens, exact on every backend), or name the model's backend: "
        f"PaddingFreeCollator(padding_free=False, attn_implementation='sdpa').",
        param="attn_implementation",
    )


def check_separated(flat: FlatRows, batch: Mapping[str, Any], padding_free: bool) -> None:
    """Refuse a batch whose rows hold several sequences when the ``return_*`` switches left nothing that tells
    the model where they start: neither ``position_ids`` (what ``sdpa`` / ``eager`` / ``flex_attention`` build
    the block mask from) nor ``cu_seq_lens_q`` (FlashAttention's).  ``seq_idx`` alone separates nothing in
    attention.  Such a batch (``input_ids`` and ``labels`` only, maybe ``seq_idx``) runs each row as one
    sequence with no error, on every backend, and the guard cannot tell it from an unpacked one.  Padding-free,
    the rows themselves are laid end to end in one ``[1, T]`` row: two rows of one sequence each are two
    sequences there, refused alike (padded, such rows keep their ``attention_mask``)."""
    if flat.segs_per_row.shape[0] == 0 or "position_ids" in batch or "cu_seq_lens_q" in batch:
        return
    if padding_free and int(flat.segs_per_row.sum()) > 1 and int(flat.segs_per_row.max()) <= 1:
        raise PackingError(
            f"the batch's {flat.segs_per_row.shape[0]} rows are laid end to end in one padding-free row, but the "
            f"collator returns neither position_ids nor cu_seq_lens (return_position_ids=False, "
            f"return_flash_attn_kwargs=False): the model would run them as one sequence, each row attending to "
            f"the rows before it, with no error. Keep return_position_ids=True (or, for FlashAttention only, "
            f"return_flash_attn_kwargs=True), or use padding_free=False (a padded [B, T] batch with its "
            f"attention_mask).",
            param="return_position_ids",
        )
    if int(flat.segs_per_row.max()) <= 1:
        return
    row = int(np.argmax(flat.segs_per_row > 1))
    keep = (
        "return_position_ids=True (or, for FlashAttention only, return_flash_attn_kwargs=True)"
        if padding_free
        else "return_position_ids=True (the padded [B, T] output has nothing else that separates them)"
    )
    raise PackingError(
        f"row {row} of the batch holds {int(flat.segs_per_row[row])} packed sequences, but the collator returns "
        f"neither position_ids nor cu_seq_lens (return_position_ids=False"
        f"{', return_flash_attn_kwargs=False' if padding_free else ''}): the model would run each row as one "
        f"sequence, its sequences attending to each other, with no error. Keep {keep}.",
        param="return_position_ids",
    )


#: The keys each ``return_*`` switch of :class:`PaddingFreeCollator` controls (padding-free output).
SWITCHED_KEYS = {
    "return_position_ids": ("position_ids",),
    "return_flash_attn_kwargs": VARLEN_KEYS,
    "return_seq_idx": ("seq_idx",),
    "return_use_cache": ("use_cache",),
}


class PaddingFreeCollator:
    """Collate packed rows into a padding-free batch for FlashAttention-varlen training.

    Rows are dicts with ``input_ids``, ``seq_lengths`` (the lengths of the sequences packed in the row) and
    optionally ``labels`` and ``completion_mask`` / ``assistant_masks`` (used when there are no ``labels``:
    tokens where a mask is 0 get -100; ``completion_only_loss=False`` / ``assistant_only_loss=False``
    ignore that mask and learn every token).  Values may be lists, NumPy arrays or CPU tensors.  Empty rows
    are skipped.

    A row without ``seq_lengths`` is refused: it may be a packed row whose ``seq_lengths`` column was
    dropped on the way (``transformers.Trainer`` drops columns the model does not name unless
    :func:`packtools.prepare_trainer` keeps them), and treating it as one sequence would let its sequences
    attend to each other.  Pass ``unpacked=True`` when every row without ``seq_lengths`` really is one
    sequence.  An ``attention_mask`` column is refused beside ``seq_lengths``, and when it holds padding.

    Padding-free output (``padding_free=True``): ``input_ids``, ``labels``, ``position_ids`` and ``seq_idx``
    of shape ``[1, T]``, ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, ``[n + 1]``) and
    ``max_length_q``/``max_length_k`` (Python int).  Every sequence start and all padding get -100 in labels;
    padding for ``pad_to_multiple_of`` is one extra segment.  Without padding the values equal those of TRL's
    ``DataCollatorForLanguageModeling(padding_free=True)`` on the same rows.  Like transformers'
    ``DataCollatorWithFlattening``, ``return_position_ids``, ``return_flash_attn_kwargs`` (``cu_seq_lens_*``,
    ``max_length_*``) and ``return_seq_idx`` switch those keys off (:func:`prepare_trainer` switches off
    the ones the model's ``forward`` does not take); rows of several sequences (padding-free: a batch of several,
    rows of one each included) with neither ``position_ids`` nor ``cu_seq_lens`` left are refused
    (:func:`check_separated`).

    Every batch also holds ``use_cache=False`` (``return_use_cache=False`` leaves it out): Llama and most
    models default to ``use_cache=True``, and with a cache transformers' ``sdpa``/``eager``/``flex_attention``
    build no per-sequence mask from ``position_ids``, so ``model(**batch)`` would let the packed sequences
    attend to each other.  With the key in the batch, ``model(**batch)`` is right without anything else (and
    ``model(**batch, use_cache=False)`` is a ``TypeError``: the value is given twice; drop the keyword).

    Padded output (``padding_free=False``): ``[B, T]`` right-padded ``input_ids``, ``labels``,
    ``position_ids`` (restarting per packed sequence), and ``attention_mask`` only if no row is packed.  Several
    rows with packed ones among them are exact only on backends that build the block mask from ``position_ids``
    (sdpa, eager, flex_attention): such a batch is refused unless ``attn_implementation`` names one of them.

    Every column of a row reaches the batch or stops it: a key other than the token, label, mask and
    ``seq_lengths`` columns (``pixel_values``, ``image_grid_thw``, an ``id``...) is refused by name unless
    ``leave_out`` lists it; an image column even then (its placeholder tokens would train without pixels).

    Static shapes, for ``torch.compile(dynamic=False)`` and CUDA graphs (padding-free only): ``pad_to_buckets``
    (sizes, e.g. ``TokenBudgetBatchSampler(..., buckets=K).buckets``) rounds ``T`` up to a bucket and
    ``pad_cu_seq_lens_to=N`` gives ``cu_seq_lens`` exactly ``N`` entries (:func:`assemble_static`).

    >>> c = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    >>> b = c([{"input_ids": [1, 2, 3, 4], "seq_lengths": [3, 1]}, {"input_ids": [5, 6], "seq_lengths": [2]}])
    >>> b["position_ids"].tolist(), b["labels"].tolist(), b["cu_seq_lens_q"].tolist(), b["max_length_q"]
    ([[0, 1, 2, 0, 0, 1]], [[-100, 2, 3, -100, -100, 6]], [0, 3, 4, 6], 3)
    """

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        padding_free: bool = True,
        return_tensors: str = "pt",
        *,
        unpacked: bool = False,
        return_position_ids: bool = True,
        return_flash_attn_kwargs: bool = True,
        return_seq_idx: bool = True,
        return_use_cache: bool = True,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = True,
        pad_to_buckets: Sequence[int] | None = None,
        pad_cu_seq_lens_to: int | None = None,
        leave_out: Sequence[str] = (),
        attn_implementation: str | None = None,
    ) -> None:
        self.pad_token_id, self.pad_to_multiple_of = check_pad_args(pad_token_id, pad_to_multiple_of)
        if return_tensors not in ("pt", "np"):
            raise PackingError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}.")
        self.padding_free = bool(padding_free)
        self.return_tensors = return_tensors
        self.unpacked = bool(unpacked)
        self.return_position_ids = bool(return_position_ids)
        self.return_flash_attn_kwargs = bool(return_flash_attn_kwargs)
        self.return_seq_idx = bool(return_seq_idx)
        self.return_use_cache = bool(return_use_cache)
        self.completion_only_loss = bool(completion_only_loss)
        self.assistant_only_loss = bool(assistant_only_loss)
        self.mask_keys = mask_keys(self.completion_only_loss, self.assistant_only_loss)
        self.dropped_keys = frozenset(
            key for switch, keys in SWITCHED_KEYS.items() if not getattr(self, switch) for key in keys
        )
        self.pad_to_buckets, self.pad_cu_seq_lens_to = check_static_args(
            pad_to_buckets, pad_cu_seq_lens_to, self.pad_to_multiple_of, self.padding_free
        )
        self.leave_out = check_leave_out(leave_out)
        self.attn_implementation = attn_implementation

    def options(self) -> dict[str, Any]:
        """The constructor arguments of this collator (``PaddingFreeCollator(**c.options())`` copies it)."""
        names = list(inspect.signature(PaddingFreeCollator.__init__).parameters)[1:]  # without self
        return {name: getattr(self, name) for name in names}

    def replace(self, **changes: Any) -> PaddingFreeCollator:
        """A copy with some arguments changed, e.g. ``c.replace(return_seq_idx=False)``."""
        return type(self)(**{**self.options(), **changes})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"PaddingFreeCollator({args})"

    def collate_flat(self, flat: FlatRows) -> dict[str, Any]:
        """Build the batch from rows already laid end to end (used by the Arrow-native loader)."""
        if flat.unmarked_row is not None and not self.unpacked:
            raise PackingError(
                f"row {flat.unmarked_row} of the batch has no 'seq_lengths', so PaddingFreeCollator cannot tell "
                f"whether it is one sequence or several packed ones (which would then attend to each other). "
                f"If the dataset is packed, its 'seq_lengths' column was dropped on the way: "
                f"transformers.Trainer drops columns the model's forward does not name "
                f"(remove_unused_columns=True); call packtools.prepare_trainer(trainer), which keeps them, or "
                f"set TrainingArguments(remove_unused_columns=False). If every row is one sequence, pass "
                f"PaddingFreeCollator(..., unpacked=True)."
            )
        if self.pad_to_buckets is not None or self.pad_cu_seq_lens_to is not None:
            batch = assemble_static(
                flat, self.pad_token_id, self.pad_to_multiple_of, self.pad_to_buckets, self.pad_cu_seq_lens_to
            )
        elif self.padding_free:
            batch = assemble_padding_free(flat, self.pad_token_id, self.pad_to_multiple_of)
        else:
            check_padded_attention(flat, self.attn_implementation)
            batch = assemble_padded(flat, self.pad_token_id, self.pad_to_multiple_of)
        batch["use_cache"] = False  # model(**batch) is right by construction (see the class docstring)
        if self.dropped_keys:
            batch = {k: v for k, v in batch.items() if k not in self.dropped_keys}
            check_separated(flat, batch, self.padding_free)
        return to_tensors(batch, self.return_tensors)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        flat = flatten_rows(features, self.mask_keys)
        check_carried(features, self.leave_out)
        return self.collate_flat(flat)
