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

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import is_instance
from ..compat.datasets import dataset_table
from ..constants import SEQ_LENGTHS
from ..core.arrow import column_lengths, is_list_type
from ..core.pairs import fit_pairs
from ..core.plan import WholeLengths, check_max_length, plan
from ..errors import PackingError
from ..io.discover import discover
from ..io.files import open_ipc, reading
from .distribution import LengthDistribution
from .packed import file_schema, packed_info, packed_rows, profile_packed, refuse_wrapped
from .recommend import Recommendation, recommend
from .tradeoffs import BucketTable, BucketTradeoff, TradeoffTable, check_candidates, tradeoff_row
from .trained import TrainedTokens

BATCH_TOKENS = 1 << 20  # about this many values decoded per parquet batch


@dataclass(frozen=True, eq=False)
class LengthProfile(LengthDistribution):
    """The length distribution of a dataset's sequences (see :class:`LengthDistribution`) and what the
    planner makes of it: :meth:`tradeoffs`, :meth:`bucket_tradeoffs`, :meth:`recommend`.

    ``trained``: where the sequences' trained (label) tokens are, for data with labels (chat,
    prompt/completion; :func:`packtools.profile_files` fills it): the text, the tradeoff table and the token
    rule then count trained tokens (:mod:`packtools.profiling.trained`).
    ``pair_parts``: for ``pairs``, each pair's prompt, chosen and rejected lengths, so that the tokens ``bfd``
    keeps (:meth:`tokens_kept`, the tables and the token rule) are those ``pack`` keeps.
    ``pairs``: the sequences are preference pairs (``2 * prompt + chosen + rejected``; :func:`packtools.profile_files`
    sets it), which ``pack`` packs whole with ``bfd`` only: :meth:`recommend` then names ``bfd``, never ``bfd_split``.
    ``whole``: every sample is packed whole and a longer one is refused (vision samples: :func:`profile_lengths`
    of a :class:`WholeLengths`, which ``vision_lengths`` returns): :meth:`recommend` holds every sample
    (``keep_sequences=1.0``, ``bfd``) and refuses a rule that would leave one out.
    """

    trained: TrainedTokens | None = None
    pairs: bool = False
    whole: bool = False
    pair_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def tokens_kept(self, max_length: int) -> int:
        """Tokens ``bfd`` keeps at ``max_length``: ``sum(min(length, max_length))``; for preference pairs with
        ``pair_parts`` (each pair's prompt, chosen and rejected lengths), what ``pack`` keeps of each over-long
        pair under ``--overlong truncate`` (its default: :func:`packtools.core.pairs.fit_pairs`, which cuts
        the prompt, held twice, and the completions by its own rule, so it may keep less than ``max_length``)."""
        if self.pair_parts is None:
            return super().tokens_kept(max_length)
        return int(fit_pairs(*self.pair_parts, max_length).pair_lengths.sum())

    def to_text(self) -> str:
        text = super().to_text()
        return text + ("\n" + self.trained.to_text() if self.trained is not None else "")

    def tradeoffs(self, candidates: Iterable[int] | None = None, batch_size: int = 8) -> TradeoffTable:
        """What each strategy does at each candidate ``max_length`` (see :mod:`packtools.profiling.tradeoffs`).

        >>> t = LengthProfile([5, 2, 3, 1]).tradeoffs([4, 8], batch_size=2)
        >>> [(r.max_length, r.bfd_rows, r.bfd_split_rows, r.wrapped_rows) for r in t]
        [(4, 3, 3, 3), (8, 2, 2, 2)]
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise PackingError(
                f"batch_size={batch_size!r} must be a positive int (sequences per padded batch)."
            )
        candidates = self.default_candidates() if candidates is None else candidates
        rows = tuple(tradeoff_row(self, m, int(batch_size)) for m in check_candidates(candidates))
        return TradeoffTable(rows, int(batch_size), self.name)

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
        from ..batches.buckets import bucket_padding, choose_buckets
        from ..batches.sampler import TokenBudgetBatchSampler

        max_length = check_max_length(max_length)
        ks = sorted({check_max_length(k) for k in candidates}) if candidates else []
        if not ks:
            raise PackingError(
                "candidates is empty; give at least one K, e.g. [1, 2, 4, 8].", param="candidates"
            )
        p = plan(self.lengths, max_length, strategy)
        sampler = TokenBudgetBatchSampler(p.row_lengths, max_tokens)
        totals = sampler.batch_tokens(0)
        top = -(-sampler.max_tokens // multiple_of) * multiple_of
        rows = [BucketTradeoff(None, (), int(np.unique(totals).shape[0]), 0.0)]
        for k in ks:
            sizes = choose_buckets(totals, k, multiple_of=multiple_of, top=top)
            used = np.unique(np.asarray(sizes)[np.searchsorted(sizes, totals)]) if totals.size else totals
            rows.append(BucketTradeoff(k, sizes, int(used.shape[0]), bucket_padding(totals, sizes)))
        return BucketTable(tuple(rows), max_length, sampler.max_tokens, strategy, totals)

    def recommend(
        self,
        keep_tokens: float | None = None,
        multiple_of: int = 64,
        *,
        keep_sequences: float | None = None,
        max_context: int = 32768,
    ) -> Recommendation:
        """A ``max_length`` (a multiple of ``multiple_of``) and why, with both rules side by side (the rules,
        the options and the flags: :mod:`packtools.profiling.recommend`).  By default the sequence rule at 0.99
        (for ``bfd_split``); ``keep_sequences=S`` sets its share, ``keep_tokens=T`` picks by the token rule.

        >>> p = LengthProfile([100] * 98 + [1000, 3000])
        >>> p.recommend().max_length, p.recommend(keep_sequences=0.98).max_length
        (1024, 128)
        >>> p.recommend(keep_tokens=0.9).max_length, [o.max_length for o in p.recommend().options]
        (1664, [1024, 2880])
        """
        return recommend(
            self, keep_tokens, multiple_of, keep_sequences=keep_sequences, max_context=max_context
        )


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
        return np.asarray(arr.to_numpy())
    raise PackingError(
        f"column {column!r} has type {arr.type}; profiling needs a list column (token ids) or integer lengths."
    )


def _check_column(schema: pa.Schema, column: str, where: str) -> None:
    """Refuse a ``schema`` without the list column ``column`` (raw text: profile it through the tokenizer)."""
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
    kind = schema.field(column).type
    if not is_list_type(kind):
        raise PackingError(f"column {column!r} of {where} has type {kind}, not a list of token ids.")


def _expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The files to profile, found as the pipeline finds its inputs (:func:`packtools.io.discover.discover`): a
    ``save_to_disk`` folder stands for the files its ``state.json`` lists (not every ``*.arrow`` in it)."""
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
    # Read errors (a corrupted page behind a readable footer) name the file (io.files.reading).
    with reading(path, "parquet"), pq.ParquetFile(path, memory_map=False, pre_buffer=False) as pf:
        _check_column(pf.schema_arrow, column, f"file {path!r}")
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
    """Memory-mapped: only the offsets buffers of the column are touched; read errors name the file."""
    with reading(path, "arrow"), open_ipc(path) as reader:
        _check_column(reader.schema, column, f"file {path!r}")
        return _lengths_of_list(reader.read_all().column(column))


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
    given = [source] if isinstance(source, (str, os.PathLike)) else source  # one path or several
    if isinstance(given, (list, tuple)) and given and all(isinstance(s, (str, os.PathLike)) for s in given):
        paths = _expand_paths(given)
        if column == SEQ_LENGTHS or any(SEQ_LENGTHS in file_schema(p).names for p in paths):
            return LengthProfile(*profile_packed(paths, given, name))
        refuse_wrapped(given)
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
        _check_column(source.schema, column, "the table")
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
        _check_column(table.schema, column, "the dataset")
        lengths = _lengths_of_list(table.column(column))
        if indices is not None:
            lengths = lengths[indices]
        if name is None:
            info = getattr(source, "info", None)
            base = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "dataset"
            name = f"{base} ({source.split})" if getattr(source, "split", None) else base
    elif isinstance(source, WholeLengths):
        return LengthProfile(np.asarray(source).view(np.ndarray), name, whole=True)
    elif isinstance(source, (np.ndarray, list, tuple, range)):
        lengths = source
    else:
        raise PackingError(
            f"cannot profile a {type(source).__name__}; give lengths, a pyarrow Table or list array, a "
            f"datasets.Dataset, or .parquet/.arrow paths."
        )
    return LengthProfile(lengths, name)
