"""Packing plans: which tokens of which sequence go where, computed from lengths alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa

from .._lazy import lazy_module
from ..errors import PackingError
from .arrow import numeric_array
from .plan_file import PLAN_ARRAYS, read_plan, write_plan
from .ragged import offsets_of

if TYPE_CHECKING:
    from . import kernels
else:  # Numba is imported when a kernel first runs
    kernels = lazy_module("packtools.core.kernels")

Strategy = Literal["bfd", "bfd_split", "wrapped"]
STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")
MAX_TREE_LENGTH = 2**27  # bfd's tables take ~64 bytes per unit of max_length
_VIOLATIONS = {
    1: "row_offsets must start at 0, never decrease and end at the number of segments (broken at row {i})",
    2: "segment {i} is empty (seg_length {length}); segments hold at least one token",
    3: "segment {i} reads sequence {source}, outside the {n} sequences of source_lengths",
    4: "segment {i} reads tokens {start}:{stop} of sequence {source}, which has {seq_len} tokens",
    5: "row {i} holds {row_len} tokens, more than max_length={max_length}",
    6: "segment {i} overlaps another segment of sequence {source} (tokens {start}:{stop})",
}


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise PackingError(
            f"strategy={strategy!r} is not a packing strategy; use one of {', '.join(STRATEGIES)}."
        )
    return strategy


def check_max_length(max_length: object) -> int:
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
        raise PackingError(
            f"max_length must be a positive int, got {max_length!r} ({type(max_length).__name__}).",
            param="max_length",
        )
    if max_length < 1:
        raise PackingError(f"max_length must be >= 1, got {max_length}.", param="max_length")
    return int(max_length)


def as_lengths(lengths: object, name: str = "lengths") -> np.ndarray:
    """Validate and cast sequence lengths to a C-contiguous int64 array."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise PackingError(f"{name} must be a 1-D array of sequence lengths, got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PackingError(f"{name} must hold integers, got dtype {arr.dtype}.")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size and arr.min() < 0:
        row = int(np.argmin(arr))
        raise PackingError(f"{name}[{row}] = {arr[row]} is negative; lengths count tokens and must be >= 0.")
    return arr


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Where every kept token goes, as plain NumPy arrays.

    Rows are made of *segments*: segment ``s`` copies ``seg_length[s]`` tokens of sequence ``seg_source[s]``
    starting at token ``seg_start[s]``.  Row ``r`` holds segments ``row_offsets[r]:row_offsets[r + 1]`` in
    order.  A plan depends only on lengths, so it is cheap, and it can be saved and reused.

    >>> p = plan([5, 2, 3, 1], max_length=4)
    >>> p.num_rows, p.fill, p.tokens_dropped
    (3, 0.8333333333333334, 1)
    >>> [p.seq_lengths_of(r).tolist() for r in range(p.num_rows)]
    [[4], [3, 1], [2]]
    """

    max_length: int
    strategy: str
    seg_source: np.ndarray
    seg_start: np.ndarray
    seg_length: np.ndarray
    row_offsets: np.ndarray
    source_lengths: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        """Check every invariant the gather kernels rely on; raise :class:`PackingError` on the first broken one."""
        check_strategy(self.strategy)
        object.__setattr__(self, "max_length", check_max_length(self.max_length))
        for name in PLAN_ARRAYS:
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise PackingError(
                    f"PackPlan.{name} must be a 1-D integer array, got {arr.dtype} {arr.shape}."
                )
            object.__setattr__(self, name, np.ascontiguousarray(arr, dtype=np.int64))
        n = self.seg_length.shape[0]
        if self.seg_source.shape[0] != n or self.seg_start.shape[0] != n:
            raise PackingError(
                f"PackPlan: seg_source, seg_start and seg_length must have one entry per segment, got "
                f"{self.seg_source.shape[0]}, {self.seg_start.shape[0]} and {n}."
            )
        code, i = kernels.plan_violation(
            self.seg_source,
            self.seg_start,
            self.seg_length,
            self.row_offsets,
            self.source_lengths,
            self.max_length,
        )
        if code:
            self._fail(int(code), int(i))
        self._check_strategy_rule()

    @classmethod
    def _unchecked(
        cls,
        max_length: int,
        strategy: str,
        segments: tuple[np.ndarray, np.ndarray, np.ndarray],
        row_offsets: np.ndarray,
        source_lengths: np.ndarray,
    ) -> PackPlan:
        """A plan straight from the kernels (or a row transform of a checked plan): sound by construction.

        ``segments`` is ``(seg_source, seg_start, seg_length)``.  The kernels are tested against the
        pure-Python oracle (``core/reference.py``); checking their output again would double the cost of
        :func:`plan`.  Everything else goes through the checks.
        """
        self = object.__new__(cls)
        values = (max_length, strategy, *segments, row_offsets, source_lengths)
        for name, value in zip(("max_length", "strategy", *PLAN_ARRAYS), values):
            if isinstance(value, np.ndarray):
                value = np.ascontiguousarray(value, dtype=np.int64)
            object.__setattr__(self, name, value)
        return self

    def _fail(self, code: int, i: int) -> None:
        facts: dict[str, object] = {"i": i, "max_length": self.max_length, "n": self.num_sequences}
        if code in (2, 3, 4, 6):
            source, start, length = int(self.seg_source[i]), int(self.seg_start[i]), int(self.seg_length[i])
            facts.update(source=source, start=start, stop=start + length, length=length)
            if 0 <= source < self.num_sequences:
                facts["seq_len"] = int(self.source_lengths[source])
        if code == 5:
            facts["row_len"] = int(self.row_lengths[i])
        raise PackingError(f"invalid PackPlan: {_VIOLATIONS[code].format(**facts)}.")

    def _check_strategy_rule(self) -> None:
        m, lens = self.max_length, self.source_lengths[self.seg_source]
        if self.strategy == "bfd":  # the first max_length tokens of a sequence, in one segment
            bad = (self.seg_start != 0) | (self.seg_length != np.minimum(lens, m))
            rule = "bfd keeps the first min(length, max_length) tokens of a sequence as one segment"
        elif self.strategy == "bfd_split":  # chunks [k*m, (k+1)*m) of the sequence
            bad = (self.seg_start % m != 0) | (self.seg_length != np.minimum(lens - self.seg_start, m))
            rule = "bfd_split segments are the max_length chunks of a sequence"
        else:  # every row full but at most one
            short = np.flatnonzero(self.row_lengths != m)
            if short.shape[0] > 1:
                raise PackingError(
                    f"invalid PackPlan: wrapped rows are all max_length={m} tokens long but one; rows "
                    f"{short[0]} and {short[1]} are {self.row_lengths[short[0]]} and {self.row_lengths[short[1]]}."
                )
            return
        if bad.any():
            i = int(np.argmax(bad))
            raise PackingError(
                f"invalid PackPlan: segment {i} (tokens {self.seg_start[i]}:{self.seg_start[i] + self.seg_length[i]} "
                f"of sequence {self.seg_source[i]}, length {lens[i]}) breaks the {self.strategy!r} rule: {rule}."
            )

    def check_complete(self) -> None:
        """Raise :class:`PackingError` unless the plan places every token its strategy keeps.

        With the per-segment rules and no overlap checked at construction, equal totals mean exact coverage.
        """
        lens = self.source_lengths
        expected = int(np.minimum(lens, self.max_length).sum()) if self.strategy == "bfd" else int(lens.sum())
        if self.tokens_kept != expected:
            raise PackingError(
                f"invalid PackPlan: it places {self.tokens_kept:,} tokens but {self.strategy!r} keeps "
                f"{expected:,} of these sequences; the plan is partial (a slice?) or was edited."
            )

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        """Sequences in the input, empty ones included."""
        return int(self.source_lengths.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0] - 1)

    @property
    def num_segments(self) -> int:
        return int(self.seg_length.shape[0])

    @property
    def num_empty(self) -> int:
        """Empty input sequences; they produce no segment."""
        return int(np.count_nonzero(self.source_lengths == 0))

    @property
    def tokens_in(self) -> int:
        return int(self.source_lengths.sum())

    @property
    def tokens_kept(self) -> int:
        return int(self.seg_length.sum())

    @property
    def tokens_dropped(self) -> int:
        return self.tokens_in - self.tokens_kept

    @property
    def lower_bound(self) -> int:
        """Fewest rows that could hold the kept tokens: ``ceil(tokens_kept / max_length)``."""
        return -(-self.tokens_kept // self.max_length)

    @property
    def fill(self) -> float:
        """Tokens kept / (rows * max_length); 1.0 for no rows."""
        return self.tokens_kept / (self.num_rows * self.max_length) if self.num_rows else 1.0

    # -- per row ---------------------------------------------------------------------------------
    @property
    def row_lengths(self) -> np.ndarray:
        """Tokens in each packed row."""
        csum = np.concatenate(([0], np.cumsum(self.seg_length)))
        return csum[self.row_offsets[1:]] - csum[self.row_offsets[:-1]]

    @property
    def token_offsets(self) -> np.ndarray:
        """Start of each row in the packed token stream (``num_rows + 1`` values)."""
        return np.concatenate(([0], np.cumsum(self.row_lengths))).astype(np.int64)

    @property
    def seg_dest(self) -> np.ndarray:
        """Start of each segment in the packed token stream."""
        return offsets_of(self.seg_length)[:-1]

    def seq_lengths_of(self, row: int) -> np.ndarray:
        """Lengths of the segments that make up ``row``."""
        return self.seg_length[self.row_offsets[row] : self.row_offsets[row + 1]]

    @property
    def seq_lengths(self) -> pa.ListArray:
        """Per-row segment lengths as an Arrow ``list<int32>`` array (the ``seq_lengths`` column)."""
        return pa.ListArray.from_arrays(  # from buffers: pa.array(ndarray) imports pandas
            numeric_array(self.row_offsets.astype(np.int32), pa.int32()),
            numeric_array(self.seg_length.astype(np.int32), pa.int32()),
        )

    # -- transforms ------------------------------------------------------------------------------
    def shuffled(self, seed: int = 0) -> PackPlan:
        """The same rows in a random order, deterministic for ``seed``."""
        perm = np.random.default_rng(seed).permutation(self.num_rows)
        counts = np.diff(self.row_offsets)[perm]
        new_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        # Segment indices of the permuted rows, in order.
        starts = self.row_offsets[:-1][perm]
        idx = np.repeat(starts - new_offsets[:-1], counts) + np.arange(self.num_segments)
        return PackPlan._unchecked(
            self.max_length,
            self.strategy,
            (self.seg_source[idx], self.seg_start[idx], self.seg_length[idx]),
            new_offsets,
            self.source_lengths,
        )

    def slice_rows(self, start: int, stop: int) -> PackPlan:
        """Rows ``start:stop`` as a plan of their own over the same sequences.

        >>> plan([5, 2, 3, 1], max_length=4).slice_rows(1, 3).row_lengths.tolist()
        [4, 2]
        """
        s0, s1 = int(self.row_offsets[start]), int(self.row_offsets[stop])
        return PackPlan._unchecked(
            self.max_length,
            self.strategy,
            (self.seg_source[s0:s1], self.seg_start[s0:s1], self.seg_length[s0:s1]),
            self.row_offsets[start : stop + 1] - s0,
            self.source_lengths,
        )

    def row_blocks(self, max_tokens: int) -> list[tuple[int, int]]:
        """Consecutive row ranges ``(start, stop)`` of at most ``max_tokens`` tokens (at least one row each).

        >>> plan([5, 2, 3, 1], max_length=4).row_blocks(8)
        [(0, 2), (2, 3)]
        """
        csum = np.concatenate(([0], np.cumsum(self.row_lengths)))
        blocks, row = [], 0
        while row < self.num_rows:
            stop = max(int(np.searchsorted(csum, csum[row] + max_tokens, side="right")) - 1, row + 1)
            blocks.append((row, stop))
            row = stop
        return blocks

    def summary(self) -> dict[str, float | int | str]:
        """The plan's statistics as a flat dict (what the CLI prints)."""
        return {
            "strategy": self.strategy,
            "max_length": self.max_length,
            "rows_in": self.num_sequences,
            "empty": self.num_empty,
            "rows_out": self.num_rows,
            "lower_bound": self.lower_bound,
            "rows_over_bound": self.num_rows - self.lower_bound,
            "tokens_in": self.tokens_in,
            "tokens_kept": self.tokens_kept,
            "tokens_dropped": self.tokens_dropped,
            "fill": self.fill,
        }

    # -- persistence: the .npz file of a plan (``core/plan_file.py``) -------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` (``.npz``) atomically."""
        write_plan(path, self.max_length, self.strategy, [getattr(self, name) for name in PLAN_ARRAYS])

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, complete: bool = True) -> PackPlan:
        """Read a plan written by :meth:`save`, checking it (format version, invariants, completeness).

        A plan saved as a slice of rows (:meth:`slice_rows`) is partial; load it with ``complete=False``.
        """
        max_length, strategy, arrays = read_plan(path)
        loaded = cls(max_length, strategy, *arrays)
        if complete:
            loaded.check_complete()
        return loaded


