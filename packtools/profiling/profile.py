"""Sequence-length profiles: what a dataset's lengths look like, read from list offsets only.

:func:`profile_lengths` turns a source (lengths, an Arrow table or list column, a ``datasets.Dataset``, or
parquet / Arrow files) into a :class:`LengthProfile`: counts, percentiles, a log-spaced histogram and the
lengths themselves.  :meth:`LengthProfile.tradeoffs` runs the real planner for candidate ``max_length`` values
and :meth:`LengthProfile.recommend` picks one.  Plots live in :mod:`packtools.profiling.plot` (extra ``plot``).

What is read from disk: Arrow IPC files (``.arrow`` / ``.feather``, the ``datasets`` cache format) are
memory-mapped and only their offsets buffers are touched.  Parquet stores list lengths as repetition levels
interleaved with the values in the same compressed pages and pyarrow has no levels-only reader, so a
parquet column is decoded in bounded batches (``iter_batches(columns=[column])``); only the lengths are kept,
so memory stays O(rows) plus one batch, but the time is that of decoding the column.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._optional import is_instance
from ..constants import SEQ_LENGTHS
from ..core.arrow import column_lengths, is_list_type
from ..errors import PackingError
from ..integrations.compat.datasets import dataset_table
from ..io.files import IpcReader
from .packed import file_schema, packed_info, packed_rows, profile_packed
from .recommend import Recommendation, recommend

if TYPE_CHECKING:
    from .tradeoffs import BucketTable, TradeoffTable

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)
FILE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")
BATCH_TOKENS = 1 << 20  # about this many values decoded per parquet batch


def _pct_key(q: float) -> str:
    return f"p{q:g}"


@dataclass(frozen=True, eq=False)
class LengthProfile:
    """The length distribution of a dataset's sequences (one length per row, in dataset order).

    Statistics are over all rows, empty ones included.  A percentile ``pQ`` is the smallest length ``L``
    such that at least ``Q`` percent of the sequences have at most ``L`` tokens (an actual length).  The
    histogram counts non-empty sequences in log-spaced integer bins ``[hist_edges[i], hist_edges[i + 1])``.

    >>> p = LengthProfile([3, 0, 10, 5, 5])
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
        from ..core.plan import as_lengths  # numpy-only helper; keeps this module's imports light

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
        s(self, "percentiles", {_pct_key(q): self.percentile(q) for q in PERCENTILES})
        edges = log_edges(hi)
        s(self, "hist_edges", edges)
        s(self, "hist_counts", np.diff(self._rows_below(edges)))

    # -- exact queries on the distribution ---------------------------------------------------------
    def _rows_below(self, lengths: np.ndarray) -> np.ndarray:
        """Rows with length < each value."""
        return self._cum_rows[np.searchsorted(self._values, lengths, side="left")]

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
        out: dict[str, Any] = {
            "name": self.name,
            "sequences": self.count,
            "tokens": self.total_tokens,
            "empty": self.empty,
            "min": self.min,
            "mean": self.mean,
            "max": self.max,
        }
        out.update(self.percentiles)
        return out

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
        return text

    def default_candidates(self) -> list[int]:
        """Powers of two from about the median length up to the first one that holds the longest sequence."""
        top = max(64, 1 << max(0, (self.max - 1).bit_length()))
        low = max(64, 1 << max(0, self.percentiles["p50"].bit_length() - 1))
        low = max(low, top >> 7)
        out = []
        m = low
        while m <= top:
            out.append(m)
            m *= 2
        return out

    def tradeoffs(self, candidates: Iterable[int] | None = None, batch_size: int = 8) -> TradeoffTable:
        """What each strategy does at each candidate ``max_length`` (see :mod:`packtools.profiling.tradeoffs`).

        >>> t = LengthProfile([5, 2, 3, 1]).tradeoffs([4, 8], batch_size=2)
        >>> [(r.max_length, r.bfd_rows, r.bfd_split_rows, r.wrapped_rows) for r in t]
        [(4, 3, 3, 3), (8, 2, 2, 2)]
        """
        from .tradeoffs import tradeoff_table

        return tradeoff_table(
            self, self.default_candidates() if candidates is None else candidates, batch_size
        )

    def bucket_tradeoffs(
        self,
        max_length: int,
        max_tokens: int,
        candidates: Iterable[int] = (1, 2, 4, 8, 16),
        strategy: str = "bfd",
        multiple_of: int = 1,
    ) -> BucketTable:
        """For static shapes: the padding share that rounding batches up to ``K`` bucket sizes costs.

        Packs the lengths with ``strategy`` at ``max_length``, batches the packed rows with
        :class:`~packtools.batches.TokenBudgetBatchSampler` (``max_tokens``), and for each ``K`` in ``candidates``
        chooses the sizes (:func:`~packtools.batches.choose_buckets`, ``max_tokens`` the largest); the first row is
        no bucketing (padding 0, one shape per distinct batch length).

        >>> t = LengthProfile([5, 2, 3, 1, 7, 4]).bucket_tradeoffs(8, 16, candidates=[1, 2])
        >>> [(r.k, r.buckets, r.shapes) for r in t]
        [(None, (), 2), (1, (16,), 1), (2, (6, 16), 2)]
        """
        from .tradeoffs import bucket_table

        return bucket_table(self, max_length, max_tokens, candidates, strategy, multiple_of)

    def recommend(
        self,
        keep_tokens: float | None = None,
        multiple_of: int = 64,
        *,
        keep_sequences: float | None = None,
        max_context: int = 32768,
    ) -> Recommendation:
        """A ``max_length`` (a multiple of ``multiple_of``) and why, with both rules side by side.

        By default (no share given) the **sequence rule at 0.99**: the smallest multiple that holds at least
        99% of the sequences whole, packed with ``bfd_split`` (which keeps every token and cuts only the
        longer sequences).  ``keep_sequences=S`` sets that share; ``keep_tokens=T`` instead picks by the token
        rule, the smallest multiple at which ``bfd`` (truncating) keeps ``T`` of the tokens -- on long-tailed
        data it asks for a huge ``max_length``.  ``rec.options`` holds both rules with their costs (sequences
        cut, tokens bfd drops, rows, attention cost); ``rec.flags`` says when a value is above
        ``max_context`` (see :mod:`packtools.profiling.recommend`).

        >>> p = LengthProfile([100] * 98 + [1000, 3000])
        >>> p.recommend().max_length, p.recommend(keep_sequences=0.98).max_length
        (1024, 128)
        >>> p.recommend(keep_tokens=0.9).max_length, [o.max_length for o in p.recommend().options]
        (1664, [1024, 2880])
        """
        return recommend(
            self, keep_tokens, multiple_of, keep_sequences=keep_sequences, max_context=max_context
        )


