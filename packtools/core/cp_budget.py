"""Rows budgeted for context parallelism (CP): the padding rule, plans at CP-padded lengths, the fit check.

Under CP size ``N`` every document is padded to ``P = ceil(L / 2N) * 2N`` tokens (:func:`cp_padded_lengths`, the
one rule: :mod:`packtools.batches.context_parallel` pads to it at batch time).  Packing for CP
(``pack_files(..., context_parallel=N)``, ``pack_dataset(..., context_parallel=N)``: :func:`plan_for_cp`) plans
every document (or piece) at ``P`` tokens, so that each row still fits ``max_length`` once the collator pads it;
the rows themselves carry real tokens only, and the padding is counted (:func:`cp_stats`).
:func:`check_rows_fit` holds rows packed any other way to ``max_length`` once padded.  ``max_length`` must be a
multiple of ``2N`` (:func:`check_context_parallel`); ``wrapped`` rows are one sequence each, so their plan is the
plain one (:func:`budgets`).  The options and what is refused: docs/pipeline.md.

>>> import numpy as np
>>> from packtools.core.plan import plan
>>> eff = np.array([5, 3, 2])  # at N=2: 8 + 4 + 4 tokens once padded
>>> p = to_real_plan(plan(cp_padded_lengths(eff, 2), 8), eff)
>>> [p.seq_lengths_of(r).tolist() for r in range(p.num_rows)], cp_stats(p, 2)["cp_padding_tokens"]
([[5], [3, 2]], 6)
>>> cp_stats(plan_for_cp(eff, 8, "wrapped", 2), 2)["cp_padding_tokens"]  # rows of 8 and 2 tokens: 2 pad
2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import PackingError
from .plan import PackPlan
from .plan import plan as make_plan
from .ragged import offsets_of


def check_cp_size(cp_size: object) -> int:
    """``cp_size`` as an int, refused by name unless a positive int (1: no context parallelism)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise PackingError(
            f"context_parallel must be a positive int (1: no context parallelism), got {cp_size!r}.",
            param="context_parallel",
        )
    return int(cp_size)


