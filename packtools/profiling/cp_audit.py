"""The per-rank cost audit of a context-parallel (CP) layout: causal attention work per rank, over packed rows.

For CP size ``N`` every document of a row is cut into ``2N`` chunks and rank ``r`` holds chunks ``k`` and
``2N - 1 - k`` (:mod:`packtools.batches.context_parallel`): with ``balance=True`` (the layout
``prepare_trainer(..., context_parallel=N)`` trains on) the pair each rank gets of each document is chosen by
the work the ranks have so far in the row, ``k = r`` without (the THD head-tail layout of Megatron-Core, for
external kernels).  A rank's attention work in a row is
``sum(t - doc_start + 1)`` over the real query tokens it holds (keys each query attends).  The ranks of a CP
group wait for each other in every layer, so a row costs its busiest rank: :class:`CPWorkAudit` reports the
work of each rank summed over the rows, the worst row's distance from its mean, the step time lost to
imbalance (``sum over rows of max rank work`` against ``sum of mean``) and the padding the layout adds.
A document's padding sits in its last chunk: with the fixed assignment every document's lost work is rank 0's,
which unbalances rows of many short documents; the balanced choice spreads it (the figures: docs/training.md).

>>> audit = audit_rows([8, 5, 16], [0, 2, 3], cp_size=2, balance=False)  # row 0: documents 8, 5; row 1: 16
>>> audit.work, audit.fill_lost, round(audit.worst_row, 3)
([89, 98], 3, 0.176)
>>> audit_rows([8, 5, 5], [0], 2, balance=False).work, audit_rows([8, 5, 5], [0], 2).work  # one row
([24, 42], [33, 33])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format import text_table
from ..batches.context_parallel import document_rank_work
from ..core.cp_budget import cp_padded_lengths
from ..errors import PackingError

#: Documents audited at once (a ``[documents, cp_size]`` int64 block each).
BLOCK_DOCUMENTS = 1 << 18


@dataclass(frozen=True)
class CPWorkAudit:
    """Causal attention work per CP rank over a set of packed rows (see the module docstring)."""

    cp_size: int
    balance: bool
    rows: int
    tokens: int
    fill_lost: int
    work: list[int]
    worst_row: float
    lost_to_imbalance: float

    @property
    def imbalance(self) -> float:
        """The largest distance of a rank's total work from the mean, relative to the mean."""
        mean = float(np.mean(self.work)) if self.work else 0.0
        return 0.0 if mean == 0 else max(abs(w - mean) for w in self.work) / mean

    def summary(self) -> dict[str, Any]:
        return {
            "cp_size": self.cp_size,
            "cp_layout": "balanced" if self.balance else "head-tail",
            "rows": self.rows,
            "work_per_rank": list(self.work),
            "imbalance": self.imbalance,
            "worst_row_imbalance": self.worst_row,
            "lost_to_imbalance": self.lost_to_imbalance,
            "cp_padding_tokens": self.fill_lost,
            "cp_padding_share": self.fill_lost / (self.tokens + self.fill_lost) if self.tokens else 0.0,
        }

    def to_text(self) -> str:
        mean = float(np.mean(self.work)) if self.work else 0.0
        cells = [["CP rank", "attention work", "vs mean"]]
        for r, w in enumerate(self.work):
            cells.append([str(r), f"{w:,}", f"{(w / mean - 1) * 100:+.2f}%" if mean else "-"])
        share = self.fill_lost / (self.tokens + self.fill_lost) if self.tokens else 0.0
        layout = "chunk pairs balanced per document" if self.balance else "head-tail, fixed (THD)"
        return (
            f"context parallelism, {self.cp_size} ranks ({layout}), {self.rows:,} rows: work = "
            f"sum(t - doc_start + 1) over the real query tokens of each rank\n"
            + text_table(cells)
            + f"\nworst row: {self.worst_row * 100:.2f}% off its mean; time lost to waiting for the busiest rank: "
            f"{self.lost_to_imbalance * 100:.2f}%; CP padding (fill lost): {self.fill_lost:,} tokens "
            f"({share * 100:.2f}%)"
        )


