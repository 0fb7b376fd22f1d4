"""Row-wise operations on ragged arrays held as ``(offsets, values)`` NumPy pairs, vectorized (no Python loop
over tokens): building them from token lists, concatenating rows, cutting windows out of rows.

>>> a = from_lists([[1, 2], [3]])
>>> b = from_lists([[9], []])
>>> to_lists(join_rows([a, b]))
[[1, 2, 9], [3]]
>>> to_lists(window(a, starts=[1, 0], lengths=[1, 1]))
[[2], [3]]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


class Ragged(NamedTuple):
    """``values[offsets[i]:offsets[i + 1]]`` is row ``i``; ``offsets`` is int64 and starts at 0."""

    offsets: np.ndarray
    values: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0] - 1)


def offsets_of(lengths: Sequence[int] | np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """``[0, l_0, l_0 + l_1, ..., sum(lengths)]``: where each of runs of ``lengths`` laid end to end starts, then
    the end of the last (``len(lengths) + 1`` values of ``dtype``)."""
    out = np.zeros(len(lengths) + 1, dtype)
    np.cumsum(lengths, out=out[1:])
    return out


def from_lengths(lengths: np.ndarray, values: np.ndarray) -> Ragged:
    return Ragged(offsets_of(lengths), values)


def from_lists(rows: Sequence[Sequence[int]], dtype: type = np.int32) -> Ragged:
    """Token lists (what a tokenizer returns) to a ragged array, without building Arrow from Python lists."""
    lengths = np.fromiter(map(len, rows), np.int64, count=len(rows))
    total = int(lengths.sum())
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype, count=total)
    return from_lengths(lengths, values)


def full_like(r: Ragged, fill: int) -> Ragged:
    """Same row lengths as ``r``, every value ``fill``."""
    return Ragged(r.offsets, np.full(r.values.shape[0], fill, r.values.dtype))


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``np.concatenate(arange(s, s + l) for s, l in zip(starts, lengths))`` without a Python loop."""
    total = int(lengths.sum())
    first = offsets_of(lengths)[:-1]
    return np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)


def join_rows(parts: Sequence[Ragged]) -> Ragged:
    """Row ``i`` of the result is row ``i`` of every part, one after the other."""
    lengths = [p.lengths for p in parts]
    out_lengths = np.sum(lengths, axis=0) if parts else np.zeros(0, np.int64)
    out = from_lengths(out_lengths, np.empty(int(out_lengths.sum()), parts[0].values.dtype))
    dest_start = out.offsets[:-1].copy()
    for part, lens in zip(parts, lengths):
        out.values[_positions(dest_start, lens)] = part.values
        dest_start += lens
    return out


def append_to_rows(r: Ragged, value: int, where: np.ndarray | None = None) -> Ragged:
    """``value`` appended to every row (``where``: only to the rows where this boolean mask is true); the same
    as :func:`join_rows` with a one-value part, in one insertion instead of two scatters.

    >>> to_lists(append_to_rows(from_lists([[1, 2], [], [3]]), 9, np.array([True, True, False])))
    [[1, 2, 9], [9], [3]]
    """
    if where is None:
        ends, lengths = r.offsets[1:], r.lengths + 1
    else:
        ends, lengths = r.offsets[1:][where], r.lengths + where.astype(np.int64)
    values = r.values[r.offsets[0] : r.offsets[-1]]
    return from_lengths(lengths, np.insert(values, ends - r.offsets[0], np.asarray(value, values.dtype)))


def window(r: Ragged, starts: object, lengths: object) -> Ragged:
    """Row ``i`` becomes ``row[starts[i] : starts[i] + lengths[i]]`` (the window must lie inside the row)."""
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    return from_lengths(lengths, r.values[_positions(r.offsets[:-1] + starts, lengths)])


def select(r: Ragged, keep: np.ndarray) -> Ragged:
    """The rows where the boolean mask ``keep`` is true."""
    lengths = r.lengths[keep]
    return from_lengths(lengths, r.values[_positions(r.offsets[:-1][keep], lengths)])


def to_arrow(r: Ragged) -> pa.Array:
    import pyarrow as pa

    from .arrow import list_array

    return list_array(r.offsets, r.values, False, pa.from_numpy_dtype(r.values.dtype))


def stack_rows(parts: Sequence[Ragged]) -> Ragged:
    """The rows of every part, one part after the other (vertical stacking)."""
    lengths = np.concatenate([p.lengths for p in parts])
    values = np.concatenate([p.values[p.offsets[0] : p.offsets[-1]] for p in parts])
    return from_lengths(lengths, values)


def to_lists(r: Ragged) -> list[list[int]]:
    """For tests and doctests only."""
    return [r.values[r.offsets[i] : r.offsets[i + 1]].tolist() for i in range(r.num_rows)]
