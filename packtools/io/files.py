"""Input files of the offline pipeline: finding them, fingerprinting them, reading them in bounded batches.

Accepted inputs: ``.jsonl``/``.json`` (JSON lines, or one JSON array of objects; read in blocks, see
:mod:`packtools.io.json`), ``.parquet``, Arrow IPC
files or streams (``.arrow``, ``.feather``, ``.ipc``), directories holding such files (searched recursively,
in sorted order) and folders written by ``datasets.Dataset.save_to_disk`` (found by their ``state.json``).

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"text": ["a", "b", "c"]}), os.path.join(d, "part.parquet"))
>>> from packtools.io.discover import discover
>>> files = discover([d])
>>> [f.kind for f in files], sum(t.num_rows for _, t in iter_part(Part(files[0]), batch_rows=2))
(['parquet'], 3)
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import atomic_path
from ..errors import PackingError
from .discover import InputFile
from .json import LineBase, is_json_array, iter_json_array, iter_json_lines, line_ranges, row_line, row_texts

#: the system errors of a read that point at the disk or the mount (others, e.g. EMFILE or ENOMEM, at a limit)
_DEVICE_ERRNOS = frozenset(
    getattr(errno, n)
    for n in ("EIO", "ENXIO", "ENODEV", "ESTALE", "EREMOTEIO", "ENOLINK")
    if hasattr(errno, n)
)


@contextlib.contextmanager
def reading(path: str, kind: str) -> Iterator[None]:
    """Arrow's and Parquet's read errors (a cut, corrupted or mislabelled file) as one line naming the file.

    ``pa.ArrowIOError`` is ``OSError``: a folder where a file is read, and an error of the system's read (one
    with an ``errno``: EIO, ...), each get their own line, which claims nothing of the file's contents; a
    missing or forbidden file propagates as it is.
    """
    try:
        yield
    except (pa.ArrowInvalid, pa.ArrowIOError, EOFError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        name = "a Parquet" if kind == "parquet" else "an Arrow IPC"
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, IsADirectoryError) or (isinstance(exc, OSError) and os.path.isdir(path)):
            raise PackingError(
                f"input {path!r} is a folder, not {name} file; pass a file, or pass the folder where an input "
                f"may be a folder (pack_files, profile_lengths, packtools pack and profile read the files in it)."
            ) from None
        if isinstance(exc, OSError) and exc.errno is not None:
            code = errno.errorcode.get(exc.errno, str(exc.errno))
            fix = (
                "check the disk or mount it is on"
                if exc.errno in _DEVICE_ERRNOS
                else "remove the cause the system names (a limit, the memory, ...)"
            )
            raise PackingError(
                f"input {path!r} could not be read: the system's read failed ({code}: {detail}), which says "
                f"nothing of the file's contents; {fix}, then run again."
            ) from None
        raise PackingError(
            f"input {path!r} cannot be read as {name} file ({detail}): it is cut, corrupted or not {name} "
            f"file; copy it again, or leave it out."
        ) from None


def guarded(items: Iterator[Any], path: str, kind: str) -> Iterator[Any]:
    """``items``, with read errors raised while producing them turned into one line (see :func:`reading`)."""
    while True:
        with reading(path, kind):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


#: The end-of-stream marker of an Arrow IPC stream (continuation token and a zero length; before Arrow 0.15,
#: only the zero length).
EOS_MARKERS = (b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00")


class IpcReader:
    """An Arrow IPC *file* or *stream*, whichever ``source`` holds (``datasets`` cache files are streams).

    A stream must end with its end-of-stream marker: pyarrow ends a stream quietly at the end of the bytes when
    a copy was cut right after a record batch, and the rows after the cut would be lost without a word.  A
    stream without the marker raises :class:`PackingError` naming the file (``name``) once its batches are read.
    (An IPC *file* is checked by its footer, which a cut file lacks.)
    """

    def __init__(self, source: Any, name: str | None = None) -> None:
        self.name = name
        self._source = source
        try:
            self._file: Any = pa.ipc.open_file(source)
            self._stream: Any = None
            self.schema: pa.Schema = self._file.schema
        except pa.ArrowInvalid:
            source.seek(0)
            self._file = None
            self._stream = pa.ipc.open_stream(source)
            self.schema = self._stream.schema

    def batches(self) -> Iterator[pa.RecordBatch]:
        if self._file is None:
            end, rows = self._source.tell(), 0
            for batch in self._stream:
                end, rows = self._source.tell(), rows + batch.num_rows
                yield batch
            self._check_end(end, rows)
        else:
            for i in range(self._file.num_record_batches):
                yield self._file.get_batch(i)

    def _check_end(self, end: int, rows: int) -> None:
        size = self._source.size()
        self._source.seek(end)
        tail = self._source.read(size - end) if size - end <= 8 else b""
        if tail not in EOS_MARKERS:
            what = f"input {self.name!r}" if self.name else "an Arrow stream"
            raise PackingError(
                f"{what} is an Arrow IPC stream that ends after {rows:,} rows without its end-of-stream marker, so "
                f"it was cut (an interrupted copy or download, or a writer that was never closed) and rows may be "
                f"missing; copy the file again, or rewrite it and close the writer."
            )

    def read_all(self) -> pa.Table:
        if self._file is None:
            return pa.Table.from_batches(list(self.batches()), self.schema)
        return self._file.read_all()


@contextlib.contextmanager
def open_ipc(path: str, *, mapped: bool = True) -> Iterator[IpcReader]:
    """The one opener of Arrow IPC files (file or stream, see :class:`IpcReader`) outside this module's readers.

    ``mapped``: memory-mapped, so only the buffers read are touched (offsets without values, a few columns);
    otherwise plain reads, whose pages do not stay in the process's RSS (a whole staged file read in order).
    """
    with pa.memory_map(path, "r") if mapped else pa.OSFile(path, "rb") as source:
        yield IpcReader(source, path)


def mapped_table(path: str) -> pa.Table:
    """The whole Arrow IPC file or stream at ``path`` as a table over a memory map that stays open as long as the
    table lives (the gather reads the rows it needs from the mapped pages)."""
    return IpcReader(pa.memory_map(path, "r"), path).read_all()


def _ipc_batches(path: str) -> Iterator[pa.RecordBatch]:
    # Plain reads, not a memory map: mapped pages that were read stay in the process's RSS, which would
    # then grow with the input size.
    with reading(path, "arrow"):
        source = pa.OSFile(path, "rb")
    with source:
        with reading(path, "arrow"):
            reader = IpcReader(source, path)
        yield from guarded(reader.batches(), path, "arrow")


@dataclass(frozen=True)
class Part:
    """A piece of one input file that one job reads: parquet row groups ``[start, stop)``, JSON-lines bytes
    ``[start, stop)`` (cut after a newline), or the whole file (``stop == -1``)."""

    file: InputFile
    start: int = 0
    stop: int = -1

    def describe(self) -> str:
        if self.stop < 0:
            return self.file.path
        what = "row groups" if self.file.kind == "parquet" else "bytes"
        return f"{self.file.path} ({what} {self.start}-{self.stop})"

    def fingerprint(self) -> dict[str, object]:
        return {**self.file.fingerprint(), "start": self.start, "stop": self.stop}


def split_file(file: InputFile, part_rows: int = 1 << 17, part_bytes: int = 1 << 26) -> list[Part]:
    """Cut ``file`` into parts of about ``part_rows`` rows (parquet, at row-group boundaries) or ``part_bytes``
    bytes (JSON lines, after a newline); other files are one part."""
    if file.kind == "parquet":
        with reading(file.path, "parquet"):
            md = pq.ParquetFile(file.path).metadata
        sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        cuts, rows = [0], 0
        for g, n in enumerate(sizes):
            rows += n
            if rows >= part_rows and g + 1 < len(sizes):
                cuts.append(g + 1)
                rows = 0
        cuts.append(len(sizes))
        if len(cuts) <= 2:
            return [Part(file)]
        return [Part(file, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    if file.kind == "json" and not is_json_array(file.path):
        ranges = line_ranges(file.path, part_bytes)
        return [Part(file)] if len(ranges) <= 1 else [Part(file, a, b) for a, b in ranges]
    return [Part(file)]


class Where:
    """Names row ``i`` of a block in error messages: the file and its row (or line) number.

    For JSON lines (``unit="line"``), ``first`` is the line of the block's first row and ``rows`` the rows of the
    block before this table: row ``i`` is then found on the file's ``rows + i``-th non-blank line from there (the
    reader skips blank lines, so a row's line is not ``first + rows + i`` once one is skipped)."""

    def __init__(
        self,
        path: str,
        first: int | Callable[[], int],
        unit: str = "row",
        *,
        rows: int = 0,
        base: LineBase | None = None,
    ) -> None:
        self.path, self._first, self.unit, self.rows, self.base = path, first, unit, rows, base

    def texts(self) -> Iterator[bytes] | None:
        """The lines of the block's rows from its first on, as the file holds them, to the file's end (JSON
        lines; None for other files): for an error that must find its row in what Arrow's reading lost (a
        ``2.0`` read as a float; Arrow types a whole read block at once, so the row may be past this slice)."""
        if self.unit != "line":
            return None
        first = self._first() if callable(self._first) else self._first
        return row_texts(self.path, first, self.rows, self.base)

    def __call__(self, i: int = 0) -> str:
        first = self._first() if callable(self._first) else self._first
        if self.unit == "line":
            return f"input {self.path!r} line {row_line(self.path, first, self.rows + i, self.base)}"
        return f"input {self.path!r} {self.unit} {first + self.rows + i}"


