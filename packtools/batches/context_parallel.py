"""Context parallelism (CP) for padding-free rows: each document cut into ``2N`` chunks, two per rank.

With ``N`` ranks in a CP group a row is split **per document** (not as one sequence, which would let documents
attend to each other and give the ranks unequal causal work), in the head-tail layout of Megatron-Core's THD
format (the layout in words and figures: docs/training.md):

* document ``i`` of ``L_i`` tokens is padded to ``P_i``, the next multiple of ``2N``
  (:func:`~packtools.core.cp_budget.cp_padded_lengths`, the rule the CP planners share; a document shorter than
  ``2N`` becomes ``2N``), and cut into ``2N`` chunks; the rank holding pair ``k`` holds chunks ``k`` and
  ``2N - 1 - k`` (an early, cheap chunk and a late, expensive one), and a rank's row is its pair of every
  document in turn: ``sum(P_i) / N`` tokens on every rank (an all-gather of keys and values needs equal sizes);
* pair ``k`` is on rank ``k`` (the layout Megatron-Core / Transformer Engine THD kernels assume), or, with
  ``balance=True`` (what ``prepare_trainer(..., context_parallel=N)`` trains; exact only for
  :mod:`packtools.integrations.attention.context_parallel`, which reads the layout), on the rank
  :func:`pair_holders` picks, so that the padding at each document's end (lost work in chunk ``2N - 1``) is
  not all rank 0's;
* **padding** has ``pad_token_id``, no label and position ids restarting at 0, is attended by nothing and
  attends nothing (its attention output is 0); :attr:`CPLayout.fill_lost` counts it;
* every real token keeps its **true position** in its document, so RoPE and the causal rule see the positions
  the unsplit row would;
* labels are **shifted before the split** (``shift_labels[t]`` is the label of token ``t + 1`` of the same
  document, -100 at a document's last token and on padding), so the target of a chunk's last token, which
  lives on another rank, is not lost; the loss takes them without shifting again
  (:func:`packtools.integrations.parallel.shard_loss.shifted_token_loss`), and no ``labels`` key is emitted, so
  a loss that shifts ``labels`` cannot be run on these rows by mistake.

``cu_seqlens`` (``[0, L_0, L_0 + L_1, ...]``) and ``cu_seqlens_padded`` (``[0, P_0, P_0 + P_1, ...]``), int32
over the whole row, are the boundaries THD consumers take; rank ``r``'s tokens of document ``i`` start at
``cu_seqlens_padded[i] / N`` in its row.  A rank's causal attention work is ``sum(t - doc_start + 1)`` over the
real query tokens it holds (:func:`rank_work`, :func:`document_rank_work`).

>>> document_rank_work([8, 5, 5], 2).sum(axis=0).tolist(), work_imbalance([24, 42])  # pair k on rank k
([24, 42], 0.2727272727272727)
>>> document_rank_work([8, 5, 5], 2, row_starts=[0]).sum(axis=0).tolist()  # balanced
[33, 33]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import IGNORE_INDEX
from ..core.cp_budget import check_cp_size, check_rows_fit, cp_padded_lengths
from ..core.plan import check_max_length
from ..core.ragged import offsets_of
from ..errors import PackingError
from .collate import PaddingFreeCollator, to_tensors

#: The key under which a CP shard carries its :class:`CPLayout` to the attention function.
CP_KEY = "packtools_cp"


def _check_cp(cp_size: object, cp_rank: object = 0) -> tuple[int, int]:
    cp_size = check_cp_size(cp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise PackingError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}.", param="cp_rank")
    return int(cp_size), int(cp_rank)


@dataclass(frozen=True)
class CPLayout:
    """Where every token of one row goes under CP size ``cp_size`` (host-side NumPy, built once per batch).

    ``lengths``/``padded``: per document ``L_i`` and ``P_i``.  ``index[r]``: for each token of rank ``r``'s
    row, its place in the padded row (``cu_seqlens_padded`` coordinates).

    >>> lay = CPLayout.build([5, 2], 2)
    >>> lay.padded.tolist(), lay.cu_seqlens.tolist(), lay.cu_seqlens_padded.tolist(), lay.fill_lost
    ([8, 4], [0, 5, 7], [0, 8, 12], 5)
    >>> lay.index[0].tolist(), lay.index[1].tolist()  # chunks 0 and 3, then 1 and 2, of each document
    ([0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10])
    >>> bal = CPLayout.build([5, 2], 2, balance=True)  # rank 1 did more of the first: it takes the lighter pair
    >>> bal.index[0].tolist(), bal.index[1].tolist()
    ([0, 1, 6, 7, 9, 10], [2, 3, 4, 5, 8, 11])
    """

    cp_size: int
    lengths: np.ndarray
    padded: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    index: tuple[np.ndarray, ...] = field(repr=False)
    balance: bool = False

    @classmethod
    def build(cls, lengths: Sequence[int] | np.ndarray, cp_size: int, *, balance: bool = False) -> CPLayout:
        cp_size, _ = _check_cp(cp_size)
        lengths = np.asarray(lengths, np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise PackingError(
                f"CP layout needs one or more documents of at least one token, got lengths {lengths.tolist()}.",
                param="seq_lengths",
            )
        chunks = 2 * cp_size
        padded = cp_padded_lengths(lengths, cp_size)
        cu = offsets_of(lengths, np.int32)
        cu_padded = offsets_of(padded, np.int32)
        if int(cu_padded[-1]) != int(np.sum(padded)):
            raise PackingError("a CP row of more than 2**31 - 1 tokens does not fit int32 boundaries.")
        size = padded // chunks
        # pair[i, r]: the chunk pair rank r holds of document i (the inverse of pair_holders' rank of each pair)
        pair = (
            np.argsort(pair_holders(lengths, cp_size), axis=1)
            if balance
            else np.tile(np.arange(cp_size), (lengths.size, 1))
        )
        index = []
        for r in range(cp_size):
            parts = []
            for i, (start, c) in enumerate(zip(cu_padded[:-1].tolist(), size.tolist())):
                k = int(pair[i, r])  # the chunk pair (k, 2N - 1 - k) of rank r
                parts.append(np.arange(start + k * c, start + (k + 1) * c))
                parts.append(np.arange(start + (chunks - 1 - k) * c, start + (chunks - k) * c))
            index.append(np.concatenate(parts).astype(np.int64))
        return cls(cp_size, lengths, padded, cu, cu_padded, tuple(index), bool(balance))

    @property
    def fill_lost(self) -> int:
        """Padding tokens the layout adds to the row (``sum(P_i - L_i)``)."""
        return int((self.padded - self.lengths).sum())

    @property
    def local_tokens(self) -> int:
        """Tokens in every rank's row (``sum(P_i) / N``)."""
        return int(self.cu_seqlens_padded[-1]) // self.cp_size

    def padded_doc(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every place of the padded row: its document, its position in it, and whether it is real."""
        doc = np.repeat(np.arange(self.lengths.size), self.padded)
        pos = np.arange(int(self.cu_seqlens_padded[-1])) - self.cu_seqlens_padded[:-1].astype(np.int64)[doc]
        return doc, pos, pos < self.lengths[doc]

    def positions(self, rank: int) -> np.ndarray:
        """``rank``'s ``position_ids`` (int64): each real token's position in its document, padding's
        restarting at 0 after the document's last real token.

        >>> layout = CPLayout.build([5], 2)  # padded to 8: chunks 0, 3 on rank 0 and 1, 2 on rank 1
        >>> layout.positions(0).tolist(), layout.positions(1).tolist()
        ([0, 1, 1, 2], [2, 3, 4, 0])
        """
        doc, pos, real = self.padded_doc()
        idx = self.index[rank]
        return np.where(real[idx], pos[idx], pos[idx] - self.lengths[doc[idx]]).astype(np.int64)

    def source(self, rank: int) -> np.ndarray:
        """For each token of ``rank``'s row, its index in the unpadded row, or -1 for padding."""
        doc, pos, real = self.padded_doc()
        idx = self.index[rank]
        return np.where(real[idx], self.cu_seqlens[:-1].astype(np.int64)[doc[idx]] + pos[idx], -1)


@dataclass(frozen=True)
class CPShard:
    """One rank's share of a row, as the CP attention needs it: which local queries attend which keys.

    The keys of the whole row are all-gathered rank after rank (rank ``j``'s token ``t`` at ``j * T + t``,
    ``T`` = :attr:`CPLayout.local_tokens`).  Each attention segment is the real tokens of one chunk of one
    document (``q_index``: their places in this rank's row) against that document's real keys from its first
    token up to the chunk's last real token (``k_index``: places in the gathered keys), causal aligned to
    the bottom-right corner (the last query sees every key) -- the contract of FlashAttention varlen with
    ``seqlen_q <= seqlen_k``.  Padding tokens are in no segment: their output is 0.

    >>> sh = CPShard.build(CPLayout.build([5], 2), 1)  # rank 1: positions 2, 3 (chunk 1) and 4 (chunk 2)
    >>> sh.q_index.tolist(), sh.cu_q.tolist(), sh.k_index.tolist(), sh.cu_k.tolist()
    ([0, 1, 2], [0, 2, 3], [0, 1, 4, 5, 0, 1, 4, 5, 6], [0, 4, 9])
    """

    layout: CPLayout
    rank: int
    q_index: np.ndarray = field(repr=False)
    cu_q: np.ndarray = field(repr=False)
    k_index: np.ndarray = field(repr=False)
    cu_k: np.ndarray = field(repr=False)
    #: The parallel layout the shard was cut for (``packtools.integrations.RankLayout``: its CP group, size and
    #: rank), or ``None`` for a shard cut without one (the CP attention then uses the default process group).
    bound: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, layout: CPLayout, rank: int, bound: Any = None) -> CPShard:
        _, rank = _check_cp(layout.cp_size, rank)
        local = layout.local_tokens
        gathered = np.empty(int(layout.cu_seqlens_padded[-1]), np.int64)
        for j, idx in enumerate(layout.index):
            gathered[idx] = j * local + np.arange(local)
        doc, pos, real = layout.padded_doc()
        mine = layout.index[rank]
        chunk = pos[mine] // (layout.padded[doc[mine]] // (2 * layout.cp_size))
        q_parts, k_parts = [], []
        offsets = np.flatnonzero(real[mine])
        keys = (doc[mine] * (2 * layout.cp_size) + chunk)[offsets]
        cuts = np.flatnonzero(np.diff(keys)) + 1
        for group in np.split(offsets, cuts) if offsets.size else []:
            d = int(doc[mine[group[0]]])
            last = int(pos[mine[group[-1]]])
            start = int(layout.cu_seqlens_padded[d])
            q_parts.append(group)
            k_parts.append(gathered[start : start + last + 1])
        cu_q = offsets_of([q.size for q in q_parts], np.int32)
        cu_k = offsets_of([k.size for k in k_parts], np.int32)
        empty = np.zeros(0, np.int64)
        q_index = np.concatenate(q_parts).astype(np.int64) if q_parts else empty
        k_index = np.concatenate(k_parts).astype(np.int64) if k_parts else empty
        return cls(layout, rank, q_index, cu_q, k_index, cu_k, bound)

    @property
    def max_q(self) -> int:
        return int(np.diff(self.cu_q).max()) if self.cu_q.size > 1 else 0

    @property
    def max_k(self) -> int:
        return int(np.diff(self.cu_k).max()) if self.cu_k.size > 1 else 0