def cp_padded_lengths(lengths: Sequence[int] | np.ndarray, cp_size: int) -> np.ndarray:
    """The padding policy, in one place: each length rounded up to the next multiple of ``2 * cp_size``
    (int64; 0 stays 0, a document shorter than ``2N`` becomes ``2N``).  The CP layout pads to it at batch time
    and the planners (:func:`plan_for_cp`, ``pack_files(..., context_parallel=N)``) budget rows with it.

    >>> cp_padded_lengths([5, 2, 8, 0], 2).tolist()
    [8, 4, 8, 0]
    """
    chunks = 2 * check_cp_size(cp_size)
    return -(-np.asarray(lengths, np.int64) // chunks) * chunks


def check_context_parallel(cp_size: object, max_length: int) -> int:
    """``cp_size`` as an int, checked against ``max_length`` (see the module docstring; every strategy
    applies)."""
    n = check_cp_size(cp_size)
    if n == 1:
        return n
    if max_length % (2 * n):
        fit = max(max_length // (2 * n), 1) * 2 * n
        raise PackingError(
            f"context_parallel={n} pads every document to a multiple of {2 * n} tokens, and max_length="
            f"{max_length} is not one: a document of max_length tokens would not fit its row once padded. Use a "
            f"max_length that is a multiple of {2 * n} (e.g. {fit}).",
            param="max_length",
        )
    return n


def budgets(strategy: str, cp_size: int) -> bool:
    """Whether a plan of ``strategy`` is made at CP-padded lengths: its documents (``bfd`` / ``bfd_split``) are
    padded one by one under CP; a ``wrapped`` row is one sequence, padded as a whole (never over a ``max_length``
    that is a multiple of ``2N``)."""
    return cp_size > 1 and strategy != "wrapped"


def plan_for_cp(lengths: np.ndarray, max_length: int, strategy: str, cp_size: int) -> PackPlan:
    """The plan of ``lengths`` into rows of ``max_length`` that still fit once padded for ``cp_size``: planned at
    the CP-padded lengths, then cut back to the real tokens (:func:`to_real_plan`); with ``cp_size=1`` the plain
    plan.  Arguments checked by :func:`check_context_parallel` first.

    >>> p = plan_for_cp(np.array([5, 3, 2]), 8, "bfd", 2)
    >>> [p.seq_lengths_of(r).tolist() for r in range(p.num_rows)]
    [[5], [3, 2]]
    """
    n = check_context_parallel(cp_size, max_length)
    lengths = np.asarray(lengths, np.int64)
    if not budgets(strategy, n):
        return make_plan(lengths, max_length, strategy)
    return to_real_plan(make_plan(cp_padded_lengths(lengths, n), max_length, strategy), lengths)


def to_real_plan(budgeted: PackPlan, eff: np.ndarray) -> PackPlan:
    """The plan of the real tokens: every segment of ``budgeted`` (planned on padded lengths) cut back to the
    tokens its source has (``eff``).  Rows, order and segment starts are kept; the result is checked."""
    eff = np.asarray(eff, np.int64)
    stop = np.minimum(budgeted.seg_start + budgeted.seg_length, eff[budgeted.seg_source])
    real = stop - budgeted.seg_start
    if real.size and real.min() < 1:  # cannot happen with max_length a multiple of 2N (a piece starts < L)
        i = int(np.argmin(real))
        raise PackingError(
            f"internal: CP segment {i} of sequence {int(budgeted.seg_source[i])} holds only padding; please report."
        )
    return PackPlan(
        budgeted.max_length,
        budgeted.strategy,
        budgeted.seg_source,
        budgeted.seg_start,
        real,
        budgeted.row_offsets,
        eff,
    )


def cp_stats(p: PackPlan, cp_size: int) -> dict[str, Any]:
    """The padding the collator will add to the rows of ``p`` for ``cp_size``: the manifest's CP statistics (per
    document, or per row for ``wrapped``, whose rows are one sequence each: :func:`budgets`)."""
    capacity = p.num_rows * p.max_length
    if p.strategy == "wrapped":
        per_row = cp_padded_lengths(p.row_lengths, cp_size)
    elif p.num_segments and p.num_rows:
        per_row = np.add.reduceat(cp_padded_lengths(p.seg_length, cp_size), p.row_offsets[:-1])
    else:
        per_row = np.zeros(0, np.int64)
    pad = int(per_row.sum()) - p.tokens_kept
    longest = int(per_row.max()) if per_row.size else 0
    return {
        "context_parallel": cp_size,
        "cp_padding_tokens": pad,
        "cp_fill_lost": pad / capacity if capacity else 0.0,
        "fill_after_cp_padding": (p.tokens_kept + pad) / capacity if capacity else 1.0,
        "cp_longest_padded_row": longest,
    }


def check_rows_fit(seq_lengths: Any, cp_size: int, max_length: int, *, first_row: int = 0) -> None:
    """Refuse, by row, packed rows whose documents padded for CP size ``cp_size`` exceed ``max_length``.

    ``seq_lengths``: each row's document lengths -- a list of rows, or a ``seq_lengths`` Arrow list column (read
    as offsets and values, every row at once).  Rows packed for CP size ``K`` (``context_parallel=K``) fit any
    ``N`` dividing ``K``; others may not.  ``first_row``: the index of the first row given (for the message).

    >>> check_rows_fit([[3, 3]], 2, 8)
    >>> check_rows_fit([[3], [5, 3]], 2, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    packtools.errors.PackingError: row 1 (documents [5, 3], 8 tokens) is 12 tokens once padded ...
    """
    docs, counts = _documents_per_row(seq_lengths)
    if counts.size == 0:
        return
    starts = offsets_of(counts)
    padded = np.add.reduceat(np.append(cp_padded_lengths(docs, cp_size), 0), starts[:-1]) * (counts > 0)
    over = np.flatnonzero(padded > max_length)
    if over.size:
        row = int(over[0])
        lengths = docs[starts[row] : starts[row + 1]]
        raise PackingError(
            f"row {first_row + row} (documents {lengths.tolist()}, {int(lengths.sum())} tokens) is "
            f"{int(padded[row])} tokens once padded for context_parallel={cp_size}, over max_length={max_length}: "
            f"it was packed for another CP size (or without one). Pack it again with context_parallel={cp_size} "
            f"(pack_dataset(..., context_parallel={cp_size}), pack_files(..., context_parallel={cp_size}) / "
            f"packtools pack --context-parallel {cp_size}).",
            param="context_parallel",
        )


def _documents_per_row(seq_lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(every document's length, row after row; documents per row)`` of rows or an Arrow list column."""
    import pyarrow as pa

    if isinstance(seq_lengths, (pa.Array, pa.ChunkedArray)):
        from .arrow import read_list_column

        column = read_list_column(seq_lengths, "seq_lengths")
        return column.flat_values().astype(np.int64, copy=False), column.lengths()
    rows = [np.asarray(r, np.int64).reshape(-1) for r in seq_lengths]
    counts = np.array([r.size for r in rows], np.int64)
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), counts