def changed_since_found(file: InputFile) -> str | None:
    """How ``file`` differs on disk from when it was found (None: same size, mtime, inode and ctime).  The inode
    and ctime catch a file rewritten with its old size and mtime put back (``rsync -a``, ``cp -p``): parts read
    before and after it would mix its old and new rows.  A ``chmod`` or a new hard link of the file while it is
    read also changes its ctime, and is refused the same way: a rerun finds it as it is then."""
    try:
        st = os.stat(file.path)
    except OSError:
        return "it is gone"
    if st.st_size != file.size:
        return f"{file.size} bytes when the run started, {st.st_size} now"
    if st.st_mtime_ns != file.mtime_ns:
        return "rewritten: same size, new modification time"
    if st.st_ino != file.ino:
        return "rewritten: another file moved into place with the same size and modification time"
    if st.st_ctime_ns != file.ctime_ns:
        return (
            "rewritten: same size and modification time, but its status changed (written with its old "
            "modification time put back, or a chmod or hard link of it)"
        )
    return None


def iter_part(
    part: Part,
    batch_rows: int = 1000,
    columns: Sequence[str] | None = None,
    known_columns: Sequence[str] | None = None,
) -> Iterator[tuple[Where, pa.Table]]:
    """:func:`read_part`; an error reading a file that changed since the run found it is said to be that (a
    line cut by a writer is no malformed JSON to fix)."""
    try:
        yield from read_part(part, batch_rows, columns, known_columns)
    except (PackingError, OSError) as exc:
        changed = changed_since_found(part.file)
        if changed is None:
            raise
        raise _changed_error(part.file, changed, f"; reading it failed with: {str(exc).rstrip('.')}") from exc
    changed = changed_since_found(part.file)
    if changed is not None:  # cut at a line end, or rewritten: rows lost or mixed without a read error
        raise _changed_error(part.file, changed, "")


