"""Padding-free batches from packed rows: the collator that feeds FlashAttention varlen training.

A batch of rows (each a packed row with ``seq_lengths``, or one plain sequence) becomes one flat sequence of
``T`` tokens with the segment boundaries a varlen attention kernel needs.  The contract (see the project's
MISSION): ``cu_seq_lens`` int32, starting at 0, strictly increasing, ending at ``T``; ``position_ids``
restarting at 0 in every segment; ``labels`` -100 at every segment start and on all padding; no
``attention_mask`` with packed input; padding for ``pad_to_multiple_of`` forming **one** extra segment.

Everything is built with NumPy on flat arrays (:func:`assemble_padding_free`, :func:`assemble_padded`), so
the Arrow-native path in :mod:`packtools.batches.loader` reuses it; torch is imported only to wrap the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._optional import require
from ..constants import IGNORE_INDEX, MASK_COLUMNS
from ..errors import PackingError
from .buckets import bucket_for, check_buckets, pad_cu_seq_lens


@dataclass(frozen=True)
class FlatRows:
    """Rows laid end to end: tokens, labels (masks applied, starts not yet) and segment structure."""

    input_ids: np.ndarray  # int64 [N]
    labels: np.ndarray  # int64 [N]
    row_lengths: np.ndarray  # int64 [B], every entry > 0
    seg_lengths: np.ndarray  # int64 [S], every entry > 0, sums per row to row_lengths
    segs_per_row: np.ndarray  # int64 [B]
    unmarked_row: int | None = None  # first input row without ``seq_lengths`` (None: every row has it)


def _int_array(value: Any, row: int, key: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise PackingError(
            f"row {row}: {key!r} must be a flat list of integers, got shape {arr.shape}; "
            f"pass one list per row (e.g. ds.with_format(None) rows)."
        )
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, np.int64)
        raise PackingError(
            f"row {row}: {key!r} holds {arr.dtype} values; it must hold integers. Cast it to int before collating."
        )
    return arr.astype(np.int64, copy=False)


def _mask_array(value: Any, row: int, key: str, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise PackingError(
            f"row {row}: {key!r} has shape {arr.shape} but 'input_ids' has {n} tokens; the mask must give "
            f"one 0/1 value per token."
        )
    if arr.dtype.kind not in "iub" and arr.size:
        raise PackingError(f"row {row}: {key!r} holds {arr.dtype} values; use 0/1 integers or booleans.")
    return arr


def _check_attention_mask(row: Mapping[str, Any], i: int, packed: bool) -> None:
    mask = row.get("attention_mask")
    if mask is None:
        return
    if not np.all(np.asarray(mask) != 0):
        raise PackingError(
            f"row {i}: 'attention_mask' has 0s, so the row holds padding; padding-free batches cannot drop it "
            f"for you. Strip the padding from the rows (tokenize without padding=...); dropping the column "
            f"alone would keep the pad tokens as data."
        )
    if packed:
        raise PackingError(
            f"row {i} has an 'attention_mask' beside 'seq_lengths': a packed row's mask cannot mark where its "
            f"sequences end, and a model given one attends across them. Drop the column "
            f"(ds.remove_columns('attention_mask')); PaddingFreeCollator separates sequences by itself."
        )


def _row_segments(row: Mapping[str, Any], i: int, n: int) -> np.ndarray:
    if "seq_lengths" not in row or row["seq_lengths"] is None:
        return np.array([n], np.int64) if n else np.zeros(0, np.int64)
    seg = _int_array(row["seq_lengths"], i, "seq_lengths")
    if seg.size and seg.min() <= 0:
        j = int(np.argmin(seg))
        raise PackingError(
            f"row {i}: 'seq_lengths'[{j}] = {seg[j]}; every packed sequence must have >= 1 token. "
            f"Drop the empty entries (packtools.pack_* never writes them)."
        )
    if int(seg.sum()) != n:
        raise PackingError(
            f"row {i}: 'seq_lengths' sum to {int(seg.sum())} but 'input_ids' has {n} tokens; they must match. "
            f"Re-pack the rows, or drop 'seq_lengths' to treat each row as one sequence."
        )
    return seg


def flatten_rows(features: Sequence[Mapping[str, Any]], mask_keys: Sequence[str] = MASK_COLUMNS) -> FlatRows:
    """Validate rows and lay them end to end (empty rows are skipped).

    ``mask_keys`` are the 0/1 columns applied to labels when a row has no ``labels`` (pass ``()`` to learn
    every token).  An ``attention_mask`` is refused beside ``seq_lengths`` and when it holds 0s.

    >>> f = flatten_rows([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}, {"input_ids": [8, 9]}])
    >>> f.input_ids.tolist(), f.seg_lengths.tolist(), f.row_lengths.tolist()
    ([5, 6, 7, 8, 9], [2, 1, 2], [3, 2])
    """
    if isinstance(features, Mapping) or not isinstance(features, Sequence) or len(features) == 0:
        raise PackingError(
            f"features must be a non-empty list of rows (dicts with 'input_ids'), got {type(features).__name__}."
        )
    ids_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray | None] = []
    seg_parts: list[np.ndarray] = []
    row_lengths: list[int] = []
    own_labels = False
    unmarked: int | None = None
    for i, row in enumerate(features):
        if not isinstance(row, Mapping) or "input_ids" not in row:
            got = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise PackingError(f"row {i} has no 'input_ids' (got {got}); every row needs its token ids.")
        ids = _int_array(row["input_ids"], i, "input_ids")
        n = ids.shape[0]
        marked = row.get("seq_lengths") is not None
        _check_attention_mask(row, i, marked)
        if not marked and unmarked is None and n:
            unmarked = i
        seg = _row_segments(row, i, n)
        labels = None
        if row.get("labels") is not None:
            labels = _int_array(row["labels"], i, "labels")
            if labels.shape[0] != n:
                raise PackingError(
                    f"row {i}: 'labels' has {labels.shape[0]} values but 'input_ids' has {n}; "
                    f"labels must align token for token."
                )
        else:
            for key in mask_keys:
                if row.get(key) is not None:
                    mask = _mask_array(row[key], i, key, n)
                    if labels is None:
                        labels = ids.copy()
                    labels[mask == 0] = IGNORE_INDEX
        if n == 0:
            continue
        own_labels = own_labels or labels is not None
        ids_parts.append(ids)
        label_parts.append(labels)
        seg_parts.append(seg)
        row_lengths.append(n)
    if not ids_parts:
        raise PackingError("every row in the batch is empty; a batch needs at least one token.")
    input_ids = np.concatenate(ids_parts) if len(ids_parts) > 1 else ids_parts[0].copy()
    if own_labels:
        labels = np.concatenate([ids if lab is None else lab for ids, lab in zip(ids_parts, label_parts)])
    else:
        labels = input_ids.copy()
    return FlatRows(
        input_ids,
        labels,
        np.asarray(row_lengths, np.int64),
        np.concatenate(seg_parts),
        np.asarray([s.shape[0] for s in seg_parts], np.int64),
        unmarked,
    )


def _positions(seg_lengths: np.ndarray, total: int) -> np.ndarray:
    starts = np.zeros(seg_lengths.shape[0], np.int64)
    np.cumsum(seg_lengths[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, seg_lengths)


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
    cu = np.zeros(seg.shape[0] + 1, np.int32)
    np.cumsum(seg, out=cu[1:])
    if padded > total:
        input_ids = np.full(padded, pad_token_id, np.int64)
        input_ids[:total] = flat.input_ids
        labels = np.full(padded, IGNORE_INDEX, np.int64)
        labels[:total] = flat.labels
    else:
        input_ids = flat.input_ids
        labels = flat.labels.copy() if flat.labels is flat.input_ids else flat.labels
    labels[cu[:-1]] = IGNORE_INDEX
    max_len = int(seg.max())
    return {
        "input_ids": input_ids[None],
        "labels": labels[None],
        "position_ids": _positions(seg, padded)[None],
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

    ``attention_mask`` is returned only when no row holds more than one sequence: with packed rows, leaving
    it out is what makes transformers build a block-diagonal mask from ``position_ids``.

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
    positions = _positions(seg, b * width).reshape(b, width)
    valid = np.arange(width)[None, :] < flat.row_lengths[:, None]
    input_ids = np.full((b, width), pad_token_id, np.int64)
    input_ids[valid] = flat.input_ids
    labels = np.full((b, width), IGNORE_INDEX, np.int64)
    labels[valid] = flat.labels
    labels[positions == 0] = IGNORE_INDEX
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


#: The keys each ``return_*`` switch of :class:`PaddingFreeCollator` controls (padding-free output).
SWITCHED_KEYS = {
    "return_position_ids": ("position_ids",),
    "return_flash_attn_kwargs": ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
    "return_seq_idx": ("seq_idx",),
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
    the ones the model's ``forward`` does not take).

    Padded output (``padding_free=False``): ``[B, T]`` right-padded ``input_ids``, ``labels``,
    ``position_ids`` (restarting per packed sequence), and ``attention_mask`` only if no row is packed.

    Static shapes, for ``torch.compile(dynamic=False)`` and CUDA graphs (padding-free only): with
    ``pad_to_buckets`` (sizes, e.g. ``TokenBudgetBatchSampler(..., buckets=K).buckets``) ``T`` is rounded up to
    the smallest size that holds it (one padding segment) and ``max_length_q/k`` is that size; with
    ``pad_cu_seq_lens_to=N`` ``cu_seq_lens`` has exactly ``N`` entries (its last value repeated).  See
    :func:`assemble_static`.

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
        completion_only_loss: bool = True,
        assistant_only_loss: bool = True,
        pad_to_buckets: Sequence[int] | None = None,
        pad_cu_seq_lens_to: int | None = None,
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
        self.completion_only_loss = bool(completion_only_loss)
        self.assistant_only_loss = bool(assistant_only_loss)
        self.mask_keys = tuple(
            key for key, on in zip(MASK_COLUMNS, (self.completion_only_loss, self.assistant_only_loss)) if on
        )
        self.dropped_keys = frozenset(
            key for switch, keys in SWITCHED_KEYS.items() if not getattr(self, switch) for key in keys
        )
        self.pad_to_buckets, self.pad_cu_seq_lens_to = check_static_args(
            pad_to_buckets, pad_cu_seq_lens_to, self.pad_to_multiple_of, self.padding_free
        )

    def options(self) -> dict[str, Any]:
        """The constructor arguments of this collator (``PaddingFreeCollator(**c.options())`` copies it)."""
        names = (
            "pad_token_id",
            "pad_to_multiple_of",
            "padding_free",
            "return_tensors",
            "unpacked",
            *SWITCHED_KEYS,
            "completion_only_loss",
            "assistant_only_loss",
            "pad_to_buckets",
            "pad_cu_seq_lens_to",
        )
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
            if self.dropped_keys:
                batch = {k: v for k, v in batch.items() if k not in self.dropped_keys}
            return to_tensors(batch, self.return_tensors)
        build = assemble_padding_free if self.padding_free else assemble_padded
        batch = build(flat, self.pad_token_id, self.pad_to_multiple_of)
        if self.dropped_keys:
            batch = {k: v for k, v in batch.items() if k not in self.dropped_keys}
        return to_tensors(batch, self.return_tensors)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return self.collate_flat(flatten_rows(features, self.mask_keys))
