"""A length distribution: exact counts, percentiles, a log-spaced histogram and truncation queries.

:class:`LengthDistribution` holds the numbers; :class:`~packtools.profiling.LengthProfile` (its subclass, in
:mod:`packtools.profiling.profile`) adds what is computed from them with the planner: the tradeoff tables and
the ``max_length`` recommendation.  The tradeoff and recommendation modules take a distribution, so nothing
here imports them (no import circle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from ..core.plan import as_lengths
from ..errors import PackingError

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)


@dataclass(frozen=True, eq=False)
class LengthDistribution:
    """The length distribution of a dataset's sequences (one length per row, in dataset order).

    Statistics are over all rows, empty ones included.  A percentile ``pQ`` is the smallest length ``L``
    such that at least ``Q`` percent of the sequences have at most ``L`` tokens (an actual length).  The
    histogram counts non-empty sequences in log-spaced integer bins ``[hist_edges[i], hist_edges[i + 1])``.

    >>> p = LengthDistribution([3, 0, 10, 5, 5])
    >>> p.count, p.total_tokens, p.empty, p.min, p.max, p.mean
    (5, 23, 1, 0, 10, 4.6)
    >>> p.percentiles["p50"], p.percentiles["p90"]
    (5, 10)
    >>> p.tokens_kept(4), p.num_truncated(4)
    (15, 3)
    """

    lengths: np.ndarray = field(repr=False)
    name: str | None = None
    #: For packed input (a ``seq_lengths`` column): its rows, ``max_length`` and fill (:func:`packed_rows`).
    packed: dict[str, Any] | None = None
    count: int = field(init=False)
    total_tokens: int = field(init=False)
    empty: int = field(init=False)
    min: int = field(init=False)
    max: int = field(init=False)
    mean: float = field(init=False)
    percentiles: dict[str, int] = field(init=False)
    hist_edges: np.ndarray = field(init=False, repr=False)
    hist_counts: np.ndarray = field(init=False, repr=False)
    # distinct lengths, how many rows have each, and running sums (for exact O(log n) queries)
    _values: np.ndarray = field(init=False, repr=False)
    _cum_rows: np.ndarray = field(init=False, repr=False)
    _cum_tokens: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lens = as_lengths(self.lengths, "lengths").view()  # a view: the caller's array stays writable
        lens.setflags(write=False)
        n = int(lens.shape[0])
        hi = int(lens.max()) if n else 0
        if n and hi <= 4 * n + (1 << 16):  # a dense count array is cheaper than sorting
            counts = np.bincount(lens)
            values = np.flatnonzero(counts)
            counts = counts[values]
        else:
            values, counts = np.unique(lens, return_counts=True)
        cum_rows = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        cum_tokens = np.concatenate(([0], np.cumsum(values * counts))).astype(np.int64)
        s = object.__setattr__
        s(self, "lengths", lens)
        s(self, "_values", values.astype(np.int64))
        s(self, "_cum_rows", cum_rows)
        s(self, "_cum_tokens", cum_tokens)
        s(self, "count", n)
        s(self, "total_tokens", int(cum_tokens[-1]))
        s(self, "empty", int(counts[0]) if n and values[0] == 0 else 0)
        s(self, "min", int(values[0]) if n else 0)
        s(self, "max", hi)
        s(self, "mean", int(cum_tokens[-1]) / n if n else 0.0)
        s(self, "percentiles", {f"p{q:g}": self.percentile(q) for q in PERCENTILES})
        edges = log_edges(hi)
        s(self, "hist_edges", edges)
        below = cum_rows[np.searchsorted(values, edges, side="left")]  # rows shorter than each edge
        s(self, "hist_counts", np.diff(below))

    # -- exact queries on the distribution ---------------------------------------------------------
    def percentile(self, q: float) -> int:
        """Smallest length ``L`` with at least ``q`` percent of the sequences of length <= ``L``."""
        if not 0 < q <= 100:
            raise PackingError(f"percentile q={q!r} must be in (0, 100].")
        if self.count == 0:
            return 0
        need = max(1, math.ceil(Fraction(str(q)) * self.count / 100))
        return int(self._values[np.searchsorted(self._cum_rows, need, side="left") - 1])

    def num_truncated(self, max_length: int) -> int:
        """Sequences longer than ``max_length``."""
        i = np.searchsorted(self._values, max_length, side="right")
        return self.count - int(self._cum_rows[i])

    def tokens_kept(self, max_length: int) -> int:
        """Tokens left after cutting every sequence to ``max_length``: ``sum(min(length, max_length))``."""
        i = np.searchsorted(self._values, max_length, side="right")
        return int(self._cum_tokens[i]) + max_length * (self.count - int(self._cum_rows[i]))

    def tokens_kept_share(self, max_length: int) -> float:
        return self.tokens_kept(max_length) / self.total_tokens if self.total_tokens else 1.0

    # -- reports -------------------------------------------------------------------------------------
    @property
    def title(self) -> str:
        """``name: N sequences, T tokens`` (what plots use as a title)."""
        extra = f", {self.empty:,} empty" if self.empty else ""
        return f"{self.name or 'dataset'}: {self.count:,} sequences, {self.total_tokens:,} tokens{extra}"

    def summary(self) -> dict[str, Any]:
        """The statistics as a flat dict."""
        return {
            "name": self.name,
            "sequences": self.count,
            "tokens": self.total_tokens,
            "empty": self.empty,
            "min": self.min,
            "mean": self.mean,
            "max": self.max,
            **self.percentiles,
        }

    def to_text(self) -> str:
        """A short multi-line description, as the CLI prints it."""
        pct = "  ".join(f"{k}={v:,}" for k, v in self.percentiles.items())
        text = (
            f"{self.title}\n"
            f"length (tokens): min={self.min:,}  mean={self.mean:,.1f}  max={self.max:,}\n"
            f"percentiles: {pct}"
        )
        if self.packed:
            k = self.packed
            text += (
                f"\npacked input: {k['rows']:,} rows of max_length {k['max_length']:,} ({k['source']}), fill "
                f"{k['fill']:.2%}; profiled by its {self.count:,} sequences (seq_lengths), not by rows"
            )
            if k.get("split"):
                text += f" (packed with {k['split']}: a sequence cut in pieces counts as its pieces)"
            if k.get("truncated"):
                text += (
                    f"; {k['truncated']:,} sequences were truncated to max_length when packed: their lengths here "
                    f"are the truncated ones (profile the inputs for the whole lengths)"
                )
        return text

    def default_candidates(self) -> list[int]:
        """Powers of two from about the median length up to the first one that holds the longest sequence."""
        top = max(64, 1 << max(0, (self.max - 1).bit_length()))
        low = max(64, 1 << max(0, self.percentiles["p50"].bit_length() - 1))
        low = max(low, top >> 7)
        return [1 << e for e in range(low.bit_length() - 1, top.bit_length())]


def log_edges(max_length: int, per_decade: int = 12) -> np.ndarray:
    """Integer bin edges from 1 to ``max_length + 1``, evenly spaced on a log axis (small bins merged)."""
    top = max(1, int(max_length)) + 1
    k = max(1, math.ceil(per_decade * math.log10(top)))
    edges = np.unique(np.round(np.logspace(0.0, math.log10(top), k + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, top
    return np.unique(edges)