def _changed_error(file: InputFile, changed: str, failure: str) -> PackingError:
    return PackingError(
        f"input {file.path!r} changed while packing ({changed}), so what was read may miss rows or mix its old "
        f"and new contents{failure}. Run again once nothing writes to it (or pack a copy)."
    )


def read_part(
    part: Part,
    batch_rows: int = 1000,
    columns: Sequence[str] | None = None,
    known_columns: Sequence[str] | None = None,
) -> Iterator[tuple[Where, pa.Table]]:
    """Yield ``(where, table)`` for the rows of ``part`` in tables of at most ``batch_rows`` rows (only
    ``columns``, when given and present).  Memory is bounded by one row group, record batch or JSON block.
    ``where(i)`` names row ``i`` of the table: ``input 'f.parquet' row 12``, ``input 'f.jsonl' line 13`` or
    ``input 'f.json' object 12`` (0-based rows and objects, 1-based lines).

    ``known_columns``: the columns the run chose its token columns from (JSON has no schema: they are those of
    the first block); a later JSON block holding any other column raises :class:`PackingError` naming the
    file, the row and the column, instead of dropping it."""
    file = part.file
    path = file.path
    cols = list(columns) if columns is not None else None
    if file.kind == "parquet":
        # Buffered reads (see _ipc_batches); pre_buffer=False, or pyarrow keeps the column chunks it read cached
        # until the file is closed, and memory grows with the file.
        with reading(path, "parquet"):
            pf = pq.ParquetFile(path, pre_buffer=False)
        md = pf.metadata
        stop = md.num_row_groups if part.stop < 0 else part.stop
        row = sum(md.row_group(g).num_rows for g in range(part.start))
        if cols is not None:
            cols = [c for c in cols if c in pf.schema_arrow.names]
        for g in range(part.start, stop):
            batches = pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=cols)
            for batch in guarded(batches, path, "parquet"):
                yield Where(path, row), pa.Table.from_batches([batch])
                row += batch.num_rows
    elif file.kind == "arrow":
        row = 0
        for batch in _ipc_batches(path):
            if cols is not None:
                batch = batch.select([c for c in cols if c in batch.schema.names])
            for start in range(0, batch.num_rows, batch_rows):
                yield Where(path, row + start), pa.Table.from_batches([batch.slice(start, batch_rows)])
            row += batch.num_rows
    elif is_json_array(path):  # objects may span lines: rows are named by their index in the array
        row = 0
        for _, table in iter_json_array(path, batch_rows):
            _check_known(table, known_columns, Where(path, row, "object"))
            yield Where(path, row, "object"), _select(table, cols)
            row += table.num_rows
    else:
        base = LineBase(path, part.start)
        stop = part.stop if part.stop >= 0 else None
        for rel, table in iter_json_lines(path, part.start, stop):
            _check_known(table, known_columns, Where(path, lambda r=rel: base.value + r, "line", base=base))
            table = _select(table, cols)
            for start in range(0, table.num_rows, batch_rows):
                yield (
                    Where(path, lambda r=rel: base.value + r, "line", rows=start, base=base),
                    table.slice(start, batch_rows),
                )


