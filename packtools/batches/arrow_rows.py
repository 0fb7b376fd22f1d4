"""Batches copied straight from Arrow buffers: what both Arrow-backed datasets of the collators share.

:class:`ArrowSource` holds a table's list columns as zero-copy NumPy views of the buffers behind them and copies
a batch out of them, end to end: :meth:`ArrowSource.column` copies *segments* (parts of table rows, as a
:class:`~packtools.PackPlan` places them) with the :func:`~packtools.core.kernels.view_segments` /
``gather_scattered`` kernels; :meth:`ArrowSource.whole_rows` copies whole rows with one NumPy concatenate.
:class:`~packtools.batches.PackedView` (rows packed on the fly by a plan) uses the first,
:class:`~packtools.batches.PackedRows` (rows already packed, their sequences in a ``seq_lengths`` column) the
second.  :class:`ArrowBatches` is what the two have in common as datasets: ``gather`` (the batch as
``FlatRows``, labels from :mod:`packtools.batches.labels`) and ``iter_batches``.  Why there are two datasets:
``docs/batches.md``.

>>> from packtools.core.arrow import read_list_column
>>> table = pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]})
>>> source = ArrowSource(table, [read_list_column(table.column("input_ids"), "input_ids")])
>>> source.whole_rows("input_ids", np.array([2, 0]), 4).tolist()
[6, 1, 2, 3]
>>> segments = (np.array([0, 2]), np.array([1, 0]), np.array([0, 1]), np.array([2, 2]))  # one row: 4, 5 | 2, 3
>>> out, lengths = source.column("input_ids", np.array([0]), 4, segments)
>>> out.tolist(), lengths.tolist()
([4, 5, 2, 3], [2, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._lazy import lazy_module
from ..constants import MASK_COLUMNS
from ..core.arrow import ListColumn
from ..errors import PackingError
from .flatten import FlatRows
from .labels import labels_of

if TYPE_CHECKING:
    from ..core import kernels
else:  # Numba is imported when a kernel first runs
    kernels = lazy_module("packtools.core.kernels")

if TYPE_CHECKING:
    from .collate import PaddingFreeCollator

__all__ = ["ArrowBatches", "ArrowSource", "Segments", "check_integer", "checked_rows"]

#: ``(row_offsets, seg_source, seg_start, seg_length)``: row ``r`` is segments ``row_offsets[r]:row_offsets[r+1]``,
#: segment ``s`` is ``seg_length[s]`` values of source row ``seg_source[s]`` from its element ``seg_start[s]``.
Segments = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

_NO_INDICES = np.zeros(0, np.int64)


def check_integer(col: ListColumn, param: str | None = None) -> None:
    """Refuse a token column of non-integer values (the batch's tokens, labels and masks are integers)."""
    if col.chunks and col.chunks[0].values.dtype.kind not in "iub":
        raise PackingError(
            f"column {col.name!r} holds {col.chunks[0].values.dtype} values; token columns must hold integers. "
            f"Cast it, e.g. ds.cast_column({col.name!r}, Sequence(Value('int32'))) (a pyarrow.Table: to "
            f"list<int32>).",
            param=param,
        )


def checked_rows(
    indices: Sequence[int] | np.ndarray, n: int, error: type[Exception] = PackingError
) -> np.ndarray:
    """``indices`` as int64 row numbers in ``[0, n)`` (negative ones count from the end); ``error`` if out of range."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = int(idx[(idx < -n) | (idx >= n)][0])
        raise error(f"row index {bad} is out of range for {n} rows.")
    return idx % n if idx.size else idx


class ArrowSource:
    """The list columns ``cols`` of ``table`` (read through ``indices`` when given) as NumPy views of their
    buffers, and the copies of a batch out of them (:meth:`column`, :meth:`whole_rows`).

    ``cols`` are aligned (equal row lengths, e.g. ``input_ids`` and ``labels``: they share their row starts);
    ``others`` are columns of other row lengths (``seq_lengths``).
    """

    def __init__(
        self,
        table: pa.Table,
        cols: Sequence[ListColumn],
        indices: np.ndarray | None = None,
        others: Sequence[ListColumn] = (),
    ) -> None:
        self.indices = indices
        self.chunks = {c.name: c.chunks for c in (*cols, *others)}
        self.names = [c.name for c in (*cols, *others)]
        self.dtypes = {c.name: c.value_dtype for c in (*cols, *others)}
        # Per column: where its values live (`sources`: the Arrow buffers behind its chunks, as NumPy views;
        # chunks of one memory-mapped file share one) and, per chunk, which source and at which element it
        # starts; shared by aligned columns: each chunk's first table row and each row's start in its chunk.
        self.sources: dict[str, list[np.ndarray]] = {}
        self.chunk_source: dict[str, np.ndarray] = {}
        self.chunk_base: dict[str, np.ndarray] = {}
        self.row_starts: dict[str, np.ndarray] = {}
        self.row_begin: dict[str, np.ndarray] = {}
        for c in cols:
            starts = c.chunk_row_starts()
            shared = next((n for n, s in self.row_starts.items() if np.array_equal(s, starts)), None)
            self.row_starts[c.name] = starts
            self.row_begin[c.name] = self.row_begin[shared] if shared else _row_begin(c)
            sources, which, base = _buffer_sources(table.column(c.name), c)
            self.sources[c.name], self.chunk_source[c.name], self.chunk_base[c.name] = sources, which, base
        for c in others:
            self.row_starts[c.name], self.row_begin[c.name] = c.chunk_row_starts(), _row_begin(c)
            sources, which, base = _buffer_sources(table.column(c.name), c)
            self.sources[c.name], self.chunk_source[c.name], self.chunk_base[c.name] = sources, which, base

    @property
    def offsets_bytes(self) -> int:
        """Memory of the per-row starts (shared between aligned columns) and the row mapping."""
        arrays = list({id(a): a for a in self.row_begin.values()}.values())
        if self.indices is not None:
            arrays.append(self.indices)
        return int(sum(a.nbytes for a in arrays))

    def column(
        self, name: str, rows: np.ndarray, total: int, segments: Segments, dtype: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Column ``name`` of ``rows`` (their ``total`` values, end to end) and the lengths of their segments.

        One kernel finds every segment in the source buffers (sorted by buffer, then position, so each buffer
        is read front to back), then one copy kernel call per buffer.
        """
        out = np.empty(total, dtype or self.dtypes[name])
        sources = self.sources[name]
        mapped = self.indices is not None
        row_offsets, seg_source, seg_start, seg_length = segments
        begin, size, dest, bounds, seg_lengths = kernels.view_segments(
            rows, row_offsets, seg_source, seg_start, seg_length, mapped,
            self.indices if mapped else _NO_INDICES, self.row_begin[name], self.row_starts[name],
            self.chunk_base[name], self.chunk_source[name], len(sources),
        )  # fmt: skip
        cuts = bounds.tolist()
        for j, source in enumerate(sources):
            a, b = cuts[j], cuts[j + 1]
            if a < b:
                kernels.gather_scattered(source, begin[a:b], size[a:b], dest[a:b], out)
        return out, seg_lengths

    def whole_rows(self, name: str, rows: np.ndarray, total: int, dtype: Any = None) -> np.ndarray:
        """Column ``name`` of the table ``rows`` (no row mapping), whole, end to end: one NumPy concatenate of
        row slices.  For whole rows this beats :meth:`column` (no segment search, no kernel dispatch)."""
        chunks = self.chunks[name]
        if len(chunks) == 1:
            off, vals = chunks[0].offsets, chunks[0].values
            parts = [vals[off[r] : off[r + 1]] for r in rows.tolist()]
        else:
            which = np.searchsorted(self.row_starts[name], rows, side="right") - 1
            parts = []
            for r, c in zip(rows.tolist(), which.tolist()):
                chunk = chunks[c]
                local = r - chunk.row_start
                parts.append(chunk.values[chunk.offsets[local] : chunk.offsets[local + 1]])
        out = np.empty(total, dtype or self.dtypes[name])
        if parts:
            np.concatenate(parts, out=out, casting="unsafe")
        return out


class ArrowBatches:
    """What an Arrow-backed dataset of the collators provides: ``gather`` (the batch as :class:`FlatRows`) and
    ``iter_batches``.  A subclass sets ``_source`` and implements :meth:`_gather`."""

    _source: ArrowSource

    def _gather(self, rows: np.ndarray, mask_keys: Sequence[str]) -> FlatRows:
        raise NotImplementedError

    def _rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return checked_rows(indices, len(self))  # type: ignore[arg-type]

    def _labels(
        self, input_ids: np.ndarray, read: Callable[[str, Any], np.ndarray], mask_keys: Sequence[str]
    ) -> np.ndarray:
        """The labels of a batch whose tokens are ``input_ids``: the labels column, else the masks applied.

        ``read(name, dtype)`` is the batch's column ``name`` (read only when it is needed)."""
        names = self._source.names
        own = read("labels", np.int64) if "labels" in names else None
        return labels_of(input_ids, own, (read(k, None) for k in mask_keys if k in names))

    def gather(
        self, indices: Sequence[int] | np.ndarray, mask_keys: Sequence[str] = MASK_COLUMNS
    ) -> FlatRows:
        """The rows at ``indices`` laid end to end, ready for a collator (``collator.collate_flat``).

        ``mask_keys``: the 0/1 mask columns applied to labels when there is no ``labels`` column.
        """
        return self._gather(self._rows(indices), mask_keys)

    def iter_batches(
        self, batch_sampler: Iterable[Sequence[int]], collator: PaddingFreeCollator
    ) -> Iterator[dict[str, Any]]:
        """Batches for each list of indices from ``batch_sampler``, without a torch ``DataLoader``."""
        for indices in batch_sampler:
            yield collator.collate_flat(self.gather(indices, collator.mask_keys))


def _row_begin(col: ListColumn) -> np.ndarray:
    """Where each row of ``col`` starts in its chunk's values (int64, one per row)."""
    parts = [c.offsets[:-1] for c in col.chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _buffer_sources(
    column: pa.ChunkedArray, col: ListColumn
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The buffers holding ``col``'s values: ``(sources, source of each chunk, start of each chunk in it)``.

    Chunks read from one Arrow IPC file or stream (``datasets``' memory-mapped files, tables read with
    pyarrow) are slices of one parent buffer, the mapped file: one zero-copy NumPy view of it serves them all,
    so a batch is copied by one kernel call per file instead of one slice per segment.  A chunk with no such
    parent is its own source.
    """
    sources: list[np.ndarray] = []
    known: dict[tuple[int, int], int] = {}
    which, base = [], []
    for arr, chunk in zip(column.chunks, col.chunks):
        values = chunk.values
        root, addr, size = None, values.ctypes.data, values.itemsize
        if values.size:
            root = arr.values.buffers()[1]
            while root.parent is not None:
                root = root.parent
            inside = root.address <= addr and addr + values.nbytes <= root.address + root.size
            if not inside or root.address % size or (addr - root.address) % size:
                root = None
        if root is None:
            which.append(len(sources))
            base.append(0)
            sources.append(values)
            continue
        key = (root.address, root.size)
        if key not in known:
            known[key] = len(sources)
            whole = np.frombuffer(root, dtype=np.uint8)
            sources.append(whole[: root.size - root.size % size].view(values.dtype))
        which.append(known[key])
        base.append((addr - root.address) // size)
    if not sources:
        sources.append(np.zeros(0, col.value_dtype))
    return sources, np.array(which, np.int64), np.array(base, np.int64)
