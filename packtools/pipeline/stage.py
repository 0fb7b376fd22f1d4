"""Stage 1 of :func:`packtools.pack_files`: one part of the input read (and tokenized) into a staged file.

A :class:`StageJob` runs on any executor (it is small and picklable; :func:`stage_part` is module-level).  It
reads its :class:`~packtools.io.files.Part` block by block, tokenizes raw rows (or checks and casts the token
columns of tokenized rows), and writes the token columns to an uncompressed Arrow IPC file, then its sidecar
(:mod:`packtools.pipeline.staged`; a preference pair's length counts its tokens in all three columns).  Both
are written under temporary names and renamed; the sidecar comes last, so its presence means the part is done:
a rerun after a crash finds it and skips the part.  The file names are the part's cache key
(:func:`stage_key`), so a cached part can never be stale.

A tokenized, uncompressed Arrow input whose columns already have the target types is not copied: the sidecar
records the input itself as the data to gather from (``data``).

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> from packtools.io.discover import discover
>>> from packtools.io.files import Part
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4]]}), os.path.join(d, "t.parquet"))
>>> ids = IdsSpec.of(None, "tokenized", True, "auto", "report", 0.001)
>>> job = StageJob(Part(discover([d])[0]), ids, ("input_ids",), ("int64",), None,
...                os.path.join(d, "s.arrow"), os.path.join(d, "s.npz"))
>>> stage_part(job)["rows"], load_sidecar(job.sidecar)[0].tolist(), stage_part(job)["reused"]
(2, [3, 1], True)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .._atomic import fsync_file, removed_on_error
from ..core.arrow import check_aligned, is_list_type, read_list_column
from ..errors import PackingError
from ..io.direct import DirectFile, arrow_sink
from ..io.files import Part, Where, iter_part, open_ipc
from ..io.fingerprint import cache_key
from ..io.pages import read_ahead
from .prefetch import prefetch, timed
from .staged import (
    damage,
    drop_staged,
    first_label,
    load_sidecar,
    save_sidecar,
    sidecar_report,
    trained_per_row,
)
from .tokenizer.chat.head import CLOSING_KEY, HEAD_COLUMN, TOOL_OPENER_KEY
from .tokenizer.spec import IdsSpec

#: Version of the staged-file layout; part of every cache key.
STAGE_FORMAT = 4
#: Rows per block handed to the tokenizer, read from tokenized files, and most rows / bytes per record batch of
#: a staged file.
TOKENIZE_ROWS = 1000
READ_ROWS = 8192
STAGE_BATCH_ROWS = 1 << 16
STAGE_BATCH_BYTES = 1 << 24  # 64 MiB buffers (and their concatenated copy) raised the job's peak RSS


@dataclass(frozen=True)
class StageJob:
    """Everything a worker needs to stage one part (picklable, small): what decides its ids as the run's one
    frozen value (``ids``), and what is this part's own."""

    part: Part
    ids: IdsSpec  # what decides the ids (format, tokenizer content, engine, add-EOS, ...): the run's
    columns: tuple[str, ...]  # token columns of the staged file, in order
    value_types: tuple[str, ...]  # their value types ("int32", ...)
    tokenizer: str | None  # the tokenizer folder (``ids.tokenizer``: the hash of its files)
    staged: str  # path of the staged Arrow file
    sidecar: str  # path of the sidecar .npz (written last)
    # tokenize on one thread (a worker of a pool or of Ray: they are the parallelism)
    single_threaded: bool = False
    known_columns: tuple[str, ...] | None = None  # tokenized JSON: a block with other columns is refused
    # the run's verdict (packtools.pipeline.tokenizer.verdict; EngineReport items): the engine every part uses
    engine_proven: tuple[tuple[str, Any], ...] | None = None
    # the data's SHA-256 in the sidecar (stage-cache entries: checked on adoption); else the data is flushed to
    # disk before the sidecar is written (a run's own parts: cheaper than hashing them)
    checksum: bool = False

    @property
    def fmt(self) -> str:
        return self.ids.format

    @property
    def has_labels(self) -> bool:
        return "labels" in self.columns


