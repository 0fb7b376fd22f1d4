"""The one door between Arrow list columns and plain ``(offsets, values)`` NumPy arrays.

A list column may be chunked, sliced (non-zero array offset) and ``list`` or ``large_list``.  For each chunk
we hand out ``offsets`` (``len + 1`` int64 values, positions in ``values``) and ``values`` (a zero-copy
NumPy view of the child array), so kernels never see an Arrow object and no token is converted to Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._lazy import lazy_module
from ..errors import PackingError

if TYPE_CHECKING:
    from . import kernels
else:  # Numba is imported when a kernel first runs
    kernels = lazy_module("packtools.core.kernels")

INT32_MAX = 2**31 - 1


def is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


@dataclass(frozen=True)
class ListChunk:
    """One chunk of a list column: rows ``row_start .. row_start + len(offsets) - 2``."""

    row_start: int
    offsets: np.ndarray  # int64, len(rows) + 1, indexes into `values`
    values: np.ndarray  # 1-D primitive NumPy view


@dataclass(frozen=True)
class ListColumn:
    """A list column split into chunks of plain arrays."""

    name: str
    type: pa.DataType
    chunks: tuple[ListChunk, ...]
    num_rows: int

    @property
    def value_dtype(self) -> np.dtype:
        return self.type.value_type.to_pandas_dtype() if self.chunks == () else self.chunks[0].values.dtype

    def lengths(self) -> np.ndarray:
        if not self.chunks:
            return np.zeros(0, np.int64)
        return np.concatenate([np.diff(c.offsets) for c in self.chunks])

    def flat_values(self) -> np.ndarray:
        """All rows' values, one after the other (a copy when there are several chunks)."""
        parts = [c.values[c.offsets[0] : c.offsets[-1]] for c in self.chunks]
        if not parts:
            return np.zeros(0, self.value_dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunk_row_starts(self) -> np.ndarray:
        return np.array([c.row_start for c in self.chunks] + [self.num_rows], np.int64)

    def row_sums(self, dtype: type = np.int64, *, squared: bool = False) -> np.ndarray:
        """The sum of each row's values (of their squares with ``squared=True``), one running sum per chunk.

        >>> col = read_list_column(pa.array([[2, 1], [], [3]]), "seq_lengths")
        >>> col.row_sums().tolist(), col.row_sums(np.float64, squared=True).tolist()
        ([3, 0, 3], [5.0, 0.0, 9.0])
        """
        parts = []
        for c in self.chunks:
            values = c.values.astype(dtype)
            csum = np.concatenate((np.zeros(1, dtype), np.cumsum(values * values if squared else values)))
            parts.append(csum[c.offsets[1:]] - csum[c.offsets[:-1]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


def numpy_values(arr: pa.Array) -> np.ndarray:
    """A null-free integer or float array's values: a read-only NumPy view of its data buffer, no copy.

    What ``arr.to_numpy(zero_copy_only=True)`` gives, without pyarrow's NumPy conversion (it imports pandas).
    """
    dtype = np.dtype(arr.type.to_pandas_dtype())
    data = arr.buffers()[1]
    if data is None or len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _first_null_row(arr: pa.Array) -> int:
    return int(np.flatnonzero(np.asarray(arr.is_null()))[0])


def as_table(table: Any) -> pa.Table:
    """A ``pyarrow.Table``; a ``datasets.Dataset`` as its rows' Arrow table (selection and order kept, through
    its public ``with_format('arrow')``); anything else refused with what to pass."""
    if isinstance(table, pa.Table):
        return table
    if hasattr(table, "with_format") and hasattr(table, "column_names"):
        got = table.with_format("arrow")[:]
        if isinstance(got, pa.Table):
            return got
    raise PackingError(
        f"unpack takes a pyarrow.Table or a datasets.Dataset of packed rows, got {type(table).__name__}.",
        param="table",
    )


def _at_row(name: str, row: int, at: Callable[[int], str] | None) -> str:
    """``column 'x' row 6``, or with ``at`` (a reader's row namer, e.g. ``io.files.Where``) ``input 'f.jsonl'
    line 7: column 'x'``: the file's own line or row, not the row's index in one block of it."""
    return f"column {name!r} row {row}" if at is None else f"{at(row)}: column {name!r}"


def read_list_column(
    column: pa.ChunkedArray | pa.Array, name: str, at: Callable[[int], str] | None = None
) -> ListColumn:
    """Split a list column into chunks of ``(offsets, values)``, checking nulls and value types; ``at`` names a
    bad row in the error (default: its index in ``column``)."""
    if isinstance(column, pa.Array):
        column = pa.chunked_array([column], type=column.type)
    t = column.type
    if not is_list_type(t):
        raise PackingError(
            f"column {name!r} has type {t}, not a list; only list columns can be packed. "
            f"Pass columns=[...] naming the token columns, or remove {name!r} first."
        )
    vt = t.value_type
    if pa.types.is_float16(vt):
        raise PackingError(
            f"column {name!r} holds lists of float16, which the packing kernels do not handle; cast it to "
            f"float32 (or leave it out with columns=[...])."
        )
    if is_list_type(vt) or pa.types.is_struct(vt):
        raise PackingError(
            f"column {name!r} holds lists of {vt}, not one value per token, so it cannot be packed with the tokens "
            f"(per-sample features such as audio features do not split per token). Packing without it means the "
            f"model never sees it: remove it, or leave it out knowingly with columns=[...] naming the token "
            f"columns. (Image columns, pixel_values / image_grid_thw, are never left out: their placeholder "
            f"tokens would stay; pack such rows with packtools.pack_dataset, docs/vision.md.)"
        )
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)):
        raise PackingError(
            f"column {name!r} holds lists of {vt}; packtools packs lists of integers or floats. "
            f"Cast it (e.g. to list<int32>) or leave it out with columns=[...]."
        )
    chunks = []
    row = 0
    for chunk in column.chunks:
        n = len(chunk)
        if chunk.null_count:
            bad = row + _first_null_row(chunk)
            raise PackingError(
                f"{_at_row(name, bad, at)} is null; packing needs a list in every row. "
                f"Fill it (e.g. with an empty list) or filter the row out."
            )
        offsets = numpy_values(chunk.offsets).astype(np.int64, copy=False)
        child = chunk.values
        lo, hi = (int(offsets[0]), int(offsets[-1])) if n else (0, 0)
        window = child.slice(lo, hi - lo)
        if window.null_count:
            inner = lo + _first_null_row(window)
            bad = row + int(np.searchsorted(offsets, inner, side="right")) - 1
            raise PackingError(
                f"{_at_row(name, bad, at)} contains a null value; packed token columns cannot hold nulls. "
                f"Replace the nulls (e.g. with the pad id) or drop the row."
            )
        values = numpy_values(window)
        chunks.append(ListChunk(row, offsets - lo, values))
        row += n
    return ListColumn(name, t, tuple(chunks), row)


def check_aligned(columns: list[ListColumn], at: Callable[[int], str] | None = None) -> np.ndarray:
    """Return the shared row lengths, or explain the first row where columns disagree (named by ``at``, as in
    :func:`read_list_column`)."""
    lengths = columns[0].lengths()
    for col in columns[1:]:
        other = col.lengths()
        if not np.array_equal(lengths, other):
            row = int(np.flatnonzero(lengths != other)[0])
            where = f"row {row}" if at is None else at(row)
            raise PackingError(
                f"columns {columns[0].name!r} and {col.name!r} differ in length at {where} "
                f"({lengths[row]} vs {other[row]} values); packed columns must be aligned token for token. "
                f"Fix the data or pack them separately with columns=[...]."
            )
    return lengths


def check_columns(table: pa.Table, needed: Sequence[str], what: str, fix: str = "") -> None:
    """Refuse a table without every column of ``needed``: ``<what> need the columns [...]; [...] missing (the
    table has [...]).`` and the ``fix``, as an error about the ``dataset`` argument."""
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise PackingError(
            f"{what} need the columns {list(needed)}; {missing} missing (the table has {table.column_names})."
            + (f" {fix}" if fix else ""),
            param="dataset",
        )


def check_row_counts(
    got: np.ndarray,
    want: np.ndarray,
    got_says: str,
    want_says: str,
    fix: str,
    *,
    param: str | None = None,
    fields: dict[str, str] | None = None,
) -> None:
    """Refuse the first row where two per-row counts disagree: ``row r: <got_says> but <want_says>; <fix>``,
    the ``{}`` of each side filled with its count at that row (``{row}`` with ``r``, ``{name}`` with
    ``fields["name"]``: a column name goes in ``fields``, whose values are not read as templates).

    >>> check_row_counts(np.array([3, 2]), np.array([3, 4]), "'seq_lengths' sum to {}", "'input_ids' has {} "
    ...                  "tokens", "re-pack the data.")
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: row 1: 'seq_lengths' sum to 2 but 'input_ids' has 4 tokens; re-pack the data.
    """
    bad = np.flatnonzero(got != want)
    if bad.size:
        r = int(bad[0])
        extra = fields or {}
        said = got_says.format(int(got[r]), row=r, **extra), want_says.format(int(want[r]), row=r, **extra)
        raise PackingError(f"row {r}: {said[0]} but {said[1]}; {fix}", param=param)


def copy_segments(
    col: ListColumn,
    source: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    dest: np.ndarray,
    out: np.ndarray,
    *,
    by_source: bool = False,
    release: Callable[[np.ndarray], object] | None = None,
) -> None:
    """Copy segments ``(source row, start, length)`` of ``col`` to ``out[dest:dest + length]``, chunk by chunk.

    ``by_source``: the segments are already sorted by source row (else they are sorted here, so each chunk is
    read front to back).  ``release`` is called on each chunk's values once they have been copied from.
    """
    if not by_source:
        order = np.argsort(source, kind="stable")
        source, start, length, dest = source[order], start[order], length[order], dest[order]
    chunk_of = np.searchsorted(col.chunk_row_starts()[1:], source, side="right")
    bounds = np.searchsorted(chunk_of, np.arange(len(col.chunks) + 1))
    for chunk, a, b in zip(col.chunks, bounds[:-1], bounds[1:]):
        if a == b:
            continue
        src = np.ascontiguousarray(chunk.offsets[source[a:b] - chunk.row_start] + start[a:b])
        kernels.copy_all_segments(
            chunk.values, src, np.ascontiguousarray(length[a:b]), np.ascontiguousarray(dest[a:b]), out
        )
        if release is not None:
            release(chunk.values)


def ones_at(total: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """An int8 array of ``total`` zeros with 1 on the ``lengths[i]`` values from ``starts[i]`` (a mask of spans)."""
    mask = np.zeros(total, np.int8)
    if lengths.size and lengths.max() > 0:
        ones = np.ones(int(lengths.max()), np.int8)
        starts, lengths = np.ascontiguousarray(starts), np.ascontiguousarray(lengths)
        kernels.copy_all_segments(ones, np.zeros_like(lengths), lengths, starts, mask)
    return mask


def numeric_array(values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A 1-D NumPy array as an Arrow array of ``value_type``: its buffer as it is when the dtypes match (no copy;
    unlike ``pa.array(ndarray)``, this does not import pandas), else converted."""
    if (
        values.ndim == 1
        and values.flags.c_contiguous
        and values.dtype.isnative
        and pa.from_numpy_dtype(values.dtype) == value_type
    ):
        return pa.Array.from_buffers(value_type, values.shape[0], [None, pa.py_buffer(values)])
    return pa.array(values, type=value_type)


def list_array(offsets: np.ndarray, values: np.ndarray, large: bool, value_type: pa.DataType) -> pa.Array:
    """Build a ``list``/``large_list`` array from offsets and values without copying the values."""
    vals = numeric_array(values, value_type)
    if large or int(offsets[-1]) > INT32_MAX:
        return pa.LargeListArray.from_arrays(
            numeric_array(offsets.astype(np.int64, copy=False), pa.int64()), vals
        )
    return pa.ListArray.from_arrays(numeric_array(offsets.astype(np.int32), pa.int32()), vals)


def column_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row lengths of a list column read from its offsets only (no token is touched)."""
    if isinstance(column, pa.Array):
        column = pa.chunked_array([column], type=column.type)
    if not is_list_type(column.type):
        raise PackingError(f"expected a list column, got type {column.type}.")
    parts = [np.diff(numpy_values(c.offsets).astype(np.int64, copy=False)) for c in column.chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
