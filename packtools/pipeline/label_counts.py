"""What the labels of staged rows say, per row: where the first label token is, and how many tokens train.

>>> import pyarrow as pa
>>> labels = pa.chunked_array([pa.array([[-100, 5, 6], [-100, -100], [7, -100, 8]])])
>>> first_label(labels).tolist(), trained_per_row(labels).tolist()
([1, 2, 0], [2, 0, 1])
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..constants import IGNORE_INDEX
from ..core.arrow import read_list_column


def first_label(labels: pa.ChunkedArray) -> np.ndarray:
    """Per row, the position of the first token with a label (not -100); the row length if there is none."""
    parts = []
    for chunk in read_list_column(labels, "labels").chunks:
        starts, ends = chunk.offsets[:-1], chunk.offsets[1:]
        first = ends - starts
        idx = np.flatnonzero(chunk.values[: chunk.offsets[-1]] != IGNORE_INDEX)  # sorted
        lo = np.searchsorted(idx, starts)  # the row's first labelled token, if it has one, is idx[lo]
        has = lo < np.searchsorted(idx, ends)
        first[has] = idx[lo[has]] - starts[has]
        parts.append(first)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def trained_per_row(labels: pa.ChunkedArray) -> np.ndarray:
    """Per row, its tokens that train: labels other than -100 after the row's first token (a padding-free batch
    masks every sequence's first label)."""
    parts = []
    for chunk in read_list_column(labels, "labels").chunks:
        values = chunk.values[: chunk.offsets[-1]] != IGNORE_INDEX
        starts, ends = chunk.offsets[:-1], chunk.offsets[1:]
        csum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        has = ends > starts
        first = np.zeros(starts.shape[0], np.int64)
        first[has] = values[starts[has]]
        parts.append(csum[ends] - csum[starts] - first)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