def stage_key(
    part: Part,
    columns: tuple[str, ...],
    value_types: tuple[str, ...],
    spec: IdsSpec,
    known_columns: tuple[str, ...] | None = None,
) -> str:
    """The cache key of a staged part (32 hex digits): the part (path, size, mtime, range), its columns and
    types, the columns a tokenized JSON block may have (``known_columns``: one staged without that check is
    never adopted by a run that needs it), and everything that decides its ids
    (:class:`~packtools.pipeline.tokenizer.spec.IdsSpec`: tokenizer content, engine and versions, code, format, add-EOS,
    on-unencodable, audit rate)."""
    return cache_key(
        "stage",
        STAGE_FORMAT,
        part=part.fingerprint(),
        columns=list(columns),
        types=list(value_types),
        ids=spec.key(),
        known=list(known_columns) if known_columns is not None else None,
    )[:32]


# -- in the worker ---------------------------------------------------------------------------------------
_TOKENIZERS: dict[tuple[Any, ...], Any] = {}


def preload_tokenizer(
    tokenizer: str,
    ids: IdsSpec,
    *,
    proven: tuple[tuple[str, Any], ...] | None = None,
    input_bytes: int | None = None,
    check_later: bool = False,
) -> Any:
    """The :class:`BatchTokenizer` of the folder ``tokenizer`` under the run's ``ids`` (format, add-EOS, engine,
    audit rate, on-unencodable), loaded once per process (loading is the slow part).  ``proven``: the driver's
    engine choice, taken as it is (workers do not choose again).  ``input_bytes``: the driver's whole raw input
    (a small one is tokenized by the reference alone); a driver whose input is of the other size class than the
    cached tokenizer's gets a new one, a stage job (None) takes the cached one.  ``check_later``: the pipeline's
    driver, which may stage on a provisional reference and settles it before its install
    (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer.settle_reference`); any other caller but a stage
    job gets a settled tokenizer."""
    from .tokenizer.batch import BatchTokenizer
    from .tokenizer.folder import tokenizer_fingerprint
    from .tokenizer.load import reference_suffices

    engine = ids.requested_engine
    key = (tokenizer, tokenizer_fingerprint(tokenizer), ids)
    cached = _TOKENIZERS.get(key)
    if cached is not None and input_bytes is not None:
        small = reference_suffices(tokenizer, engine, input_bytes)
        if (cached.small_input is not None) != small:
            del _TOKENIZERS[key]
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = BatchTokenizer(
            tokenizer,
            ids.format,
            ids.add_eos,
            engine,
            audit_rate=ids.audit_rate,
            on_unencodable=ids.on_unencodable,
            proven=_thaw(proven) if proven is not None else None,
            wait_for_engine=False,  # a large vocabulary's first batches may go to the reference meanwhile
            input_bytes=input_bytes,
            check_later=check_later,
        )
    tok = _TOKENIZERS[key]
    if tok.reference_check is not None and proven is None and not check_later:
        # (e.g. profile after a failed pack): nothing was staged on it here
        tok.settle_reference(lambda why: None)
    return tok