def log_edges(max_length: int, per_decade: int = 12) -> np.ndarray:
    """Integer bin edges from 1 to ``max_length + 1``, evenly spaced on a log axis (small bins merged)."""
    top = max(1, int(max_length)) + 1
    k = max(1, math.ceil(per_decade * math.log10(top)))
    edges = np.unique(np.round(np.logspace(0.0, math.log10(top), k + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, top
    return np.unique(edges)


# -- reading lengths from sources --------------------------------------------------------------------
def _write_lengths(chunks: Iterable[pa.Array], out: np.ndarray) -> int:
    """Write the row lengths of consecutive list arrays into ``out``; null rows count as empty. Returns rows."""
    pos = 0
    for chunk in chunks:
        n = len(chunk)
        lens = column_lengths(chunk)  # offsets only; a temporary of one chunk
        if chunk.null_count:
            lens[np.asarray(chunk.is_null(), dtype=bool)] = 0
        out[pos : pos + n] = lens
        pos += n
    return pos


def _lengths_of_list(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row lengths from offsets, in one preallocated array."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out = np.empty(sum(len(c) for c in chunks), np.int64)
    _write_lengths(chunks, out)
    return out


def _lengths_of_array(arr: pa.ChunkedArray | pa.Array, column: str) -> np.ndarray:
    if is_list_type(arr.type):
        return _lengths_of_list(arr)
    if pa.types.is_integer(arr.type):
        if arr.null_count:
            raise PackingError("the array of lengths holds nulls; lengths must all be integers.")
        return np.asarray(arr.to_numpy() if isinstance(arr, pa.Array) else arr.to_numpy())
    raise PackingError(
        f"column {column!r} has type {arr.type}; profiling needs a list column (token ids) or integer lengths."
    )


def _table_column(schema: pa.Schema, column: str, where: str) -> pa.Field:
    if column not in schema.names:
        if column == "input_ids" and {"text", "messages", "prompt"} & set(schema.names):
            raise PackingError(
                f"{where} holds raw text (columns {schema.names}), not token ids: profile it through the "
                f"tokenizer you will pack with: pass tokenizer=DIR, i.e. packtools.profile_files(paths, "
                f"tokenizer=DIR) (packtools profile PATH --tokenizer DIR).",
                param="tokenizer",
            )
        raise PackingError(
            f"{where} has no column {column!r}; it has {schema.names}. Pass column=... naming the token column.",
            param="column",
        )
    f = schema.field(column)
    if not is_list_type(f.type):
        raise PackingError(f"column {column!r} of {where} has type {f.type}, not a list of token ids.")
    return f


def _expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The files to profile, found as the pipeline finds its inputs (:func:`packtools.io.files.discover`): a
    ``save_to_disk`` folder stands for the files its ``state.json`` lists (not every ``*.arrow`` in it)."""
    from ..io.files import discover

    files = discover(paths)
    for f in files:
        if f.kind not in ("parquet", "arrow"):
            raise PackingError(
                f"input {f.path!r}: the profiler reads tokenized .parquet or .arrow files (or folders of them); "
                f"for JSON lines use packtools.profile_files(paths) (CLI: packtools profile PATH), which stages them as "
                f"pack does.",
                param="paths",
            )
    return [f.path for f in files]


def _parquet_lengths(path: str, column: str) -> np.ndarray:
    import pyarrow.parquet as pq

    # No memory map and no pre-buffering: the file's pages would count in RSS and whole row groups would be
    # buffered; decoding in batches of about BATCH_TOKENS values keeps memory at the lengths plus one batch.
    with pq.ParquetFile(path, memory_map=False, pre_buffer=False) as pf:
        _table_column(pf.schema_arrow, column, f"file {path!r}")
        md = pf.metadata
        leaf = [i for i in range(md.num_columns) if md.schema.column(i).path.startswith(column + ".")]
        values = (
            sum(md.row_group(g).column(leaf[0]).num_values for g in range(md.num_row_groups)) if leaf else 0
        )
        per_row = max(1.0, values / max(1, md.num_rows))
        batch = int(min(1 << 16, max(1024, BATCH_TOKENS / per_row)))
        out = np.empty(md.num_rows, np.int64)
        rows = _write_lengths((b.column(0) for b in pf.iter_batches(batch_size=batch, columns=[column])), out)
    if rows != md.num_rows:  # pragma: no cover - a corrupt file
        raise PackingError(f"file {path!r}: read {rows} rows, its metadata says {md.num_rows}.")
    return out


def _ipc_lengths(path: str, column: str) -> np.ndarray:
    """Memory-mapped: only the offsets buffers of the column are touched."""
    with pa.memory_map(path, "r") as source:
        reader = IpcReader(source, path)
        _table_column(reader.schema, column, f"file {path!r}")
        return _lengths_of_list(
            pa.chunked_array([b.column(column) for b in reader.batches()], reader.schema.field(column).type)
        )


def profile_lengths(source: Any, column: str = "input_ids", name: str | None = None) -> LengthProfile:
    """Profile the sequence lengths of ``source``, reading list offsets only.

    ``source`` may be: lengths (a sequence or NumPy array of ints, or an integer Arrow array); a
    ``pyarrow.Table`` / ``RecordBatch`` (its ``column``), a list ``ChunkedArray`` or ``Array``; a
    ``datasets.Dataset`` (its selection / shuffle is applied, so lengths are in dataset order); or one or
    several ``.parquet`` / ``.arrow`` paths or directories holding them, profiled as one dataset.  Null
    list rows count as empty.  ``name`` labels plots and reports.

    >>> import pyarrow as pa
    >>> p = profile_lengths(pa.table({"input_ids": [[1, 2, 3], [], [4]]}), name="tiny")
    >>> p.lengths.tolist(), p.empty, p.title
    ([3, 0, 1], 1, 'tiny: 3 sequences, 4 tokens, 1 empty')
    """
    lengths: Any
    if isinstance(source, (str, os.PathLike)) or (
        isinstance(source, (list, tuple))
        and source
        and all(isinstance(s, (str, os.PathLike)) for s in source)
    ):
        given = [source] if isinstance(source, (str, os.PathLike)) else list(source)
        paths = _expand_paths(given)
        if column == SEQ_LENGTHS or any(SEQ_LENGTHS in file_schema(p).names for p in paths):
            return LengthProfile(*profile_packed(paths, given, name))
        parts = [
            _parquet_lengths(p, column) if p.endswith(".parquet") else _ipc_lengths(p, column) for p in paths
        ]
        lengths = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if name is None:
            name = os.path.basename(paths[0]) if len(paths) == 1 else f"{len(paths)} files"
    elif isinstance(source, (pa.Table, pa.RecordBatch)) and SEQ_LENGTHS in source.schema.names:
        seqs, rows = packed_rows(source.column(SEQ_LENGTHS))
        return LengthProfile(seqs, name, packed_info(rows, None, "", None))
    elif isinstance(source, (pa.Table, pa.RecordBatch)):
        _table_column(source.schema, column, "the table")
        lengths = _lengths_of_list(source.column(column))
    elif isinstance(source, (pa.ChunkedArray, pa.Array)):
        lengths = _lengths_of_array(source, column)
    elif is_instance(source, "datasets", "DatasetDict"):
        raise PackingError(
            f"profile one split of the DatasetDict, e.g. profile_lengths(ds[{next(iter(source), 'train')!r}]); "
            f"it has splits {list(source)}."
        )
    elif is_instance(source, "datasets", "IterableDataset"):
        raise PackingError(
            "an IterableDataset has no offsets to read without streaming every token; profile the files it "
            "streams from (profile_lengths(paths)) or a materialized datasets.Dataset."
        )
    elif is_instance(source, "datasets", "Dataset"):
        table, indices = dataset_table(source)
        if SEQ_LENGTHS in table.schema.names:
            col = table.column(SEQ_LENGTHS)
            seqs, rows = packed_rows(col if indices is None else col.take(pa.array(indices)))
            return LengthProfile(seqs, name, packed_info(rows, None, "", None))
        _table_column(table.schema, column, "the dataset")
        lengths = _lengths_of_list(table.column(column))
        if indices is not None:
            lengths = lengths[indices]
        if name is None:
            info = getattr(source, "info", None)
            base = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "dataset"
            name = f"{base} ({source.split})" if getattr(source, "split", None) else base
    elif isinstance(source, (np.ndarray, list, tuple, range)):
        lengths = source
    else:
        raise PackingError(
            f"cannot profile a {type(source).__name__}; give lengths, a pyarrow Table or list array, a "
            f"datasets.Dataset, or .parquet/.arrow paths."
        )
    return LengthProfile(lengths, name)
