"""Arrow-native batches: packed rows read straight from Arrow buffers into padding-free tensors.

:class:`PackedRows` wraps a ``datasets.Dataset`` (its Arrow table and indices mapping) or a ``pyarrow.Table``
and reads the token columns once as NumPy views of the Arrow buffers; a batch is a handful of slices of
those views concatenated into one array, with no token ever turned into a Python object.
:class:`ArrowCollator` turns a list of row indices into the same batch :class:`~packtools.PaddingFreeCollator`
makes from the same rows as Python lists.

>>> import pyarrow as pa
>>> from packtools.batches.collate import PaddingFreeCollator
>>> table = pa.table({"input_ids": [[1, 2, 3, 4], [5, 6]], "seq_lengths": [[3, 1], [2]]})
>>> rows = PackedRows(table)
>>> collate = ArrowCollator(rows, PaddingFreeCollator(pad_token_id=0, return_tensors="np"))
>>> b = collate([1, 0])
>>> b["input_ids"].tolist(), b["cu_seq_lens_q"].tolist()
([[5, 6, 1, 2, 3, 4]], [0, 2, 5, 6])

With torch: ``DataLoader(rows, batch_sampler=TokenBudgetBatchSampler(rows.lengths, 32768), collate_fn=collate)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import is_instance
from ..constants import IGNORE_INDEX, MASK_COLUMNS, SEQ_LENGTHS, TOKEN_COLUMNS
from ..core.arrow import ListColumn, check_aligned, read_list_column
from ..errors import PackingError
from ..integrations.compat.datasets import dataset_table
from .collate import FlatRows, PaddingFreeCollator


def _check_integer(col: ListColumn) -> None:
    if col.chunks and col.chunks[0].values.dtype.kind not in "iub":
        raise PackingError(
            f"column {col.name!r} holds {col.chunks[0].values.dtype} values; token columns must hold integers. "
            f"Cast it, e.g. ds.cast_column({col.name!r}, Sequence(Value('int32')))."
        )


class PackedRows:
    """Rows of a ``datasets.Dataset`` or ``pyarrow.Table`` served from their Arrow buffers.

    Reads ``input_ids`` and, when present, ``labels``, ``completion_mask``, ``assistant_masks`` and
    ``seq_lengths`` (a row without ``seq_lengths`` is one sequence).  Columns are validated once here
    (aligned lengths, ``seq_lengths`` summing to the row length, no empty segment), so batches are only copies.

    As a map-style dataset, ``rows[i]`` is just ``i``: pair it with :class:`ArrowCollator` as ``collate_fn``.
    """

    def __init__(self, data: Any, columns: Sequence[str] | None = None) -> None:
        if is_instance(data, "datasets", "Dataset"):
            table, indices = dataset_table(data)
        elif isinstance(data, pa.Table):
            table, indices = data, None
        else:
            raise PackingError(
                f"PackedRows needs a datasets.Dataset or a pyarrow.Table, got {type(data).__name__}."
            )
        if "attention_mask" in table.column_names and SEQ_LENGTHS in table.column_names:
            raise PackingError(
                "the data has an 'attention_mask' column beside 'seq_lengths': a packed row's mask cannot mark "
                "where its sequences end. Drop it (ds.remove_columns('attention_mask')); the collator separates "
                "sequences by itself."
            )
        names = [c for c in (columns or (*TOKEN_COLUMNS, SEQ_LENGTHS)) if c in table.column_names]
        if "input_ids" not in names:
            raise PackingError(
                f"the data has no 'input_ids' column (columns: {table.column_names}); tokenize it first."
            )
        unknown = [c for c in names if c not in (*TOKEN_COLUMNS, SEQ_LENGTHS)]
        if unknown:
            raise PackingError(
                f"columns {unknown} are not used by PackedRows; it reads {TOKEN_COLUMNS + (SEQ_LENGTHS,)}."
            )
        self.columns: dict[str, ListColumn] = {}
        for name in names:
            col = read_list_column(table.column(name), name)
            _check_integer(col)
            self.columns[name] = col
        token_cols = [self.columns[n] for n in names if n != SEQ_LENGTHS]
        self._table_lengths = check_aligned(token_cols)
        self._indices = indices
        self._row_starts = {n: c.chunk_row_starts() for n, c in self.columns.items()}
        if SEQ_LENGTHS in self.columns:
            self._check_seq_lengths(self.columns[SEQ_LENGTHS])
        self._seq_column = table.column(SEQ_LENGTHS) if SEQ_LENGTHS in self.columns else None

    def _check_seq_lengths(self, col: ListColumn) -> None:
        sums, zeros = [], []
        for chunk in col.chunks:
            csum = np.concatenate(([0], np.cumsum(chunk.values, dtype=np.int64)))
            sums.append(csum[chunk.offsets[1:]] - csum[chunk.offsets[:-1]])
            zeros.append(chunk.values[chunk.offsets[0] : chunk.offsets[-1]].min(initial=1) <= 0)
        if any(zeros):
            raise PackingError(
                "column 'seq_lengths' has an entry <= 0; every packed sequence needs >= 1 token. Re-pack the data."
            )
        total = np.concatenate(sums) if sums else np.zeros(0, np.int64)
        bad = np.flatnonzero(total != self._table_lengths)
        if bad.size:
            r = int(bad[0])
            raise PackingError(
                f"row {r}: 'seq_lengths' sum to {int(total[r])} but 'input_ids' has {int(self._table_lengths[r])} "
                f"tokens; re-pack the data or drop the 'seq_lengths' column."
            )

    # -- dataset protocol ------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._table_lengths.shape[0] if self._indices is None else self._indices.shape[0])

    def __getitem__(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} is out of range for {n} rows.")
        return int(i) % n

    def __getitems__(self, indices: Sequence[int]) -> list[int]:
        return list(indices)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each row (int64), in dataset order: what :class:`TokenBudgetBatchSampler` needs."""
        return self._table_lengths if self._indices is None else self._table_lengths[self._indices]

    @property
    def seq_lengths(self) -> pa.ChunkedArray | None:
        """The ``seq_lengths`` column in dataset order (for the sampler's attention cost), or ``None``."""
        if self._seq_column is None or self._indices is None:
            return self._seq_column
        return self._seq_column.take(pa.array(self._indices))

    # -- gathering -------------------------------------------------------------------------------
    def _table_rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise PackingError(f"row index {bad} is out of range for {n} rows.")
        idx = idx % n if idx.size else idx
        return idx if self._indices is None else self._indices[idx]

    def _slices(self, name: str, rows: np.ndarray) -> list[np.ndarray]:
        col = self.columns[name]
        if len(col.chunks) == 1:
            chunk = col.chunks[0]
            off, vals = chunk.offsets, chunk.values
            return [vals[off[r] : off[r + 1]] for r in rows.tolist()]
        which = np.searchsorted(self._row_starts[name], rows, side="right") - 1
        parts = []
        for r, c in zip(rows.tolist(), which.tolist()):
            chunk = col.chunks[c]
            local = r - chunk.row_start
            parts.append(chunk.values[chunk.offsets[local] : chunk.offsets[local + 1]])
        return parts

    def _gather(self, name: str, rows: np.ndarray, total: int) -> np.ndarray:
        out = np.empty(total, np.int64)
        parts = self._slices(name, rows)
        if parts:
            np.concatenate(parts, out=out, casting="unsafe")
        return out

    def gather(
        self, indices: Sequence[int] | np.ndarray, mask_keys: Sequence[str] = MASK_COLUMNS
    ) -> FlatRows:
        """The rows at ``indices`` laid end to end (empty rows skipped), ready for a collator.

        ``mask_keys``: the 0/1 mask columns applied to labels when there is no ``labels`` column.
        """
        rows = self._table_rows(indices)
        row_lengths = self._table_lengths[rows]
        rows = rows[row_lengths > 0]
        row_lengths = row_lengths[row_lengths > 0]
        if rows.size == 0:
            raise PackingError("every row in the batch is empty; a batch needs at least one token.")
        total = int(row_lengths.sum())
        input_ids = self._gather("input_ids", rows, total)
        if "labels" in self.columns:
            labels = self._gather("labels", rows, total)
        else:
            labels = input_ids.copy()
            for key in mask_keys:
                if key in self.columns:
                    labels[self._gather(key, rows, total) == 0] = IGNORE_INDEX
        if SEQ_LENGTHS in self.columns:
            segs = self._slices(SEQ_LENGTHS, rows)
            seg_lengths = np.concatenate(segs).astype(np.int64)
            segs_per_row = np.array([s.shape[0] for s in segs], np.int64)
        else:
            seg_lengths = row_lengths.astype(np.int64)
            segs_per_row = np.ones(rows.shape[0], np.int64)
        unmarked = None if SEQ_LENGTHS in self.columns else 0
        return FlatRows(input_ids, labels, row_lengths.astype(np.int64), seg_lengths, segs_per_row, unmarked)

    def iter_batches(
        self, batch_sampler: Iterable[Sequence[int]], collator: PaddingFreeCollator
    ) -> Iterator[dict[str, Any]]:
        """Batches for each list of indices from ``batch_sampler``, without a torch ``DataLoader``."""
        for indices in batch_sampler:
            yield collator.collate_flat(self.gather(indices, collator.mask_keys))


