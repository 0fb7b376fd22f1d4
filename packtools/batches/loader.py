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

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import is_instance
from ..compat.datasets import dataset_table
from ..constants import MEDIA_COLUMNS, PIXEL_COLUMNS, SEQ_LENGTHS, TOKEN_COLUMNS
from ..core.arrow import ListColumn, check_aligned, check_row_counts, read_list_column
from ..errors import EmptyRowsWarning, PackingError, empty_rows_message
from .arrow_rows import ArrowBatches, ArrowSource, check_integer
from .collate import PaddingFreeCollator
from .flatten import CARRIED_KEYS, FlatRows, check_leave_out, image_columns_left_out, restart_positions
from .view import PackedRow, PackedView
from .vision import VISION_COLUMNS

#: Image columns of a processed vision-language table: they need :class:`~packtools.batches.MultimodalCollator`.
_IMAGE_COLUMNS = frozenset((*VISION_COLUMNS, *PIXEL_COLUMNS))


def check_table_columns(names: Sequence[str], leave_out: frozenset[str], who: str) -> None:
    """Refuse, by name, a column of the data that the batch would not carry and ``leave_out`` does not list (an
    image, video or audio column even when it does: :func:`~packtools.batches.flatten.check_carried`)."""
    if found := sorted(c for c in names if c in MEDIA_COLUMNS):
        raise PackingError(image_columns_left_out("the data", found, who), param="leave_out")
    extra = sorted(c for c in names if c not in CARRIED_KEYS and c not in leave_out)
    if not extra:
        return
    images = [c for c in extra if c in _IMAGE_COLUMNS]
    why = (
        f"the image column(s) {images} would be dropped and the model would train on image placeholders "
        f"without their images; batch a vision-language table with packtools.batches.MultimodalCollator "
        f"(rows as dicts), not {who}"
        if images
        else f"{who} does not put them in the batch, so the model would never see them"
    )
    raise PackingError(
        f"the data has the column(s) {extra}: {why}. Remove them (ds.remove_columns({extra!r})), or say they "
        f"may be left out: {who}(..., leave_out={extra!r}).",
        param="leave_out",
    )