def plan(lengths: object, max_length: int, strategy: Strategy | str = "bfd") -> PackPlan:
    """Plan how to pack sequences of the given lengths into rows of at most ``max_length`` tokens.

    ``bfd`` keeps the first ``max_length`` tokens of each sequence and packs them best-fit decreasing;
    ``bfd_split`` first cuts longer sequences into ``max_length`` chunks so every token is kept;
    ``wrapped`` concatenates everything in order and cuts every ``max_length`` tokens.
    Empty sequences are dropped (counted in :attr:`PackPlan.num_empty`).

    >>> p = plan([5, 2, 3, 1], max_length=4, strategy="bfd_split")
    >>> p.num_rows, p.tokens_dropped, p.lower_bound
    (3, 0, 3)
    >>> plan([5, 2, 3, 1], 4, "wrapped").row_lengths.tolist()
    [4, 4, 3]
    """
    strategy = check_strategy(strategy)
    max_length = check_max_length(max_length)
    lens = as_lengths(lengths)
    if strategy == "wrapped":
        source, start, size, row_offsets = kernels.wrapped_segments(lens, max_length)
        return PackPlan._unchecked(max_length, strategy, (source, start, size), row_offsets, lens)
    source, start, size = kernels.make_items(lens, max_length, strategy == "bfd_split")
    if max_length >= size.sum():
        # Everything fits in one row (best fit puts every item there, longest first); this also spares
        # the kernel's O(max_length) tables when max_length is huge.
        order = np.argsort(-size, kind="stable")
        row_offsets = np.array([0, size.shape[0]] if size.shape[0] else [0], np.int64)
    else:
        if max_length > MAX_TREE_LENGTH:
            raise PackingError(
                f"max_length={max_length:,} needs about {64 * max_length / 2**30:.1f} GiB of planning tables; "
                f"packtools plans rows of at most {MAX_TREE_LENGTH:,} tokens. Use a smaller max_length."
            )
        order, row_offsets = kernels.bfd_assign(size, max_length)
    segments = (source[order], start[order], size[order])
    return PackPlan._unchecked(max_length, strategy, segments, row_offsets, lens)


class WholeLengths(np.ndarray):
    """Lengths of samples that are packed whole, a longer one refused (vision samples,
    :func:`packtools.integrations.multimodal.processor.vision_lengths`): a NumPy int array marking them, so
    that :func:`packtools.profile_lengths` of them is a ``whole`` profile, whose ``recommend()`` holds every
    sample.

    >>> from packtools import profile_lengths
    >>> lengths = np.array([10, 700]).view(WholeLengths)
    >>> profile_lengths(lengths).recommend().max_length
    704

    A reduction gives the plain NumPy scalar, as on any int array (``max_length=lengths.max()`` is an int):

    >>> type(lengths.max()).__name__, check_max_length(lengths.max())
    ('int64', 700)
    """

    def __array_wrap__(self, obj: Any, context: Any = None, return_scalar: bool = False) -> Any:
        if getattr(obj, "ndim", 1) == 0:  # max(), sum(), ...: a scalar, not a 0-d WholeLengths
            return obj[()]
        return super().__array_wrap__(obj, context)
