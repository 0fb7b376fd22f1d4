"""The per-rank attention work of the context-parallel (CP) layout, and the balanced choice of chunk pairs.

Under CP size ``N`` each document of a row is padded to ``P``, a multiple of ``2N``, and cut into ``2N`` chunks of
``c = P / 2N`` tokens; a rank holds a head-tail pair, chunks ``k`` and ``2N - 1 - k``
(:mod:`packtools.batches.context_parallel`).  A rank's causal attention work is ``sum(t - doc_start + 1)`` over
the real query tokens it holds: :func:`rank_work` reads it from a layout, :func:`document_rank_work` computes it
in closed form per document, and :func:`pair_holders` chooses which rank holds which pair (``balance=True``): row
by row, document after document, the rank with the most work so far takes the lightest pair
(:func:`packtools.core.kernels.balance_pairs`).

>>> document_rank_work([8, 5, 5], 2).sum(axis=0).tolist(), work_imbalance([24, 42])  # pair k on rank k
([24, 42], 0.2727272727272727)
>>> document_rank_work([8, 5, 5], 2, row_starts=[0]).sum(axis=0).tolist()  # balanced
[33, 33]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.cp_budget import check_cp_size, cp_padded_lengths


def rank_work(layout: Any) -> list[int]:
    """Causal attention work per rank of a :class:`~packtools.batches.context_parallel.CPLayout`:
    ``sum(t - doc_start + 1)`` over the real query tokens it holds.

    >>> from packtools.batches.context_parallel import CPLayout
    >>> rank_work(CPLayout.build([8], 2))  # positions {0,1,6,7} and {2,3,4,5}: 1+2+7+8 and 3+4+5+6
    [18, 18]
    """
    _, pos, real = layout.padded_doc()
    work = np.where(real, pos + 1, 0)
    return [int(work[idx].sum()) for idx in layout.index]


def pair_holders(
    lengths: Sequence[int] | np.ndarray, cp_size: int, row_starts: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """``[documents, cp_size]``: the rank holding each document's chunk pair ``k`` under ``balance=True``,
    the documents of each row (``row_starts``, default one row) taken in order (see the module docstring).

    >>> pair_holders([8, 5, 5], 2).tolist()  # the second document's light pair 0 to rank 0, the third's to rank 1
    [[0, 1], [0, 1], [1, 0]]
    """
    return _holders(document_rank_work(lengths, cp_size), row_starts)


def _holders(pair_work: np.ndarray, row_starts: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """:func:`pair_holders` of the pairs' work ``pair_work`` (``[documents, cp_size]``, pair ``k`` in column ``k``)."""
    from ..core import kernels

    starts = np.asarray([0] if row_starts is None else row_starts, np.int64)
    bounds = np.ascontiguousarray(np.append(starts, pair_work.shape[0]), np.int64)
    return kernels.balance_pairs(np.ascontiguousarray(pair_work), bounds)


def document_rank_work(
    lengths: Sequence[int] | np.ndarray, cp_size: int, row_starts: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """``[documents, cp_size]``: the causal work of each document on each rank, in closed form (no layout).

    Rank ``r`` holds positions ``[k c, (k+1) c)`` and ``[(2N-1-k) c, (2N-k) c)`` of a document (``c = P / 2N``),
    the real ones below ``L``, with ``k = r``, or balanced (``row_starts`` given: each row's first document)
    the pair :func:`pair_holders` gives it; the work of positions ``[a, b)`` is ``S(b) - S(a)`` with
    ``S(x) = x (x+1) / 2``.

    >>> document_rank_work([8, 5], 2).tolist()
    [[18, 18], [3, 12]]
    >>> document_rank_work([8, 5, 5], 2, row_starts=[0]).tolist()  # balanced: rank 1 did more, takes less
    [[18, 18], [3, 12], [12, 3]]
    """
    cp_size = check_cp_size(cp_size)
    if row_starts is not None:  # the pairs' work, each moved to the rank that holds it
        work = document_rank_work(lengths, cp_size)
        out = np.empty_like(work)
        np.put_along_axis(out, _holders(work, row_starts), work, axis=1)
        return out
    n = np.asarray(lengths, np.int64).reshape(-1, 1)
    c = cp_padded_lengths(n, cp_size) // (2 * cp_size)
    r = np.arange(cp_size, dtype=np.int64).reshape(1, -1)

    def upto(x: np.ndarray) -> np.ndarray:
        x = np.minimum(x, n)
        return x * (x + 1) // 2

    head = upto((r + 1) * c) - upto(r * c)
    tail = upto((2 * cp_size - r) * c) - upto((2 * cp_size - 1 - r) * c)
    return head + tail


def work_imbalance(work: Sequence[int]) -> float:
    """The largest relative distance of a rank's work from the mean (0.0 = perfectly balanced)."""
    mean = float(np.mean(work)) if len(work) else 0.0
    return 0.0 if mean == 0 else float(max(abs(w - mean) for w in work) / mean)
