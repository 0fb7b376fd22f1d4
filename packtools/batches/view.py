"""Packed rows on demand: a :class:`~packtools.PackPlan` over the source's Arrow buffers.

A :class:`PackedView` is what :func:`packtools.pack_table` / :func:`packtools.pack_dataset` would return, without
writing a token: it keeps the source table (memory-mapped or in memory) and the plan, and copies the planned
segments of a row, or of a whole batch, only when they are asked for.  Building one costs reading the row
lengths from the Arrow offsets and planning (~0.1 s per million sequences); its own memory is the plan and the
columns' offsets, a few dozen bytes per sequence.

>>> import pyarrow as pa
>>> from packtools import pack_table, plan
>>> table = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
>>> view = PackedView(table, plan([5, 2, 3, 1], max_length=4))
>>> len(view), view[1]["input_ids"].tolist(), view[1]["seq_lengths"].tolist()
(3, [8, 9, 10, 11], [3, 1])
>>> view.materialize().equals(pack_table(table, 4))
True

As a map-style dataset it works with a torch ``DataLoader`` (and worker processes: pickling sends the plan
and the source's file paths, see :meth:`PackedView.__getstate__`) and, through :class:`~packtools.batches.ArrowCollator`,
gathers whole batches straight from the source buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..constants import IGNORE_INDEX, MASK_COLUMNS, SEQ_LENGTHS, TOKEN_COLUMNS
from ..core import kernels
from ..core.arrow import ListColumn
from ..core.pack import pack_columns, read_columns
from ..core.plan import PackPlan, check_max_length
from ..core.plan import plan as make_plan
from ..errors import PackingError
from .collate import FlatRows, PaddingFreeCollator

__all__ = ["PackedRow", "PackedView"]

_NO_INDICES = np.zeros(0, np.int64)


class PackedRow(Mapping):
    """One packed row of a :class:`PackedView`, gathered on first access (what ``__getitems__`` returns).

    It is a read-only mapping with the keys of ``view[i]``, so any collator that reads rows as dicts works;
    :class:`~packtools.batches.ArrowCollator` recognizes it and gathers the whole batch from the source buffers instead.
    """

    __slots__ = ("_row", "index", "view")

    def __init__(self, view: PackedView, index: int) -> None:
        self.view = view
        self.index = index
        self._row: dict[str, np.ndarray] | None = None

    def _load(self) -> dict[str, np.ndarray]:
        if self._row is None:
            self._row = self.view[self.index]
        return self._row

    def __getitem__(self, key: str) -> np.ndarray:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.view.column_names)

    def __len__(self) -> int:
        return len(self.view.column_names)

    def __repr__(self) -> str:
        return f"PackedRow(index={self.index})"


class PackedView:
    """Packed rows of ``table`` as ``plan`` places them, gathered from the table's buffers when read.

    ``plan`` must be made for the lengths of the packed columns (``columns``, else every column, all lists),
    read through ``indices`` when given (a row mapping such as a ``datasets`` select/shuffle: source sequence
    ``s`` is table row ``indices[s]``).  :func:`packtools.packed_view` builds the plan and the view in one call,
    also from a ``datasets.Dataset``.

    ``view[i]`` is the packed row ``i`` as a dict of NumPy arrays: each packed column (its own dtype) and, for
    ``bfd``/``bfd_split``, ``seq_lengths`` (int32) -- the values of row ``i`` of :meth:`materialize`.
    """

    def __init__(
        self,
        table: pa.Table,
        plan: PackPlan,
        *,
        indices: Sequence[int] | np.ndarray | None = None,
        columns: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(table, pa.Table):
            raise PackingError(f"table must be a pyarrow.Table, got {type(table).__name__}.", param="table")
        if not isinstance(plan, PackPlan):
            raise PackingError(f"plan must be a packtools.PackPlan, got {type(plan).__name__}.", param="plan")
        self._bind(table, *read_columns(table, columns), plan, _as_indices(indices, table.num_rows))

    @classmethod
    def from_table(
        cls,
        table: pa.Table,
        max_length: int,
        strategy: str = "bfd",
        *,
        shuffle: bool = False,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
    ) -> PackedView:
        """Plan ``table``'s rows (through ``indices``) and view them; the plan is the one ``pack_table`` makes."""
        max_length = check_max_length(max_length)
        cols, lengths = read_columns(table, columns)
        idx = _as_indices(indices, table.num_rows)
        p = make_plan(lengths if idx is None else lengths[idx], max_length, strategy)
        if shuffle:
            p = p.shuffled(seed)
        view = cls.__new__(cls)
        view._bind(table, cols, lengths, p, idx)
        return view

    def _bind(
        self,
        table: pa.Table,
        cols: list[ListColumn],
        lengths: np.ndarray,
        plan: PackPlan,
        indices: np.ndarray | None,
    ) -> None:
        source_lengths = lengths if indices is None else lengths[indices]
        if plan.num_sequences != source_lengths.shape[0] or not np.array_equal(
            plan.source_lengths, source_lengths
        ):
            raise PackingError(
                f"the plan was made for {plan.num_sequences} sequences of other lengths than the "
                f"{source_lengths.shape[0]} rows of this table{' (through indices)' if indices is not None else ''}; "
                f"plan the same rows with packtools.plan(), or use packtools.packed_view().",
                param="plan",
            )
        for col in cols:
            if col.name in TOKEN_COLUMNS and col.chunks and col.chunks[0].values.dtype.kind not in "iub":
                raise PackingError(
                    f"column {col.name!r} holds {col.chunks[0].values.dtype} values; token columns must hold "
                    f"integers. Cast it (e.g. to list<int32>) before viewing it.",
                    param="columns",
                )
        self._table = table
        self._indices = indices
        self.plan = plan
        self._names = [c.name for c in cols]
        self._dtypes = {c.name: c.value_dtype for c in cols}
        # Per column: where its values live (`_sources`: the Arrow buffers behind its chunks, as NumPy views;
        # chunks of one memory-mapped file share one) and, per chunk, which source and at which element it
        # starts; shared by aligned columns: each chunk's first table row and each row's start in its chunk.
        self._sources: dict[str, list[np.ndarray]] = {}
        self._chunk_source: dict[str, np.ndarray] = {}
        self._chunk_base: dict[str, np.ndarray] = {}
        self._row_starts: dict[str, np.ndarray] = {}
        self._row_begin: dict[str, np.ndarray] = {}
        for c in cols:
            starts = c.chunk_row_starts()
            shared = next((n for n, s in self._row_starts.items() if np.array_equal(s, starts)), None)
            self._row_starts[c.name] = starts
            self._row_begin[c.name] = self._row_begin[shared] if shared else _row_begin(c)
            sources, which, base = _buffer_sources(table.column(c.name), c)
            self._sources[c.name], self._chunk_source[c.name], self._chunk_base[c.name] = sources, which, base
        self._lengths: np.ndarray | None = None

    # -- what the view holds ---------------------------------------------------------------------
    @property
    def table(self) -> pa.Table:
        """The source table (never copied)."""
        return self._table

    @property
    def column_names(self) -> list[str]:
        """Keys of a row: the packed columns, then ``seq_lengths`` for ``bfd``/``bfd_split``."""
        names = list(self._names)
        return names + [SEQ_LENGTHS] if self.plan.strategy != "wrapped" else names

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each packed row (int64): what :class:`~packtools.batches.TokenBudgetBatchSampler` needs."""
        if self._lengths is None:
            self._lengths = self.plan.row_lengths
        return self._lengths

    @property
    def seq_lengths(self) -> pa.ListArray | None:
        """Segment lengths per row (the ``seq_lengths`` column; ``None`` for ``wrapped``), for the sampler."""
        return None if self.plan.strategy == "wrapped" else self.plan.seq_lengths

    @property
    def state_bytes(self) -> int:
        """Memory the view holds besides the source: the plan, the row mapping and the columns' offsets."""
        p = self.plan
        arrays = [p.seg_source, p.seg_start, p.seg_length, p.row_offsets, p.source_lengths]
        if self._indices is not None:
            arrays.append(self._indices)
        arrays += list({id(a): a for a in self._row_begin.values()}.values())
        return int(sum(a.nbytes for a in arrays))

    def __len__(self) -> int:
        return self.plan.num_rows

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={len(self)}, sequences={self.plan.num_sequences}, "
            f"max_length={self.plan.max_length}, strategy={self.plan.strategy!r}, columns={self._names})"
        )

    # -- gathering -------------------------------------------------------------------------------
    def _rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"row {bad} is out of range for a view of {n} rows.")
        return idx % n if idx.size else idx

    def _column(
        self, name: str, rows: np.ndarray, total: int, dtype: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Column ``name`` of the packed ``rows``, end to end, copied straight from the source buffers, and
        the lengths of the segments (row order).

        One kernel finds every segment in the source buffers (sorted by buffer, then position, so each buffer
        is read front to back), then one copy kernel call per buffer.
        """
        p = self.plan
        out = np.empty(total, dtype or self._dtypes[name])
        sources = self._sources[name]
        mapped = self._indices is not None
        begin, size, dest, bounds, seg_lengths = kernels.view_segments(
            rows, p.row_offsets, p.seg_source, p.seg_start, p.seg_length, mapped,
            self._indices if mapped else _NO_INDICES, self._row_begin[name], self._row_starts[name],
            self._chunk_base[name], self._chunk_source[name], len(sources),
        )  # fmt: skip
        cuts = bounds.tolist()
        for j, source in enumerate(sources):
            a, b = cuts[j], cuts[j + 1]
            if a < b:
                kernels.gather_scattered(source, begin[a:b], size[a:b], dest[a:b], out)
        return out, seg_lengths

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if isinstance(i, slice) or not isinstance(i, (int, np.integer)):
            raise TypeError(
                f"a PackedView is indexed by one int, got {type(i).__name__}; use view.gather(indices) for a "
                f"batch, or view.materialize() for every row."
            )
        row = self._rows([i])
        total = int(self.lengths[row[0]])
        out = {name: self._column(name, row, total)[0] for name in self._names}
        if self.plan.strategy != "wrapped":
            start, stop = self.plan.row_offsets[row[0]], self.plan.row_offsets[row[0] + 1]
            out[SEQ_LENGTHS] = self.plan.seg_length[start:stop].astype(np.int32)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[PackedRow]:
        """Rows that gather themselves on first access (a ``DataLoader`` calls this for a batch)."""
        return [PackedRow(self, int(i)) for i in self._rows(indices).tolist()]

    def gather(
        self, indices: Sequence[int] | np.ndarray, mask_keys: Sequence[str] = MASK_COLUMNS
    ) -> FlatRows:
        """The packed rows at ``indices`` laid end to end, ready for a collator (see :class:`PackedRows`).

        ``mask_keys``: the 0/1 mask columns applied to labels when there is no ``labels`` column.
        """
        return self._gather(self._rows(indices), mask_keys)

    def _gather(self, rows: np.ndarray, mask_keys: Sequence[str] = MASK_COLUMNS) -> FlatRows:
        """:meth:`gather` for row numbers already checked (int64, in range)."""
        if "input_ids" not in self._names:
            raise PackingError(
                f"the view has no 'input_ids' column (columns: {self._names}); batches need token ids."
            )
        if rows.size == 0:
            raise PackingError("the batch is empty; a batch needs at least one row.")
        counts = self.plan.row_offsets[rows + 1] - self.plan.row_offsets[rows]
        row_lengths = self.lengths[rows]
        total = int(row_lengths.sum())
        input_ids, seg_lengths = self._column("input_ids", rows, total, np.int64)
        if "labels" in self._names:
            labels = self._column("labels", rows, total, np.int64)[0]
        else:
            labels = input_ids.copy()
            for key in mask_keys:
                if key in self._names:
                    labels[self._column(key, rows, total)[0] == 0] = IGNORE_INDEX
        if self.plan.strategy == "wrapped":
            # A wrapped row has no seq_lengths, as in pack_table's output: the collator treats it as one
            # sequence only when told the rows are unpacked (unmarked_row), like every row without them.
            seg_lengths, counts = row_lengths, np.ones(rows.shape[0], np.int64)
            return FlatRows(input_ids, labels, row_lengths, seg_lengths, counts, unmarked_row=0)
        return FlatRows(input_ids, labels, row_lengths, seg_lengths, counts)

    def iter_batches(
        self, batch_sampler: Iterable[Sequence[int]], collator: PaddingFreeCollator
    ) -> Iterator[dict[str, Any]]:
        """Batches for each list of indices from ``batch_sampler``, without a torch ``DataLoader``."""
        for indices in batch_sampler:
            yield collator.collate_flat(self.gather(indices, collator.mask_keys))

    def materialize(self) -> pa.Table:
        """Every packed row, written out: equal to ``pack_table`` with the same arguments."""
        cols, _ = read_columns(self._table, self._names)
        return pack_columns(cols, self.plan, self._indices)

    # -- pickling: the plan and the source, re-read on the other side ----------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The plan, the row mapping, the column names and the table.

        A ``pyarrow.Table`` pickles with its buffers; :func:`packtools.packed_view` over a memory-mapped
        ``datasets.Dataset`` pickles the dataset instead, which sends only its file paths.
        """
        return {"table": self._table, "plan": self.plan, "indices": self._indices, "columns": self._names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        table = state["table"]
        self._bind(table, *read_columns(table, state["columns"]), state["plan"], state["indices"])


def _as_indices(indices: Sequence[int] | np.ndarray | None, num_rows: int) -> np.ndarray | None:
    if indices is None:
        return None
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= num_rows):
        bad = int(idx[(idx < 0) | (idx >= num_rows)][0])
        raise PackingError(
            f"indices holds {bad}, out of range for a table of {num_rows} rows.", param="indices"
        )
    return idx


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
