"""Where a collator put the rows it was given: the layout check shared by the isolation probe and the collator check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def locate_rows(input_ids: Any, rows: Sequence[np.ndarray]) -> list[tuple[int, int]] | None:
    """Where each of ``rows`` (token arrays, in order) sits in a collated ``[B, T]`` ``input_ids``.

    Returns ``(batch_row, offset)`` per row: laid end to end in one flat row (``B == 1``), or one row each,
    right- or left-padded (``B == len(rows)``); ``None`` when the batch holds the rows neither way (merged,
    reordered, truncated or changed tokens).

    >>> locate_rows(np.array([[5, 6, 7, 8, 0]]), [np.array([5, 6]), np.array([7, 8])])
    [(0, 0), (0, 2)]
    >>> locate_rows(np.array([[5, 6, 0], [0, 7, 8]]), [np.array([5, 6]), np.array([7, 8])])
    [(0, 0), (1, 1)]
    >>> locate_rows(np.array([[5, 6, 7, 9]]), [np.array([5, 6]), np.array([7, 8])]) is None
    True
    """
    ids = np.asarray(input_ids.detach().cpu() if hasattr(input_ids, "detach") else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        return None
    width = ids.shape[1]
    lengths = [len(r) for r in rows]
    if ids.shape[0] == 1 and sum(lengths) <= width:
        flat = np.concatenate([np.asarray(r, np.int64) for r in rows]) if rows else np.zeros(0, np.int64)
        if np.array_equal(ids[0, : flat.shape[0]], flat):
            return [(0, int(o)) for o in np.cumsum([0, *lengths[:-1]])]
    if ids.shape[0] != len(rows) or max(lengths, default=0) > width:
        return None
    out = []
    for b, (row, n) in enumerate(zip(rows, lengths)):
        row = np.asarray(row, np.int64)
        if np.array_equal(ids[b, :n], row):
            out.append((b, 0))
        elif np.array_equal(ids[b, width - n :], row):
            out.append((b, width - n))
        else:
            return None
    return out


def sequence_spans(
    where: Sequence[tuple[int, int]], seq_lengths: Sequence[Sequence[int]]
) -> list[tuple[int, int, int]]:
    """``(batch_row, start, stop)`` of every sequence, from each row's place (:func:`locate_rows`) and lengths.

    >>> sequence_spans([(0, 0), (0, 5)], [[2, 3], [4]])
    [(0, 0, 2), (0, 2, 5), (0, 5, 9)]
    """
    spans = []
    for (b, offset), lengths in zip(where, seq_lengths):
        start = offset
        for n in lengths:
            spans.append((b, start, start + n))
            start += n
    return spans