def _check_known(table: pa.Table, known: Sequence[str] | None, where: Where) -> None:
    if known is None:
        return
    new = [c for c in table.column_names if c not in known]
    if new:
        col = table.column(new[0])
        first = next((i for i in range(table.num_rows) if col[i].is_valid), 0)
        raise PackingError(
            f"{where(first)} has the column {new[0]!r}, which the first rows of the input lack (the token columns "
            f"were chosen from those: the first file's schema, or the first block of a JSON file), so it would be "
            f"dropped without a word; give every row the same keys: put {new[0]!r} in the first rows too (an empty "
            f"list where there is none), or remove it from these rows (choosing columns=[...] does not help: a key "
            f"the first rows lack cannot be listed as left out, so it is refused either way)."
        )


def _select(table: pa.Table, columns: list[str] | None) -> pa.Table:
    return table if columns is None else table.select([c for c in columns if c in table.column_names])


def read_schema(file: InputFile) -> pa.Schema:
    """The columns of ``file`` (for JSON, those of its first block: JSON has no schema)."""
    if file.kind == "parquet":
        with reading(file.path, "parquet"):
            return pq.read_schema(file.path)
    if file.kind == "arrow":
        with reading(file.path, "arrow"):
            return IpcReader(pa.memory_map(file.path, "r"), file.path).schema
    for _, table in iter_part(Part(file), 64):
        return table.schema
    return pa.schema([])


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """Read a ``.parquet`` file or an Arrow IPC file/stream (``.arrow``, ``.feather``, datasets cache files)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist.")
    if path.endswith(".parquet"):
        with reading(path, "parquet"):
            return pq.read_table(path, memory_map=True)
    if path.endswith((".arrow", ".feather", ".ipc")):
        with reading(path, "arrow"):
            return mapped_table(path)
    raise PackingError(f"input {path!r}: unknown format; give a .parquet or .arrow file.")


def write_table(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """Write ``table`` to ``path`` (``.parquet`` or ``.arrow``) atomically: write aside, then rename."""
    path = os.fspath(path)
    if not path.endswith((".parquet", ".arrow")):
        raise PackingError(f"output {path!r}: name the output file .parquet or .arrow.", param="out")
    with atomic_path(path) as tmp:
        if path.endswith(".parquet"):
            pq.write_table(table, tmp)
        else:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