def audit_rows(
    seq_lengths: Sequence[int] | np.ndarray,
    row_offsets: Sequence[int] | np.ndarray,
    cp_size: int,
    *,
    balance: bool = True,
) -> CPWorkAudit:
    """Audit rows given as their documents' lengths and ``row_offsets`` (row ``i`` holds documents
    ``row_offsets[i]:row_offsets[i + 1]``; the last row runs to the end), each row one batch of the CP collator;
    ``balance``: the chunk pairs given to the ranks by their work (see the module docstring)."""
    lengths = np.asarray(seq_lengths, np.int64)
    starts = np.asarray(row_offsets, np.int64)
    if lengths.ndim != 1 or (lengths < 1).any():
        raise PackingError("seq_lengths must be positive document lengths.", param="seq_lengths")
    if starts.ndim != 1 or (starts.size and (starts[0] != 0 or (np.diff(starts) <= 0).any())):
        raise PackingError("row_offsets must start at 0 and increase strictly.", param="row_offsets")
    starts = starts[starts < lengths.size]
    ends = np.append(starts[1:], lengths.size)
    blocks = []  # rows in blocks of about BLOCK_DOCUMENTS documents: [documents, cp_size] stays small
    first = 0
    while first < starts.size:
        last = max(first + 1, int(np.searchsorted(starts, starts[first] + BLOCK_DOCUMENTS, "right")))
        lo, hi = int(starts[first]), int(ends[last - 1])
        rows = starts[first:last] - lo
        work = document_rank_work(lengths[lo:hi], cp_size, rows if balance else None)
        blocks.append(np.add.reduceat(work, rows, axis=0))
        first = last
    per_row = np.concatenate(blocks) if blocks else np.zeros((0, cp_size), np.int64)
    means = per_row.mean(axis=1) if starts.size else np.zeros(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        off = np.where(means > 0, np.abs(per_row - means[:, None]).max(axis=1) / means, 0.0)
    busiest, total_mean = float(per_row.max(axis=1).sum()), float(means.sum())
    padded = cp_padded_lengths(lengths, cp_size)
    return CPWorkAudit(
        cp_size=int(cp_size),
        balance=bool(balance),
        rows=int(starts.size),
        tokens=int(lengths.sum()),
        fill_lost=int((padded - lengths).sum()),
        work=[int(w) for w in per_row.sum(axis=0)],
        worst_row=float(off.max()) if off.size else 0.0,
        lost_to_imbalance=busiest / total_mean - 1 if total_mean else 0.0,
    )


def audit_plan(plan: Any, cp_size: int, *, balance: bool = True) -> CPWorkAudit:
    """Audit the rows of a :class:`~packtools.PackPlan` (its segments are the documents; a ``wrapped`` plan's
    rows are one sequence each)."""
    if getattr(plan, "strategy", None) == "wrapped":
        lengths = np.asarray(plan.row_lengths, np.int64)
        return audit_rows(lengths, np.arange(lengths.size), cp_size, balance=balance)
    return audit_rows(plan.seg_length, np.asarray(plan.row_offsets)[:-1], cp_size, balance=balance)


def work_stats(plan: Any, cp_size: int) -> dict[str, Any]:
    """The run summary's and manifest's CP work figures for ``plan`` under the layout ``prepare_trainer`` trains
    on (balanced), with the head-tail (THD) layout's worst row beside them."""
    balanced, head_tail = audit_plan(plan, cp_size), audit_plan(plan, cp_size, balance=False)
    return {
        "cp_work_imbalance": balanced.imbalance,
        "cp_worst_row_imbalance": balanced.worst_row,
        "cp_time_lost_to_imbalance": balanced.lost_to_imbalance,
        "cp_worst_row_imbalance_head_tail": head_tail.worst_row,
    }