def shift_within_documents(labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``out[t] = labels[t + 1]`` inside each document, ``-100`` at every document's last token.

    >>> shift_within_documents(np.array([-100, 6, 7, -100, 9]), np.array([3, 2])).tolist()
    [6, 7, -100, 9, -100]
    """
    out = np.full_like(labels, IGNORE_INDEX)
    out[:-1] = labels[1:]
    ends = np.cumsum(lengths) - 1
    out[ends] = IGNORE_INDEX
    return out


def shard_row(
    input_ids: np.ndarray,
    labels: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    cp_size: int,
    cp_rank: int,
    pad_token_id: int,
    *,
    layout: CPLayout | None = None,
    balance: bool = False,
    bound: Any = None,
) -> dict[str, Any]:
    """Rank ``cp_rank``'s share of one padding-free row (1-D ``input_ids``/``labels``, unshifted labels);
    ``balance``: the documents' chunk pairs given to the ranks by their work (see the module docstring);
    ``bound``: the parallel layout the shard is cut for (carried by the shard, read by the CP attention).

    >>> b = shard_row(np.arange(10, 17), np.arange(10, 17), [5, 2], 2, 1, pad_token_id=0)
    >>> b["input_ids"].tolist(), b["position_ids"].tolist(), b["shift_labels"].tolist()
    ([[12, 13, 14, 0, 16, 0]], [[2, 3, 4, 0, 1, 0]], [[13, 14, -100, -100, -100, -100]])
    """
    cp_size, cp_rank = _check_cp(cp_size, cp_rank)
    lay = CPLayout.build(lengths, cp_size, balance=balance) if layout is None else layout
    input_ids, labels = np.asarray(input_ids).reshape(-1), np.asarray(labels).reshape(-1)
    if input_ids.shape != labels.shape or input_ids.shape[0] != int(lay.cu_seqlens[-1]):
        raise PackingError(
            f"input_ids ({input_ids.shape[0]} tokens) and labels ({labels.shape[0]}) must both hold the "
            f"{int(lay.cu_seqlens[-1])} tokens of seq_lengths.",
            param="seq_lengths",
        )
    shifted = shift_within_documents(labels.astype(np.int64), lay.lengths)
    src = lay.source(cp_rank)
    real = src >= 0
    take = np.where(real, src, 0)
    positions = lay.positions(cp_rank)
    return {
        "input_ids": np.where(real, input_ids[take], pad_token_id).astype(np.int64)[None],
        "position_ids": positions.astype(np.int64)[None],
        "shift_labels": np.where(real, shifted[take], IGNORE_INDEX).astype(np.int64)[None],
        "cu_seqlens": lay.cu_seqlens,
        "cu_seqlens_padded": lay.cu_seqlens_padded,
        "cp_size": cp_size,
        "cp_rank": cp_rank,
        CP_KEY: CPShard.build(lay, cp_rank, bound),
    }


class ContextParallelCollator:
    """A padding-free collator whose batch is cut for one rank of a CP group (see the module docstring).

    ``inner`` builds the padding-free row of the whole batch (a
    :class:`~packtools.batches.PaddingFreeCollator`); every rank of the CP group must call it on the same
    features (the same batch), and keeps its share.  Keys: ``input_ids``, ``position_ids``, ``shift_labels``
    (already shifted: no ``labels``), ``cu_seqlens``, ``cu_seqlens_padded`` (int32), ``cp_size``, ``cp_rank``,
    :data:`CP_KEY` (the :class:`CPShard`, which the CP attention reads) and ``use_cache=False``
    (``return_use_cache=False`` leaves it out), as every packtools collator whose batch can go to
    ``model(**batch)``: ``packtools_cp`` attends per document from the shard's layout whatever the mask, so a
    cache lets nothing attend across documents there, but it would be built and filled for nothing.

    ``balance``: each document's chunk pairs given to the ranks by their work (see the module docstring).

    ``layout``: the run's ``packtools.integrations.RankLayout``; given, the CP size, rank and balance choice are
    its own (``cp_size``/``cp_rank``/``balance`` are then left out) and every shard carries it, so the CP
    attention gathers over its group and refuses a shard cut for another layout.

    ``max_length``: the packed rows' length (the ``max_length`` they were packed with).  Given, a batch whose
    documents padded for ``cp_size`` do not fit it is refused by row (:func:`~packtools.core.cp_budget.check_rows_fit`).

    >>> from packtools import PaddingFreeCollator
    >>> c = ContextParallelCollator(PaddingFreeCollator(0), cp_size=2, cp_rank=0, return_tensors="np")
    >>> c([{"input_ids": [5, 6, 7, 8], "seq_lengths": [4]}])["shift_labels"].tolist()
    [[6, -100]]
    """

    def __init__(
        self,
        inner: Any,
        cp_size: int | None = None,
        cp_rank: int | None = None,
        *,
        return_tensors: str = "pt",
        max_length: int | None = None,
        balance: bool = False,
        layout: Any = None,
        return_use_cache: bool = True,
    ) -> None:
        self.return_use_cache = bool(return_use_cache)
        if layout is not None:
            if cp_size is not None or cp_rank is not None:
                raise PackingError(
                    "ContextParallelCollator takes either layout= (the run's RankLayout) or cp_size and cp_rank, "
                    "not both: the layout owns the CP size, rank and balance choice.",
                    param="layout",
                )
            cp_size, cp_rank, balance = layout.cp_size, layout.cp_rank, layout.balance
        self.cp_size, self.cp_rank = _check_cp(cp_size, 0 if cp_rank is None else cp_rank)
        self.balance = bool(balance)
        self.layout = layout
        if max_length is not None:
            max_length = check_max_length(max_length)
        self.max_length = max_length
        if return_tensors not in ("pt", "np"):
            raise PackingError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}.")
        if not isinstance(inner, PaddingFreeCollator) or not inner.padding_free:
            raise PackingError(
                "ContextParallelCollator needs a padding-free PaddingFreeCollator as inner collator "
                f"(got {type(inner).__name__}); CP shards one flat row per batch.",
                param="inner",
            )
        shaped = {
            k: getattr(inner, k)
            for k in ("pad_to_buckets", "pad_cu_seq_lens_to")
            if getattr(inner, k, None) is not None
        }
        if shaped:
            raise PackingError(
                f"ContextParallelCollator's inner PaddingFreeCollator has {shaped}: static-shape padding that CP cannot keep: it would become one "
                f"more document (or empty ones), padded again for CP and split across the ranks, so the shards' shapes would "
                f"still follow the documents (the static shapes these options exist for are lost). CP pads each "
                f"document to a multiple of 2 x cp_size itself (pad_to_multiple_of is kept: its padding is "
                f"one more document); build the inner collator without "
                f"{sorted(shaped)}.",
                param="inner",
            )
        self.inner = inner.replace(return_tensors="np", return_flash_attn_kwargs=True)
        self.pad_token_id = int(self.inner.pad_token_id)
        self.return_tensors = return_tensors

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        if self.max_length is not None:
            check_rows_fit([_documents(f) for f in features], self.cp_size, self.max_length)
        batch = self.inner(features)
        cu = np.asarray(batch["cu_seq_lens_q"], np.int64)
        out = shard_row(
            batch["input_ids"],
            batch["labels"],
            np.diff(cu),
            self.cp_size,
            self.cp_rank,
            self.pad_token_id,
            balance=self.balance,
            bound=self.layout,
        )
        if self.return_use_cache:
            out["use_cache"] = False
        return to_tensors(out, self.return_tensors)


def _documents(feature: Any) -> list[int]:
    """A feature's document lengths: its ``seq_lengths``, else one document of all its ``input_ids``."""
    lengths = feature.get("seq_lengths") if hasattr(feature, "get") else None
    if lengths is None:
        return [len(feature["input_ids"])]
    return np.asarray(lengths, np.int64).reshape(-1).tolist()


# -- cp work -------------------------------------------------------------------------------------------------
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
