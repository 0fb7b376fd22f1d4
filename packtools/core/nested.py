"""Per-sample columns that travel whole with their sample: the images of a vision-language row.

A token column (``input_ids``, ``labels``) is cut and copied token by token (:mod:`packtools.core.pack`).  A
per-sample column such as ``pixel_values`` (a list of patches per sample) or ``image_grid_thw`` (a list of
``(t, h, w)`` per sample) has no tokens: a packed row gets the concatenation of its samples' lists, in the
order the samples sit in the row.  That is only meaningful when every sample is placed whole, which
:func:`gather_whole_samples` checks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from .arrow import is_list_type
from .plan import PackPlan
from .plan import plan as make_plan


def check_whole_samples(p: PackPlan, what: str, *, complete: bool = True) -> None:
    """Refuse a plan that cuts a sample (``bfd`` truncation, ``bfd_split`` chunks, ``wrapped`` cuts) or, with
    ``complete`` (a whole plan, not a slice of its rows), leaves one out."""
    cut = (p.seg_start != 0) | (p.seg_length != p.source_lengths[p.seg_source])
    if cut.any():
        s = int(np.flatnonzero(cut)[0])
        raise PackingError(
            f"the plan cuts sample {int(p.seg_source[s])} ({int(p.source_lengths[p.seg_source[s]])} tokens, max_length "
            f"{p.max_length}): {what} must be placed whole. Raise max_length above the longest sample or drop the "
            f"samples that are longer."
        )
    if not complete:
        return
    kept = np.zeros(p.source_lengths.shape[0], bool)
    kept[p.seg_source] = True
    lost = np.flatnonzero(~kept & (p.source_lengths > 0))
    if lost.size:
        raise PackingError(f"the plan leaves out sample {int(lost[0])}; {what} must all be placed.")


def plan_whole_samples(
    lengths: np.ndarray, max_length: int, *, shuffle: bool, seed: int, where: Callable[[int], str]
) -> PackPlan:
    """The ``bfd`` plan of samples with images, every one placed whole (rows shuffled with ``seed`` when
    ``shuffle``).  A sample over ``max_length`` is refused, never truncated (an image would be cut);
    ``where(i)`` names sample ``i`` in the message (its index, or its file and line)."""
    over = np.flatnonzero(lengths > max_length)
    if over.size:
        i = int(over[0])
        raise PackingError(
            f"{where(i)} has {int(lengths[i])} tokens (image tokens included) > max_length={max_length} "
            f"({over.size} sample(s) in all, longest {int(lengths.max())}): multimodal samples are never "
            f"truncated (an image would be cut). Raise max_length (packtools.profile_lengths shows the lengths), "
            f"or drop those samples.",
            param="max_length",
        )
    p = make_plan(lengths, max_length, "bfd")
    if shuffle:
        p = p.shuffled(seed)
    check_whole_samples(p, "samples with images")
    return p


def _take(column: pa.ChunkedArray | pa.Array, rows: np.ndarray) -> pa.Array:
    """``column.take(rows)`` chunk by chunk: pyarrow's take on a chunked nested column first concatenates every
    chunk (a copy of the whole column, e.g. all pixels of a dataset); this copies only the rows taken."""
    if isinstance(column, pa.Array):
        return column.take(pa.array(rows, pa.int64()))
    if column.num_chunks == 0:
        return pa.array([], column.type)
    starts = np.concatenate([[0], np.cumsum([len(c) for c in column.chunks])])
    chunk_of = np.searchsorted(starts[1:], rows, side="right")
    order = np.argsort(chunk_of, kind="stable")
    pieces = []
    for c in np.unique(chunk_of).tolist():
        local = rows[chunk_of == c] - starts[c]
        pieces.append(column.chunk(c).take(pa.array(local, pa.int64())))
    grouped = pa.concat_arrays(pieces) if pieces else pa.array([], column.type)
    if np.array_equal(order, np.arange(order.shape[0])):
        return grouped
    return grouped.take(pa.array(np.argsort(order), pa.int64()))  # the inverse permutation


def gather_whole_samples(
    column: pa.ChunkedArray | pa.Array, p: PackPlan, row_indices: np.ndarray | None = None
) -> pa.Array:
    """The list column ``column`` (one list per sample) regrouped per packed row of ``p``, in row order.

    ``row_indices`` maps the plan's samples to rows of ``column`` (a dataset's select/shuffle mapping).  A
    null entry counts as an empty list.  Memory: one copy of the gathered values (``pyarrow`` ``take``).

    >>> from packtools.core.plan import plan
    >>> p = plan([3, 1, 2], max_length=4)
    >>> gather_whole_samples(pa.array([[[1, 2]], None, [[3, 4], [5, 6]]]), p).to_pylist()
    [[[1, 2]], [[3, 4], [5, 6]]]
    """
    if not is_list_type(column.type):
        raise PackingError(f"a per-sample column must be a list column, got {column.type}.")
    check_whole_samples(p, "samples with images", complete=False)
    source = p.seg_source if row_indices is None else np.asarray(row_indices, np.int64)[p.seg_source]
    taken = _take(column, source)
    counts = np.asarray(taken.value_lengths().fill_null(0), np.int64)
    values = taken.flatten()
    per_seg = np.concatenate([[0], np.cumsum(counts)])
    offsets = per_seg[p.row_offsets]
    large = pa.types.is_large_list(column.type) or offsets[-1] >= 2**31
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets, pa.int64() if large else pa.int32()), values)
