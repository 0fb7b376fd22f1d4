"""Packed rows on demand: a :class:`~packtools.PackPlan` over the source's Arrow buffers.

A :class:`PackedView` is what :func:`packtools.pack_table` / :func:`packtools.pack_dataset` would return, without
writing a token: it keeps the source table (memory-mapped or in memory) and the plan, and copies the planned
segments of a row, or of a whole batch, only when they are asked for.  Building one costs reading the row
lengths from the Arrow offsets and planning; its own memory is the plan and the columns' offsets, a few dozen
bytes per sequence.

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

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..constants import SEQ_LENGTHS, TOKEN_COLUMNS
from ..core.arrow import ListColumn
from ..core.pack import check_no_images, pack_columns, read_columns
from ..core.plan import PackPlan, check_max_length
from ..core.plan import plan as make_plan
from ..errors import PackingError
from .arrow_rows import ArrowBatches, ArrowSource, Segments, check_integer, checked_rows
from .flatten import FlatRows

__all__ = ["PackedRow", "PackedView"]


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


class PackedView(ArrowBatches):
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
        check_no_images(table, "packed_view")
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
            if col.name in TOKEN_COLUMNS:
                check_integer(col, param="columns")
        self._table = table
        self._indices = indices
        self.plan = plan
        self._names = [c.name for c in cols]
        self._source = ArrowSource(table, cols, indices)
        self._segments: Segments = (plan.row_offsets, plan.seg_source, plan.seg_start, plan.seg_length)
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
        return int(sum(a.nbytes for a in arrays)) + self._source.offsets_bytes

    def __len__(self) -> int:
        return self.plan.num_rows

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={len(self)}, sequences={self.plan.num_sequences}, "
            f"max_length={self.plan.max_length}, strategy={self.plan.strategy!r}, columns={self._names})"
        )

    # -- gathering -------------------------------------------------------------------------------
    def _rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return checked_rows(indices, len(self), IndexError)

    def _column(self, name: str, rows: np.ndarray, total: int) -> np.ndarray:
        return self._source.column(name, rows, total, self._segments)[0]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if isinstance(i, slice) or not isinstance(i, (int, np.integer)):
            raise TypeError(
                f"a PackedView is indexed by one int, got {type(i).__name__}; use view.gather(indices) for a "
                f"batch, or view.materialize() for every row."
            )
        row = self._rows([i])
        total = int(self.lengths[row[0]])
        out = {name: self._column(name, row, total) for name in self._names}
        if self.plan.strategy != "wrapped":
            start, stop = self.plan.row_offsets[row[0]], self.plan.row_offsets[row[0] + 1]
            out[SEQ_LENGTHS] = self.plan.seg_length[start:stop].astype(np.int32)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[PackedRow]:
        """Rows that gather themselves on first access (a ``DataLoader`` calls this for a batch)."""
        return [PackedRow(self, int(i)) for i in self._rows(indices).tolist()]

    def _gather(self, rows: np.ndarray, mask_keys: Sequence[str]) -> FlatRows:
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
        input_ids, seg_lengths = self._source.column("input_ids", rows, total, self._segments, np.int64)
        read = lambda name, dtype: self._source.column(name, rows, total, self._segments, dtype)[0]  # noqa: E731
        labels = self._labels(input_ids, read, mask_keys)
        if self.plan.strategy == "wrapped":
            # A wrapped row has no seq_lengths, as in pack_table's output: the collator treats it as one
            # sequence only when told the rows are unpacked (unmarked_row), like every row without them.
            seg_lengths, counts = row_lengths, np.ones(rows.shape[0], np.int64)
            return FlatRows(input_ids, labels, row_lengths, seg_lengths, counts, unmarked_row=0)
        return FlatRows(input_ids, labels, row_lengths, seg_lengths, counts)

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
