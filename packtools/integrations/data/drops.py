"""What packing or truncating left out, as a report and a warning (the Python API never drops tokens silently):
:class:`DropReport` (returned with ``return_report=True``) and :func:`warn_dropped`.

>>> r = DropReport.from_lengths([5, 2, 3], 4, "bfd")
>>> r.tokens_in, r.tokens_kept, r.tokens_dropped, r.sequences_truncated, f"{r.dropped_share:.0%}"
(10, 9, 1, 1, '10%')
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import EmptyRowsWarning, TokensDroppedWarning, empty_rows_message


@dataclass(frozen=True)
class DropReport:
    """Tokens and sequences in and what ``max_length`` cut (``strategy``: the one used, or ``"truncate"``).

    Packed for context parallelism (``pack_dataset(..., context_parallel=N)``, ``N > 1``): the padding the CP
    collator will add to the rows (``cp_padding_tokens``; ``cp_fill_lost``, its share of the rows' capacity
    ``rows * max_length``), the fill the rows lose to it -- the same figures as ``pack_files``' manifest.
    """

    max_length: int
    strategy: str
    sequences: int
    sequences_truncated: int
    tokens_in: int
    tokens_kept: int
    context_parallel: int = 1
    cp_padding_tokens: int = 0
    cp_fill_lost: float = 0.0
    #: sequences of no token, left out of the packed rows (nothing to train; :class:`EmptyRowsWarning`)
    sequences_empty: int = 0

    @property
    def tokens_dropped(self) -> int:
        return self.tokens_in - self.tokens_kept

    @property
    def dropped_share(self) -> float:
        return self.tokens_dropped / self.tokens_in if self.tokens_in else 0.0

    @classmethod
    def from_lengths(cls, lengths: object, max_length: int, strategy: str) -> DropReport:
        """For ``bfd`` / ``"truncate"``: every sequence cut to ``max_length``; ``bfd_split``/``wrapped`` drop none."""
        lens = np.asarray(lengths, np.int64)
        total = int(lens.sum())
        over = int(np.count_nonzero(lens > max_length))
        kept = int(np.minimum(lens, max_length).sum()) if strategy in ("bfd", "truncate") else total
        return cls(max_length, strategy, int(lens.shape[0]), over, total, kept)

    @classmethod
    def from_plan(cls, plan: Any, context_parallel: int = 1) -> DropReport:
        """The report of ``plan``; with ``context_parallel > 1``, its CP padding too
        (:func:`~packtools.core.cp_budget.cp_stats`)."""
        lens = plan.source_lengths
        cp: dict[str, Any] = {}
        if context_parallel > 1:
            from ...core.cp_budget import cp_stats

            stats = cp_stats(plan, context_parallel)
            cp = {
                "context_parallel": context_parallel,
                "cp_padding_tokens": stats["cp_padding_tokens"],
                "cp_fill_lost": stats["cp_fill_lost"],
            }
        return cls(
            plan.max_length,
            plan.strategy,
            int(lens.shape[0]),
            int(np.count_nonzero(lens > plan.max_length)),
            plan.tokens_in,
            plan.tokens_kept,
            **cp,
            sequences_empty=plan.num_empty,
        )

    def message(
        self,
        what: str,
        split: str = "",
        *,
        counts: str = "Pass return_report=True for the counts.",
        cut: str = "the ends of",
        overlong: str | None = None,
    ) -> str:
        """``overlong``: the policy that cut the tokens when it is not the strategy's own (``pack_files`` with
        ``overlong='truncate'`` or ``'drop'``): the fix named is then ``overlong='split'``, since a strategy that
        splits does not keep the tokens while the policy drops them."""
        where = f" (split {split!r})" if split else ""
        how = "truncated" if self.strategy == "truncate" else f"strategy={self.strategy!r}"
        keep = "strategy='bfd_split' keeps every token (it splits long sequences)"
        if overlong is not None:
            how += f", overlong={overlong!r}"
            if self.strategy in ("bfd_split", "wrapped"):
                keep = "overlong='split' (--overlong split) keeps every token (it splits long sequences)"
        return (
            f"{what}{where}: {how} at max_length={self.max_length:,} dropped {self.tokens_dropped:,} of "
            f"{self.tokens_in:,} tokens ({self.dropped_share:.2%}; {cut} {self.sequences_truncated:,} of "
            f"{self.sequences:,} sequences longer than max_length). {keep}; or choose max_length with "
            f"packtools.profile_lengths(...).recommend(). {counts}"
        )


def pipeline_drop_message(stats: dict) -> str | None:
    """What the overlong policy of a :func:`packtools.pack_files` run cut (its manifest ``stats``), said as
    :func:`warn_dropped` says it for the in-memory API, with the trained tokens it cost; None if it cut nothing."""
    lost = int(stats.get("tokens_truncated", 0)) + int(stats.get("tokens_dropped_overlong", 0))
    if not lost or not stats.get("packed"):
        return None
    dropping = bool(stats.get("rows_dropped_overlong"))
    report = DropReport(
        int(stats["max_length"]),
        str(stats["strategy"]),
        int(stats["rows_in"]),
        int(stats.get("rows_truncated", 0)) + int(stats.get("rows_dropped_overlong", 0)),
        int(stats["tokens_in"]),
        int(stats["tokens_in"]) - lost,
    )
    text = report.message(
        "pack_files",
        counts="The manifest's stats hold the counts.",
        cut="all of" if dropping else "the ends of",
        overlong=str(stats["overlong"]) if stats.get("overlong") else None,
    )
    if "tokens_trained_in" in stats:
        text += f" Trained (label) tokens kept: {stats['tokens_trained_kept']:,} of {stats['tokens_trained_in']:,}."
    return text


def warn_dropped(report: DropReport, what: str, split: str = "", stacklevel: int = 2) -> None:
    """A :class:`TokensDroppedWarning` if ``report`` dropped any token; an
    :class:`~packtools.errors.EmptyRowsWarning` if it left out sequences of no token."""
    if report.tokens_dropped:
        warnings.warn(report.message(what, split), TokensDroppedWarning, stacklevel=stacklevel + 1)
    if report.sequences_empty:
        warn_empty(
            report.sequences_empty,
            report.sequences,
            what + (f" (split {split!r})" if split else ""),
            stacklevel + 1,
        )


def warn_empty(empty: int, rows: int, what: str, stacklevel: int = 2) -> None:
    """An :class:`~packtools.errors.EmptyRowsWarning`: ``empty`` of ``rows`` rows held no token and are not in
    the packed rows."""
    warnings.warn(
        empty_rows_message(empty, rows, what, "they are not in the packed rows"),
        EmptyRowsWarning,
        stacklevel=stacklevel + 1,
    )


class UntrainedPiecesWarning(UserWarning):
    """``bfd_split`` / ``wrapped`` cut sequences into pieces that hold no trained token (filter with
    ``warnings.filterwarnings``)."""


#: label-like columns: the column and the value that marks a token *not* trained (``labels``) or trained
_TRAINED_BY = {"labels": ("ignore", -100), "completion_mask": ("keep", 1), "assistant_masks": ("keep", 1)}


def untrained_pieces(
    table: Any, indices: Any, plan: Any, block_rows: int = 1 << 14
) -> tuple[int, int, str] | None:
    """``(pieces cut from sequences that train, of them holding no trained token, the column read)`` for a
    ``bfd_split`` / ``wrapped`` plan over ``table`` (``indices``: the dataset's row order, or None); None when
    the table has no label-like column.  Only the rows the plan cuts are read, ``block_rows`` at a time (memory
    follows one block, not the table).  A piece's first label does not train where it starts a sequence of the
    padding-free batch (``bfd_split``: every piece; ``wrapped``: a piece that starts a packed row).

    >>> import pyarrow as pa
    >>> from packtools.core.plan import plan
    >>> t = pa.table({"input_ids": [[1] * 6], "labels": [[-100, -100, -100, -100, 5, 6]]})
    >>> untrained_pieces(t, None, plan([6], 3, "bfd_split"))  # [-100 x 3] trains nothing, [-100, 5, 6] does
    (2, 1, 'labels')
    """
    import pyarrow.compute as pc

    name = next((n for n in _TRAINED_BY if n in table.column_names), None)
    if name is None:
        return None
    col = table.column(name)
    row_len = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), np.int64)
    src = np.asarray(plan.seg_source, np.int64)
    rows = np.asarray(indices, np.int64)[src] if indices is not None else src
    length = np.asarray(plan.seg_length, np.int64)
    cut = np.flatnonzero(length < row_len[rows])  # the segments that are pieces of a longer sequence
    if cut.size == 0:
        return 0, 0, name
    masked_first = np.ones(src.shape[0], bool)
    if plan.strategy == "wrapped":  # only a packed row's first token starts a sequence
        masked_first[:] = False
        masked_first[np.asarray(plan.row_offsets[:-1], np.int64)] = True
    how, mark = _TRAINED_BY[name]
    cut = cut[np.argsort(rows[cut], kind="stable")]  # by row: each block's pieces are one slice of it
    cut_of = rows[cut]
    cut_rows = np.unique(cut_of)
    seg_start = np.asarray(plan.seg_start, np.int64)
    pieces = empty = 0
    for lo in range(0, cut_rows.size, block_rows):
        block = cut_rows[lo : lo + block_rows]
        values = np.asarray(pc.list_flatten(col.take(pa.array(block))).to_numpy(zero_copy_only=False))
        trained = values != mark if how == "ignore" else values == mark
        csum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
        starts = np.concatenate([[0], np.cumsum(row_len[block])])
        segs = cut[np.searchsorted(cut_of, block[0]) : np.searchsorted(cut_of, block[-1], "right")]
        where = np.searchsorted(block, rows[segs])
        begin = starts[where] + seg_start[segs]
        end = begin + length[segs]
        piece = csum[end] - csum[np.minimum(begin + masked_first[segs], end)]
        whole = csum[starts[where + 1]] - csum[np.minimum(starts[where] + 1, starts[where + 1])]
        trains = whole > 0
        pieces += int(trains.sum())
        empty += int((trains & (piece == 0)).sum())
    return pieces, empty, name


def warn_untrained(counts: tuple[int, int, str] | None, what: str, stacklevel: int = 2) -> None:
    """An :class:`UntrainedPiecesWarning` if a split left pieces that train nothing (never silent)."""
    if counts is None or counts[1] == 0:
        return
    pieces, empty, name = counts
    warnings.warn(
        f"{what}: {empty} of the {pieces} pieces cut from sequences that train hold no trained token ({name!r}); "
        f"they cost compute and train nothing. packtools.pack_files(..., strategy='bfd_split') (packtools pack "
        f"--strategy bfd_split) cuts chat rows at turn boundaries and drops such pieces, counting them; or "
        f"filter them from the packed rows.",
        UntrainedPiecesWarning,
        stacklevel=stacklevel + 1,
    )