class PackedRows(ArrowBatches):
    """Rows of a ``datasets.Dataset`` or ``pyarrow.Table`` served from their Arrow buffers, as they are.

    Reads ``input_ids`` and, when present, ``labels``, ``completion_mask``, ``assistant_masks`` and
    ``seq_lengths`` (a row without ``seq_lengths`` is one sequence; ``columns`` narrows these).  Every other
    column reaches the batch or stops it, as with :class:`~packtools.PaddingFreeCollator`: a column outside
    the collator's (``position_ids`` is rebuilt; an ``attention_mask`` is accepted only all ones, without
    ``seq_lengths``) is refused by name unless ``leave_out`` lists it; image columns (``pixel_values``,
    ``image_grid_thw``: a ``pack --processor`` output) are refused with a pointer to
    :class:`~packtools.batches.MultimodalCollator`.  Columns are validated once here
    (aligned lengths, ``seq_lengths`` summing to the row length, no empty segment), so batches are only copies.
    Row ``i`` is row ``i`` of the data (empty rows included; a batch skips them); for rows packed on the fly
    from a plan, see :class:`~packtools.batches.PackedView`, which shares this class's gather.

    As a map-style dataset, ``rows[i]`` is just ``i``: pair it with :class:`ArrowCollator` as ``collate_fn``.
    """

    def __init__(
        self, data: Any, columns: Sequence[str] | None = None, *, leave_out: Sequence[str] = ()
    ) -> None:
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
        if "attention_mask" in table.column_names:
            mask = read_list_column(table.column("attention_mask"), "attention_mask").flat_values()
            if mask.size and (mask.min() != 1 or mask.max() != 1):
                raise PackingError(
                    "column 'attention_mask' has values other than 1, so rows hold padding; padding-free "
                    "batches cannot drop it. Remove the padding (tokenize without padding=True)."
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
        self.leave_out = check_leave_out(leave_out)
        check_table_columns(table.column_names, self.leave_out, "PackedRows")
        cols = [read_list_column(table.column(name), name) for name in names]
        for col in cols:
            check_integer(col)
        tokens = [c for c in cols if c.name != SEQ_LENGTHS]
        seq = [c for c in cols if c.name == SEQ_LENGTHS]
        self._table_lengths = check_aligned(tokens)
        self._indices = indices
        empty = int(np.count_nonzero(self.lengths == 0))
        if empty:  # a batch leaves them out (_gather): said once here
            warnings.warn(
                empty_rows_message(empty, len(self.lengths), "PackedRows", "a batch leaves them out"),
                EmptyRowsWarning,
                stacklevel=2,
            )
        # The gather runs on table rows (a row mapping is applied first), whole rows.
        self._source = ArrowSource(table, tokens, others=seq)
        self._seq_column = None
        if seq:
            self._check_seq_lengths(seq[0])
            self._seq_counts = seq[0].lengths().astype(np.int64)
            self._seq_column = table.column(SEQ_LENGTHS)
        if "position_ids" in table.column_names:
            self._check_position_ids(read_list_column(table.column("position_ids"), "position_ids"), seq)

    def _check_position_ids(self, col: ListColumn, seq: list[ListColumn]) -> None:
        """The rows' own ``position_ids`` must say what ``seq_lengths`` say (the batch rebuilds them)."""
        check_integer(col)
        fix = (
            "the batch rebuilds position_ids from 'seq_lengths' (a row without them is one sequence), so the "
            "rows' own would be replaced without a word. Give the rows 'seq_lengths' that match their "
            "position_ids (the lengths between the 0s), or drop the column (ds.remove_columns('position_ids'))."
        )
        count = col.lengths().astype(np.int64)
        check_row_counts(
            count, self._table_lengths, "'position_ids' has {} values", "'input_ids' has {} tokens", fix
        )
        seg = seq[0].flat_values().astype(np.int64) if seq else self._table_lengths[self._table_lengths > 0]
        rebuilt = restart_positions(seg)
        wrong = np.flatnonzero(col.flat_values().astype(np.int64) != rebuilt)
        if wrong.size:
            token = int(wrong[0])
            r = int(np.searchsorted(np.cumsum(self._table_lengths), token, side="right"))
            said = "its 'seq_lengths'" if seq else "one sequence per row (no 'seq_lengths' column)"
            raise PackingError(
                f"row {r}: its own 'position_ids' disagree with {said} at token "
                f"{token - int(self._table_lengths[:r].sum())}; {fix}"
            )

    def _check_seq_lengths(self, col: ListColumn) -> None:
        if col.flat_values().min(initial=1) <= 0:
            raise PackingError(
                "column 'seq_lengths' has an entry <= 0; every packed sequence needs >= 1 token. Re-pack the data."
            )
        fix = "re-pack the data or drop the 'seq_lengths' column."
        check_row_counts(
            col.row_sums(), self._table_lengths, "'seq_lengths' sum to {}", "'input_ids' has {} tokens", fix
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
    def _gather(self, rows: np.ndarray, mask_keys: Sequence[str]) -> FlatRows:
        """:meth:`gather` for dataset rows already checked (int64, in range)."""
        rows = rows if self._indices is None else self._indices[rows]
        row_lengths = self._table_lengths[rows]
        rows = rows[row_lengths > 0]
        row_lengths = row_lengths[row_lengths > 0].astype(np.int64)
        if rows.size == 0:
            raise PackingError("every row in the batch is empty; a batch needs at least one token.")
        total = int(row_lengths.sum())
        read = lambda name, dtype: self._source.whole_rows(name, rows, total, dtype)  # noqa: E731
        input_ids = read("input_ids", np.int64)
        labels = self._labels(input_ids, read, mask_keys)
        if self._seq_column is None:
            ones = np.ones(rows.shape[0], np.int64)
            return FlatRows(input_ids, labels, row_lengths, row_lengths, ones, unmarked_row=0)
        counts = self._seq_counts[rows]
        seg = self._source.whole_rows(SEQ_LENGTHS, rows, int(counts.sum()), np.int64)
        return FlatRows(input_ids, labels, row_lengths, seg, counts)


class ArrowCollator:
    """``collate_fn`` for a ``DataLoader`` over :class:`PackedRows` or a :class:`~packtools.batches.PackedView`.

    Takes row indices (what ``PackedRows`` yields) or the lazy rows a ``PackedView`` yields, and gathers the
    batch straight from the Arrow buffers; gives the same tensors as ``collator`` on the same rows read as
    Python lists.  Other rows (dicts) are passed to ``collator`` as they are.
    """

    def __init__(self, rows: Any, collator: PaddingFreeCollator) -> None:
        if not isinstance(rows, (PackedRows, PackedView)):
            raise PackingError(f"rows must be a PackedRows or a PackedView, got {type(rows).__name__}.")
        if not isinstance(collator, PaddingFreeCollator):
            raise PackingError(f"collator must be a PaddingFreeCollator, got {type(collator).__name__}.")
        if isinstance(rows, PackedView):  # PackedRows checked its table's columns itself
            check_table_columns(rows.column_names, collator.leave_out, "PaddingFreeCollator")
        self.rows = rows
        self.collator = collator

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        if len(items) and isinstance(items[0], PackedRow):
            view = items[0].view  # the view that made them (in a worker process: its copy)
            if not all(isinstance(r, PackedRow) and r.view is view for r in items):
                raise PackingError("the batch mixes rows of several PackedViews; collate rows of one view.")
            rows = np.fromiter((r.index for r in items), np.int64, len(items))  # checked by __getitems__
            return self.collator.collate_flat(view._gather(rows, self.collator.mask_keys))
        if len(items) and isinstance(items[0], Mapping):
            return self.collator(items)
        return self.collator.collate_flat(self.rows.gather(items, self.collator.mask_keys))