class ArrowCollator:
    """``collate_fn`` for a ``DataLoader`` over :class:`PackedRows` or a :class:`~packtools.batches.PackedView`.

    Takes row indices (what ``PackedRows`` yields) or the lazy rows a ``PackedView`` yields, and gathers the
    batch straight from the Arrow buffers; gives the same tensors as ``collator`` on the same rows read as
    Python lists.  Other rows (dicts) are passed to ``collator`` as they are.
    """

    def __init__(self, rows: Any, collator: PaddingFreeCollator) -> None:
        from .view import PackedView

        if not isinstance(rows, (PackedRows, PackedView)):
            raise PackingError(f"rows must be a PackedRows or a PackedView, got {type(rows).__name__}.")
        if not isinstance(collator, PaddingFreeCollator):
            raise PackingError(f"collator must be a PaddingFreeCollator, got {type(collator).__name__}.")
        self.rows = rows
        self.collator = collator

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        from .view import PackedRow

        if len(items) and isinstance(items[0], PackedRow):
            view = items[0].view  # the view that made them (in a worker process: its copy)
            if not all(isinstance(r, PackedRow) and r.view is view for r in items):
                raise PackingError("the batch mixes rows of several PackedViews; collate rows of one view.")
            rows = np.fromiter((r.index for r in items), np.int64, len(items))  # checked by __getitems__
            return self.collator.collate_flat(view._gather(rows, self.collator.mask_keys))
        if len(items) and isinstance(items[0], Mapping):
            return self.collator(items)
        return self.collator.collate_flat(self.rows.gather(items, self.collator.mask_keys))