def freeze_report(report: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """An engine report (:meth:`EngineReport.to_dict`) as a hashable tuple, for :attr:`StageJob.engine_proven`."""
    return tuple(
        (k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in sorted(report.items())
    )


def _thaw(frozen: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return {k: dict(v) if k == "checked" else v for k, v in frozen}


def _tokenizer(job: StageJob) -> Any:
    if job.single_threaded:  # before the tokenizers library starts its thread pool in this process
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return preload_tokenizer(job.tokenizer, job.ids, proven=job.engine_proven)


def check_token_column(table: pa.Table, name: str, value_type: pa.DataType, where: Where) -> pa.ChunkedArray:
    """Column ``name`` of ``table`` as ``list<value_type>``, or an error naming the file, column, type and fix."""
    if name not in table.column_names:
        raise PackingError(
            f"{where()}: column {name!r} is missing (it has {table.column_names}); every input file needs the "
            f"same token columns (pass columns=[...] to choose them)."
        )
    col = table.column(name)
    t = col.type
    if pa.types.is_null(t):  # JSON blocks where the column is null everywhere
        return col.cast(pa.list_(value_type))
    vt = t.value_type if is_list_type(t) else None
    if vt is None or not pa.types.is_integer(vt):
        hint = (
            f"token ids must be integers: cast it, e.g. table.cast(...) with {name}: list<{value_type}>, "
            f"or round the values in the source"
            if vt is not None and pa.types.is_floating(vt)
            else f"a token column holds lists of integers (list<{value_type}>); cast it or leave it out with columns=[...]"
        )
        row = first_float_row(col, name, where) if vt is not None and pa.types.is_floating(vt) else 0
        raise PackingError(f"{where(row)}: column {name!r} has type {t}; {hint}.")
    if vt != value_type or not pa.types.is_list(t):
        try:
            col = col.cast(pa.list_(value_type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            row = _first_row_out_of(col, value_type)
            raise PackingError(
                f"{where(row or 0)}: column {name!r} ({t}) does not fit list<{value_type}>, the type this run "
                f"stores its token ids in (int32 when the first input is JSON: no vocabulary has 2**31 ids; else "
                f"the first input file's own) ({exc}); check the ids there, or cast the files to one type first."
            ) from None
    return col


def check_mask(col: pa.ChunkedArray, where: Where) -> None:
    """Refuse an ``attention_mask`` with a 0, naming the row (the file's own line or row): the rows are padded,
    and packing would keep the padding as tokens of the packed rows.  An all-ones mask is left out of the
    output (:data:`packtools.pipeline.run.MASK`).  Chunk by chunk, with no copy of the values (a memory-mapped
    file's whole column comes here)."""
    import pyarrow.compute as pc

    found = _first_value(col, lambda values: pc.equal(values, pa.scalar(0, values.type)))
    if found is None:
        return
    row, position, _ = found
    raise PackingError(
        f"{where(row)}: column 'attention_mask' is 0 at position {position}: the rows are padded, and packing "
        f"would keep the padding as tokens of the packed rows (attended to, and trained on unless labels are "
        f"-100 there). Tokenize without padding=... (packed rows need none), or strip the padded positions "
        f"from every column first. (An attention_mask of all ones is left out of the output: it carries "
        f"nothing.)"
    )


def check_ids(col: pa.ChunkedArray, where: Where) -> None:
    """Refuse a negative value in ``input_ids``, naming the row (the file's own line or row): no tokenizer has
    one (a ``-100`` belongs in ``labels``), and packed as given it reaches the embedding lookup.  Chunk by chunk,
    with no copy of the values, as :func:`check_mask` walks the mask."""
    import pyarrow.compute as pc

    found = _first_value(col, lambda values: pc.less(values, 0))
    if found is None:
        return
    row, position, low = found
    raise PackingError(
        f"{where(row)}: column 'input_ids' holds {low} at position {position}: "
        f"token ids are never negative (-100, the ignore index, belongs in 'labels'), and the model would look "
        f"it up as an embedding. Fix the ids in the source (tokenize the row again)."
    )


def _first_value(col: pa.ChunkedArray, test: Any) -> tuple[int, int, Any] | None:
    """``(row, position in the row, value)`` of the first value of the list column ``col`` where ``test(values)``
    (an Arrow boolean array over a chunk's flattened values; nulls count as false) is true, or ``None``.  Chunk
    by chunk: only the chunk's own slice of the values is read, and nothing is copied."""
    import pyarrow.compute as pc

    before = 0
    for chunk in col.chunks:
        values = pc.list_flatten(chunk)  # this chunk's slice of the values
        at = pc.index(pc.fill_null(test(values), False), True).as_py() if len(values) else -1
        if at >= 0:
            starts = np.asarray(chunk.offsets)
            starts = starts - starts[0]
            row_in_chunk = int(np.searchsorted(starts, at, side="right") - 1)
            return before + row_in_chunk, int(at - starts[row_in_chunk]), values[at].as_py()
        before += len(chunk)
    return None


def first_float_row(col: pa.ChunkedArray | None, name: str, where: Where) -> int:
    """The row (from the block's first, maybe past this block: Arrow types a whole read block of JSON lines at
    once) whose ``name`` list holds a float: for JSON lines the first line that writes one (``2.5``, ``2.0``,
    an integer beyond int64, which JSON reads as a float); otherwise the first row of ``col`` with a fraction, a
    non-finite value or one beyond int64; else the block's first row.  Errors only."""
    import json

    import pyarrow.compute as pc

    texts = where.texts()
    if texts is not None:
        for i, text in enumerate(texts):
            try:
                cell = json.loads(text).get(name)
            except (ValueError, AttributeError):
                continue
            if isinstance(cell, list) and any(
                isinstance(v, float) or (isinstance(v, int) and abs(v) >= 2**63) for v in cell
            ):
                return i
        return 0
    if col is None:
        return 0
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    values = np.asarray(pc.list_flatten(arr).fill_null(0).to_numpy(zero_copy_only=False), np.float64)
    rows = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False))
    with np.errstate(invalid="ignore"):
        odd = ~np.isfinite(values) | (values != np.trunc(values)) | (np.abs(values) >= 2.0**63)
    return int(rows[np.argmax(odd)]) if odd.any() else 0


def _first_row_out_of(col: pa.ChunkedArray, value_type: pa.DataType) -> int | None:
    """The first row of ``col`` (lists of integers) holding a value outside ``value_type``'s range, for the
    error to name its line (None when it cannot be told: the message then names the block's first row)."""
    import pyarrow.compute as pc

    if not pa.types.is_integer(value_type):
        return None
    info = np.iinfo(value_type.to_pandas_dtype())
    before = 0
    try:
        for chunk in col.chunks:
            values, parents = pc.list_flatten(chunk), pc.list_parent_indices(chunk)
            wide = values.cast(pa.float64(), safe=False)  # one comparable type for int64 and uint64 alike
            bad = pc.or_(pc.less(wide, float(info.min)), pc.greater(wide, float(info.max)))
            at = pc.index(bad, True).as_py()
            if at >= 0:
                return before + parents[at].as_py()
            before += len(chunk)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return None


def _token_tables(job: StageJob, clock: dict[str, float]):
    """The part's token tables, in order, with their ``where``; ``clock`` gets the busy seconds of reading
    (``read``: the reading thread, Python strings included for text) and of tokenizing (``encode``: the
    tokenizing thread, less its waits for the reader)."""
    types = [pa.type_for_alias(v) for v in job.value_types]
    if job.fmt == "tokenized":
        for where, table in timed(
            iter_part(job.part, READ_ROWS, job.columns, job.known_columns), clock, "read"
        ):
            cols = [check_token_column(table, n, t, where) for n, t in zip(job.columns, types)]
            for n, c in zip(job.columns, cols):
                if n == "attention_mask":
                    check_mask(c, where)
                elif n == "input_ids":
                    check_ids(c, where)
            yield where, pa.Table.from_arrays(cols, names=list(job.columns))
        return
    from .formats import input_columns, optional_columns
    from .tokenizer.batch import called, prepared_batches, render_while_loading

    tok = _tokenizer(job)
    # the driver's verdict decides the engine (it proved it on the run's first rows); every part is audited
    # (seeded by the part); without a verdict the part proves the engine on its own first rows
    verdict = _thaw(job.engine_proven) if job.engine_proven is not None else None
    tok.start_part(os.path.basename(job.sidecar), verdict=verdict)
    read = iter_part(job.part, TOKENIZE_ROWS, input_columns(job.fmt) + optional_columns(job.fmt))
    if job.fmt == "text":
        # the rows become Python strings in the reading thread, beside the engine's encoding of the batch before
        ready = prefetch(timed(prepared_batches(tok, read), clock, "read"))
        for where, prepared in timed(ready, clock, "read_wait"):
            t = time.perf_counter()
            table = tok.finish(prepared)
            clock["encode"] = clock.get("encode", 0.0) + time.perf_counter() - t
            yield where, table
        return
    batches = timed(prefetch(timed(read, clock, "read")), clock, "read_wait")
    tables = render_while_loading(tok, batches) if job.fmt == "messages" else called(tok, batches)
    yield from timed(tables, clock, "encode_and_wait")


def _map_as_is(job: StageJob) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Lengths, first labels and trained tokens of a tokenized Arrow input that can be gathered from directly, else None."""
    if job.fmt != "tokenized" or job.part.file.kind != "arrow":
        return None
    from .gather import MappedArrow

    want = [pa.list_(pa.type_for_alias(v)) for v in job.value_types]
    try:
        mapped = MappedArrow([job.part.file.path], job.columns)
    except (pa.ArrowInvalid, KeyError, ValueError):
        return None
    padded: PackingError | None = None
    try:
        table = mapped.table
        if [table.schema.field(c).type for c in job.columns] != want:
            return None
        cols = [read_list_column(table.column(c), c) for c in job.columns]
        if not mapped.zero_copy(cols):
            return None
        lengths = check_aligned(cols).astype(np.int64)
        try:  # raised as it is (it names the file), not wrapped below
            if "input_ids" in job.columns:
                check_ids(table.column("input_ids"), Where(job.part.file.path, 0))
            if "attention_mask" in job.columns:
                check_mask(table.column("attention_mask"), Where(job.part.file.path, 0))
        except PackingError as exc:
            padded = exc
        first = first_label(table.column("labels")) if job.has_labels else np.zeros(0, np.int64)
        trained = trained_per_row(table.column("labels")) if job.has_labels else np.zeros(0, np.int64)
        for col in cols:
            for chunk in col.chunks:
                mapped.release(chunk.values)
    except PackingError as exc:
        raise PackingError(f"input {job.part.file.path!r}: {exc}", param=exc.param) from None
    finally:
        mapped.close()
    if padded is not None:
        raise padded
    return lengths, first, trained


def stage_part(job: StageJob) -> dict[str, Any]:
    """Stage one part (see the module docstring); returns ``{"rows", "reused", "seconds", "data"}``, and
    ``"damaged"`` (why) where a part an interrupted run left could not be trusted and was staged again."""
    start = time.perf_counter()
    damaged = damage(job.sidecar) if os.path.exists(job.sidecar) else None  # e.g. cut by a machine crash
    if damaged is not None:
        drop_staged(job)  # staged again
    if os.path.exists(job.sidecar):
        lengths, _, data = load_sidecar(job.sidecar)
        if os.path.exists(data):
            reused = {"rows": int(lengths.shape[0]), "reused": True, "seconds": 0.0, "data": data}
            report = sidecar_report(job.sidecar)  # a rerun's manifest says what the run that wrote it did
            if report is not None:
                reused["tokenizer"] = report
            return reused
    mapped = _map_as_is(job)
    if mapped is not None:
        lengths, first, trained = mapped
        save_sidecar(job.sidecar, lengths, first, job.part.file.path, trained=trained)
        return {
            "rows": int(mapped[0].shape[0]),
            "reused": False,
            "seconds": time.perf_counter() - start,
            "data": job.part.file.path,
            **({"damaged": damaged} if damaged else {}),
        }
    schema = pa.schema([(c, pa.list_(pa.type_for_alias(v))) for c, v in zip(job.columns, job.value_types)])
    tmp = f"{job.staged}.tmp-{os.getpid()}"
    lengths, firsts, trained, heads, pending, pending_rows, pending_bytes = [], [], [], [], [], 0, 0
    closing = np.zeros(0, np.int64)  # tokenizer.chat.head.closing_ids of a template with generation markers
    clock: dict[str, float] = {}  # busy seconds per phase (read, encode, write, flush), for the run's timings
    opener = np.zeros(0, np.int64)  # tokenizer.chat.head.tool_opener_ids
    # past the page cache (packtools.io.direct: fresh page-cache pages were most of this write's cost), and
    # read back into it in the background once whole, for the gather
    with removed_on_error(tmp):
        # a part flushed rather than hashed below carries the CRC-32 of its bytes, taken as they are written
        direct = DirectFile(tmp, crc=not job.checksum)
        with arrow_sink(direct) as sink, pa.ipc.new_file(sink, schema) as writer:
            tables = timed(prefetch(_token_tables(job, clock)), clock, "stage_wait")
            for where, table in tables:  # tokenizing runs ahead of writing
                # a bad row is named by its line (row) in the file: `where` names the rows of this table
                cols = [read_list_column(table.column(c), c, where) for c in job.columns]
                if job.fmt == "preference":  # a pair's columns differ in length: count all its tokens
                    lengths.append(np.sum([c.lengths() for c in cols], axis=0).astype(np.int64))
                else:
                    lengths.append(check_aligned(cols, where).astype(np.int64))
                if job.has_labels:
                    firsts.append(first_label(table.column("labels")))
                    trained.append(trained_per_row(table.column("labels")))
                if HEAD_COLUMN in table.column_names:
                    heads.append(table.column(HEAD_COLUMN).to_numpy().astype(np.int64))
                meta = table.schema.metadata or {}
                if CLOSING_KEY in meta and meta[CLOSING_KEY]:
                    closing = np.array([int(x) for x in meta[CLOSING_KEY].split(b",")], np.int64)
                if meta.get(TOOL_OPENER_KEY):
                    opener = np.array([int(x) for x in meta[TOOL_OPENER_KEY].split(b",")], np.int64)
                pending.append(table.select(list(job.columns)).cast(schema).replace_schema_metadata(None))
                pending_rows += table.num_rows
                pending_bytes += table.nbytes
                if pending_rows >= STAGE_BATCH_ROWS or pending_bytes >= STAGE_BATCH_BYTES:
                    writer.write_table(pa.concat_tables(pending).combine_chunks())
                    pending, pending_rows, pending_bytes = [], 0, 0
            if pending:
                writer.write_table(pa.concat_tables(pending).combine_chunks())
        # before the rename a rerun trusts: flushed to disk, or hashed (its SHA-256 goes into the flushed sidecar and
        # is checked before the part is trusted: packtools.pipeline.staged.damage)
        t_flush = time.perf_counter()
        if job.checksum:
            from .tokenizer.folder import file_sha256

            digest = file_sha256(tmp)
        else:
            digest = ""
            fsync_file(tmp)
        os.replace(tmp, job.staged)
        read_ahead(job.staged)
        clock["flush"] = time.perf_counter() - t_flush
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    all_first = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)
    all_trained = np.concatenate(trained) if trained else np.zeros(0, np.int64)
    all_heads = np.concatenate(heads) if heads else None
    # which tokenizer engine ran, and why; rows compared; characters left out (kept with the part for reruns)
    report = _tokenizer(job).part_report() if job.fmt != "tokenized" else None
    size = os.path.getsize(job.staged)
    save_sidecar(
        job.sidecar,
        all_lengths,
        all_first,
        job.staged,
        report=report,
        data_sha256=digest,
        data_size=size,
        data_crc32=direct.crc32 if direct.crc32 is not None else -1,
        trained=all_trained,
        heads=all_heads,
        closing=closing,
        tool_opener=opener,
    )
    result = {
        "rows": int(all_lengths.shape[0]),
        "reused": False,
        "seconds": time.perf_counter() - start,
        "data": job.staged,
        "phases": _phases(clock, time.perf_counter() - start),
    }
    if damaged is not None:
        result["damaged"] = damaged
    if report is not None:
        result["tokenizer"] = report
    return result


def _phases(clock: dict[str, float], total: float) -> dict[str, float]:
    """A part's busy seconds by phase from its ``clock``: ``read`` (reading thread), ``encode`` (tokenizing
    thread, less its waits for the reader), ``write`` (this thread, less its waits for the tokenizer) and
    ``flush``; they overlap, so they add up to more than the part's wall time."""
    encode = clock.get("encode", clock.get("encode_and_wait", 0.0) - clock.get("read_wait", 0.0))
    flush = clock.get("flush", 0.0)
    return {
        "read": round(clock.get("read", 0.0), 4),
        "encode": round(max(encode, 0.0), 4),
        "write": round(max(total - clock.get("stage_wait", 0.0) - flush, 0.0), 4),
        "flush": round(flush, 4),
    }


def iter_staged(paths: list[str]) -> Iterator[pa.Table]:
    """The record batches of staged files, in order, as tables (plain reads, bounded memory)."""
    for path in paths:
        with open_ipc(path, mapped=False) as reader:
            for batch in reader.batches():
                yield pa.Table.from_batches([batch])
