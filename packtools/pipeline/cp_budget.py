"""Offline packing for context parallelism: rows budgeted at their documents' CP-padded lengths.

``pack_files(..., context_parallel=N)`` / ``packtools pack --context-parallel N`` plans every document (or piece)
at ``P = ceil(L / 2N) * 2N`` tokens -- the padding the CP layout adds at batch time
(:func:`packtools.batches.context_parallel.cp_padded_lengths`, the one rule) -- so that each packed row still
fits ``max_length`` once :class:`~packtools.batches.ContextParallelCollator` pads it.

**The rows carry no padding.**  The written rows are real tokens only (the same columns, ``seq_lengths`` the real
document lengths); only *which* documents share a row changes.  The collator pads at batch time, so a row packed
offline is cut into exactly the shards (and gives exactly the loss) of the same documents packed at batch time,
and the same folder also trains without CP.  The padding is counted, never silent: ``cp_padding_tokens`` and
``cp_fill_lost`` (share of the rows' capacity) in the summary and the manifest's ``stats``.

What it asks of the options (refused by name otherwise):

* ``max_length`` a multiple of ``2N``: then any document of at most ``max_length`` tokens still fits after
  padding, so ``overlong`` (truncate, drop, split) and the turn-aware split (``split_at``) keep their meaning
  unchanged, and the pieces of ``bfd_split`` (``max_length`` tokens, a multiple of ``2N``) carry no padding;
* ``strategy`` ``bfd`` or ``bfd_split``: ``wrapped`` cuts one stream into full rows; under CP every piece it
  cuts becomes a document padded on its own, so its rows would no longer be full (use ``bfd_split``, which
  keeps every token too);
* not preference data (:mod:`packtools.pipeline.run` refuses it: pair rows are not budgeted offline;
  ``prepare_dpo_trainer(..., context_parallel=N)`` pads them at batch time).

Rows packed for ``K > 1`` fit every ``N`` dividing ``K`` (a multiple of ``2K`` is one of ``2N``); for another ``N`` the
collator given ``max_length`` refuses a row that does not fit, by row
(:func:`packtools.batches.context_parallel.check_rows_fit`).  ``context_parallel=1`` (the default) is no CP: the
plan and the output are those of a run without it.

>>> import numpy as np
>>> from packtools.core.plan import plan
>>> eff = np.array([5, 3, 2])  # at N=2: 8 + 4 + 4 tokens once padded
>>> p = to_real_plan(plan(budget_lengths(eff, 2), 8), eff)
>>> [p.seq_lengths_of(r).tolist() for r in range(p.num_rows)], cp_stats(p, 2)["cp_padding_tokens"]
([[5], [3, 2]], 6)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..batches.context_parallel import cp_padded_lengths
from ..core.plan import PackPlan
from ..errors import PackingError


def check_context_parallel(cp_size: object, max_length: int, strategy: str) -> int:
    """``cp_size`` as an int, checked against ``max_length`` and ``strategy`` (see the module docstring)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise PackingError(
            f"context_parallel must be a positive int (1: no context parallelism), got {cp_size!r}.",
            param="context_parallel",
        )
    n = int(cp_size)
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
    if strategy == "wrapped":
        raise PackingError(
            f"strategy='wrapped' with context_parallel={n}: wrapped cuts one stream into full rows, and under CP "
            f"every piece it cuts is padded to a multiple of {2 * n} on its own, so its rows are no longer full. "
            f"Use strategy='bfd_split' (it keeps every token too).",
            param="strategy",
        )
    return n


def budget_lengths(eff: np.ndarray, cp_size: int) -> np.ndarray:
    """What the planner packs: each row's length padded for ``cp_size`` (0 stays 0: not packed)."""
    return cp_padded_lengths(eff, cp_size)


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
    """The padding the collator will add to the rows of ``p`` for ``cp_size``: the manifest's CP statistics."""
    padded = cp_padded_lengths(p.seg_length, cp_size)
    capacity = p.num_rows * p.max_length
    pad = int(padded.sum()) - p.tokens_kept
    if p.num_segments:
        per_row = np.add.reduceat(padded, p.row_offsets[:-1]) if p.num_rows else np.zeros(0, np.int64)
        longest = int(per_row.max()) if per_row.size else 0
    else:
        longest = 0
    return {
        "context_parallel": cp_size,
        "cp_padding_tokens": pad,
        "cp_fill_lost": pad / capacity if capacity else 0.0,
        "fill_after_cp_padding": (p.tokens_kept + pad) / capacity if capacity else 1.0,
        "cp_longest_padded_row": longest,
    }
