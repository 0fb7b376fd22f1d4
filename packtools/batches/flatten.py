"""Rows laid end to end: the validation and flattening every padding-free collator starts from.

:func:`flatten_rows` checks a batch of rows (dicts of lists, NumPy arrays or CPU tensors) and lays them end to
end as one :class:`FlatRows`: tokens, labels (masks applied by :mod:`packtools.batches.labels`, sequence starts
not yet) and the segment structure.  ``PackedRows`` and ``PackedView`` build the same :class:`FlatRows` straight
from Arrow buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..constants import AUDIO_COLUMNS, MASK_COLUMNS, MEDIA_COLUMNS, SEQ_LENGTHS, TOKEN_COLUMNS, VIDEO_COLUMNS
from ..errors import PackingError
from .labels import masked_labels


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
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists: numpy cannot make one array of them
        raise PackingError(
            f"row {row}: {key!r} is not a flat list of integers (nested lists of different lengths, such as "
            f"[[1, 2], [3]]: {exc}). Pass one flat list per row: concatenate the pieces and give their lengths "
            f"as 'seq_lengths' (e.g. input_ids [1, 2, 3], seq_lengths [2, 1])."
        ) from None
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


def restart_positions(seg_lengths: np.ndarray) -> np.ndarray:
    """The ``position_ids`` of consecutive sequences of ``seg_lengths`` tokens, each from 0 (``[3, 1]``: 0 1 2 0)."""
    seg = np.asarray(seg_lengths, np.int64)
    return np.arange(int(seg.sum()), dtype=np.int64) - np.repeat(np.cumsum(seg) - seg, seg)


def _check_position_ids(row: Mapping[str, Any], i: int, seg: np.ndarray, n: int) -> None:
    """A row's own ``position_ids`` must say what ``seq_lengths`` say: the collator rebuilds them from
    ``seq_lengths`` (a row without them is one sequence), so any other value would be replaced unseen."""
    if row.get("position_ids") is None:
        return
    own = _int_array(row["position_ids"], i, "position_ids")
    rebuilt = restart_positions(seg)
    if own.shape[0] == n and np.array_equal(own, rebuilt):
        return
    said = (
        f"its 'seq_lengths' {seg.tolist()[:8]}"
        if row.get("seq_lengths") is not None
        else "one sequence (the row has no 'seq_lengths')"
    )
    if own.shape[0] != n:
        got = f"has {own.shape[0]} values for {n} tokens"
    else:
        bad = int(np.flatnonzero(own != rebuilt)[0])
        got = (
            f"restart at token(s) {np.flatnonzero(own == 0).tolist()[:8]} and read {int(own[bad])} at token "
            f"{bad} where {said} give(s) {int(rebuilt[bad])}"
        )
    raise PackingError(
        f"row {i}: its own 'position_ids' {got}; PaddingFreeCollator rebuilds position_ids from "
        f"'seq_lengths', so the row's would be replaced and its sequences merged or split without a word. Give "
        f"the row 'seq_lengths' that match its position_ids (the lengths between the 0s), or drop the "
        f"'position_ids' column (ds.remove_columns('position_ids'))."
    )


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
        _check_position_ids(row, i, seg, n)
        labels = None
        if row.get("labels") is not None:
            labels = _int_array(row["labels"], i, "labels")
            if labels.shape[0] != n:
                raise PackingError(
                    f"row {i}: 'labels' has {labels.shape[0]} values but 'input_ids' has {n}; "
                    f"labels must align token for token."
                )
        masks = (_mask_array(row[key], i, key, n) for key in mask_keys if row.get(key) is not None)
        labels = masked_labels(ids, labels, masks)
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


#: The row keys :class:`PaddingFreeCollator` reads (``position_ids`` is rebuilt from ``seq_lengths``, and a row's
#: own must agree with them); any other key is refused by name unless ``leave_out`` lists it: a column that does
#: not reach the model must not vanish without a word (a vision-language row's ``pixel_values`` dropped leaves
#: image tokens without an image).
CARRIED_KEYS = frozenset({*TOKEN_COLUMNS, SEQ_LENGTHS, "attention_mask", "position_ids"})


def check_leave_out(leave_out: object) -> frozenset[str]:
    if isinstance(leave_out, str) or not all(isinstance(k, str) for k in leave_out):  # type: ignore[union-attr]
        raise PackingError(f"leave_out must be a list of column names, got {leave_out!r}.", param="leave_out")
    return frozenset(leave_out)  # type: ignore[arg-type]


def image_columns_left_out(where: str, images: Sequence[str], who: str) -> str:
    """The refusal of media columns (images, videos or audio: :data:`~packtools.constants.MEDIA_COLUMNS`) that the
    text collator ``who`` would drop, ``leave_out`` or not."""
    if audio := [c for c in images if c in AUDIO_COLUMNS]:
        return (
            f"{where} has the audio column(s) {audio}, which {who} does not put in the batch: left out (even "
            f"with leave_out=), each clip's audio placeholder tokens would stay in input_ids and train with no "
            f"audio features. packtools packs no audio: remove the audio samples (their columns and placeholder "
            f"tokens) from the rows first, or train them unpacked."
        )
    if videos := [c for c in images if c in VIDEO_COLUMNS]:
        return (
            f"{where} has the video column(s) {videos}, which {who} does not put in the batch: left out (even "
            f"with leave_out=), each video's placeholder tokens would stay in input_ids and train without pixels. "
            f"packtools packs images only (video positions are not verified): remove the video samples (their "
            f"columns and placeholder tokens) from the rows first, or train them unpacked."
        )
    return (
        f"{where} has the image column(s) {list(images)}, which {who} does not put in the batch: left out (even "
        f"with leave_out=), each image's placeholder tokens would stay in input_ids and train without pixels. "
        f"Batch vision-language rows with packtools.batches.MultimodalCollator(model, pad_token_id) "
        f"(docs/vision.md), or, to train the text alone, remove {list(images)} and their placeholder tokens from "
        f"the rows first."
    )


def check_carried(
    features: Sequence[Mapping[str, Any]],
    leave_out: frozenset[str],
    carried: frozenset[str] = CARRIED_KEYS,
    who: str = "PaddingFreeCollator",
) -> None:
    """Refuse, by name, a column of the rows that the batch would not carry and ``leave_out`` does not list.
    An image, video or audio column (:data:`~packtools.constants.MEDIA_COLUMNS`) the batch would not carry is refused
    even when ``leave_out`` lists it: left out, its placeholder tokens would train without their pixels or audio.

    ``carried`` is the set of keys the collator ``who`` reads (``CARRIED_KEYS`` for the text collator).
    """
    known = carried | (leave_out - frozenset(MEDIA_COLUMNS))
    for i, row in enumerate(features):
        if isinstance(row, Mapping) and not known.issuperset(row.keys()):
            extra = sorted(k for k in row.keys() if k not in known)
            if images := [k for k in extra if k in MEDIA_COLUMNS]:
                raise PackingError(image_columns_left_out(f"row {i}", images, who), param="leave_out")
            raise PackingError(
                f"row {i} has the column(s) {extra}, which {who} does not put in the batch, so the "
                f"model would never see them (a vision-language model given image tokens without its "
                f"pixel_values / image_grid_thw trains on placeholders). Remove them from the dataset "
                f"(ds.remove_columns({extra!r})), or say they may be left out: "
                f"{who}(..., leave_out={extra!r}).",
                param="leave_out",
            )
