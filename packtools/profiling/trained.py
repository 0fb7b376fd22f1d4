"""Where the trained (label) tokens of a dataset are: what ``bfd`` keeps of them at a ``max_length``, and the
compute spent on sequences that train nothing.

A token is *trained* when its label is not -100 and it is not its sequence's first token (a padding-free
batch masks every sequence's first label).  :class:`TrainedTokens` holds, for every position ``p >= 1``, how
many trained tokens sit there over all sequences, and each sequence's first trained position, so that for any
``max_length`` ``m``:

- ``kept_by_bfd(m)``: the trained tokens in the first ``m`` tokens of every sequence (what truncation keeps);
- ``idle_under_bfd(m)``: the sequences whose first ``m`` tokens hold no trained token, and their kept tokens
  (compute that trains nothing).

``bfd_split`` on such rows in ``packtools pack`` cuts at turn ends and keeps every trained token but the first
token of a piece cut inside a turn (:mod:`packtools.pipeline.turn_split`); its pieces without a trained token
are dropped, so it spends compute only on the input's own rows without one (:meth:`rows_without`).

>>> import pyarrow as pa
>>> t = TrainedTokens.from_labels(pa.chunked_array([pa.array([[-100, -100, 5, 6], [-100, 7], [-100, -100]])]))
>>> t.total, t.kept_by_bfd(2), t.kept_by_bfd(3), t.idle_under_bfd(2), t.rows_without()
(3, 1, 2, (2, 4), (1, 2))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..batches.flatten import restart_positions
from ..constants import IGNORE_INDEX
from ..core.arrow import read_list_column


@dataclass(frozen=True, eq=False)
class TrainedTokens:
    """Trained tokens by position (``at[p]``: how many at position ``p``), each sequence's first trained position
    (its length if none) and its length."""

    at: np.ndarray
    first: np.ndarray
    lengths: np.ndarray
    _cum: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cum", np.concatenate([[0], np.cumsum(self.at, dtype=np.int64)]))

    @classmethod
    def from_labels(cls, labels: pa.ChunkedArray | pa.Array) -> TrainedTokens:
        """From a ``labels`` list column (-100 where nothing is learned)."""
        col = read_list_column(
            labels if isinstance(labels, pa.ChunkedArray) else pa.chunked_array([labels]), "labels"
        )
        parts = []
        for chunk in col.chunks:
            off = chunk.offsets.astype(np.int64)
            n = np.diff(off)
            values = chunk.values[off[0] : off[-1]]
            pos = restart_positions(n)  # each label's place in its row
            trained = (values != IGNORE_INDEX) & (pos > 0)
            first = n.copy()
            rows = np.repeat(np.arange(n.shape[0]), n)[trained]
            np.minimum.at(first, rows, pos[trained])
            parts.append(cls(np.bincount(pos[trained], minlength=1), first, n))
        return cls.combine(parts)

    @classmethod
    def combine(cls, parts: list[TrainedTokens]) -> TrainedTokens:
        """The trained tokens of ``parts`` (consecutive pieces of one dataset) taken as one."""
        size = max((p.at.shape[0] for p in parts), default=1)
        at = np.zeros(size, np.int64)
        for p in parts:
            at[: p.at.shape[0]] += p.at
        first = np.concatenate([p.first for p in parts]) if parts else np.zeros(0, np.int64)
        lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
        return cls(at, first, lengths)

    @property
    def total(self) -> int:
        return int(self._cum[-1])

    def kept_by_bfd(self, max_length: int) -> int:
        """Trained tokens in the first ``max_length`` tokens of every sequence."""
        return int(self._cum[min(max_length, self._cum.shape[0] - 1)])

    def idle_under_bfd(self, max_length: int) -> tuple[int, int]:
        """``(sequences, tokens kept)`` of the sequences whose first ``max_length`` tokens train nothing."""
        kept = np.minimum(self.lengths, max_length)
        idle = (kept > 0) & (self.first >= kept)
        return int(idle.sum()), int(kept[idle].sum())

    def rows_without(self) -> tuple[int, int]:
        """``(sequences, tokens)`` of the non-empty sequences without any trained token (nothing cut)."""
        return self.idle_under_bfd(np.iinfo(np.int64).max)

    def to_text(self) -> str:
        tokens = int(self.lengths.sum())
        rows, idle = self.rows_without()
        share = self.total / tokens if tokens else 0.0
        return (
            f"trained tokens (labels, after each sequence's first token): {self.total:,} of {tokens:,} "
            f"({share:.1%}); sequences without one: {rows:,} ({idle:,} tokens, compute that trains nothing)"
        )
