"""Input files of the offline pipeline: finding them, fingerprinting them, reading them in bounded batches.

Accepted inputs: ``.jsonl``/``.json`` (JSON lines, or one JSON array of objects; read in blocks, see
:mod:`packtools.io.json`), ``.parquet``, Arrow IPC
files or streams (``.arrow``, ``.feather``, ``.ipc``), directories holding such files (searched recursively,
in sorted order) and folders written by ``datasets.Dataset.save_to_disk`` (found by their ``state.json``).

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"text": ["a", "b", "c"]}), os.path.join(d, "part.parquet"))
>>> files = discover([d])
>>> [f.kind for f in files], sum(t.num_rows for t in iter_tables(files[0], batch_rows=2))
(['parquet'], 3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import atomic_path
from ..errors import PackingError
from .json import LineBase, is_json_array, iter_json_array, iter_json_lines, line_ranges

SUFFIX_KINDS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}


@dataclass(frozen=True)
class InputFile:
    """One input file: its absolute path, reader kind (``json``, ``parquet``, ``arrow``), size and mtime."""

    path: str
    kind: str
    size: int
    mtime_ns: int

    def fingerprint(self) -> dict[str, object]:
        """As :func:`packtools.io.fingerprint.file_fingerprint` (taken when the file was found)."""
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def _input_file(path: str) -> InputFile:
    kind = SUFFIX_KINDS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise PackingError(
            f"input {path!r}: unknown file type; give .jsonl/.json, .parquet, .arrow/.feather files, "
            f"directories of them, or a datasets save_to_disk folder."
        )
    st = os.stat(path)
    return InputFile(os.path.abspath(path), kind, st.st_size, st.st_mtime_ns)


def _saved_dataset_files(folder: str) -> list[str]:
    with open(os.path.join(folder, "state.json")) as fh:
        state = json.load(fh)
    return [os.path.join(folder, f["filename"]) for f in state.get("_data_files", [])]


def discover(inputs: Sequence[str | os.PathLike[str]]) -> list[InputFile]:
    """Expand inputs (files, directories, ``save_to_disk`` folders) into a sorted list of files."""
    files: list[InputFile] = []
    for item in inputs:
        path = os.fspath(item)
        if not os.path.exists(path):
            raise FileNotFoundError(f"input {path!r} does not exist.")
        if os.path.isfile(path):
            files.append(_input_file(path))
        elif os.path.exists(os.path.join(path, "state.json")):
            files.extend(_input_file(p) for p in _saved_dataset_files(path))
        elif os.path.exists(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise PackingError(
                f"input {path!r} is a saved DatasetDict with splits {splits}; pass one split folder, "
                f"e.g. {os.path.join(path, splits[0] if splits else 'train')!r}."
            )
        else:
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    if not name.startswith(".") and os.path.splitext(name)[1].lower() in SUFFIX_KINDS:
                        found.append(_input_file(os.path.join(dirpath, name)))
            if not found:
                raise PackingError(
                    f"input directory {path!r} holds no .jsonl/.json/.parquet/.arrow/.feather file."
                )
            files.extend(found)
    seen: set[str] = set()
    unique = [f for f in files if not (f.path in seen or seen.add(f.path))]
    if not unique:
        raise PackingError("no input given; name files, directories or save_to_disk folders.")
    return unique


class IpcReader:
    """An Arrow IPC *file* or *stream*, whichever ``source`` holds (``datasets`` cache files are streams)."""

    def __init__(self, source: Any) -> None:
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
            yield from self._stream
        else:
            for i in range(self._file.num_record_batches):
                yield self._file.get_batch(i)

    def read_all(self) -> pa.Table:
        return (self._stream if self._file is None else self._file).read_all()


def _ipc_batches(path: str) -> Iterator[pa.RecordBatch]:
    # Plain reads, not a memory map: mapped pages that were read stay in the process's RSS, which would
    # then grow with the input size.
    with pa.OSFile(path, "rb") as source:
        yield from IpcReader(source).batches()


def _rebatch(batches: Iterator[pa.RecordBatch], batch_rows: int) -> Iterator[pa.Table]:
    for batch in batches:
        for start in range(0, batch.num_rows, batch_rows):
            yield pa.Table.from_batches([batch.slice(start, batch_rows)])


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
    """Names row ``i`` of a block in error messages: the file and its row (or line) number."""

    def __init__(self, path: str, first: int | Callable[[], int], unit: str = "row") -> None:
        self.path, self._first, self.unit = path, first, unit

    def __call__(self, i: int = 0) -> str:
        first = self._first() if callable(self._first) else self._first
        return f"input {self.path!r} {self.unit} {first + i}"


def iter_part(
    part: Part, batch_rows: int = 1000, columns: Sequence[str] | None = None
) -> Iterator[tuple[Where, pa.Table]]:
    """Yield ``(where, table)`` for the rows of ``part`` in tables of at most ``batch_rows`` rows (only
    ``columns``, when given and present).  Memory is bounded by one row group, record batch or JSON block.
    ``where(i)`` names row ``i`` of the table: ``input 'f.parquet' row 12``, ``input 'f.jsonl' line 13`` or
    ``input 'f.json' object 12`` (0-based rows and objects, 1-based lines)."""
    file = part.file
    path = file.path
    cols = list(columns) if columns is not None else None
    if file.kind == "parquet":
        # Buffered reads (see _open_ipc); pre_buffer=False, or pyarrow keeps the column chunks it read cached
        # until the file is closed, and memory grows with the file.
        pf = pq.ParquetFile(path, pre_buffer=False)
        md = pf.metadata
        stop = md.num_row_groups if part.stop < 0 else part.stop
        row = sum(md.row_group(g).num_rows for g in range(part.start))
        if cols is not None:
            cols = [c for c in cols if c in pf.schema_arrow.names]
        for g in range(part.start, stop):
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=cols):
                yield Where(path, row), pa.Table.from_batches([batch])
                row += batch.num_rows
    elif file.kind == "arrow":
        row = 0
        for batch in _ipc_batches(path):
            if cols is not None:
                batch = batch.select([c for c in cols if c in batch.schema.names])
            for table in _rebatch(iter([batch]), batch_rows):
                yield Where(path, row), table
                row += table.num_rows
    elif is_json_array(path):  # objects may span lines: rows are named by their index in the array
        row = 0
        for _, table in iter_json_array(path, batch_rows):
            yield Where(path, row, "object"), _select(table, cols)
            row += table.num_rows
    else:
        base = LineBase(path, part.start)
        stop = part.stop if part.stop >= 0 else None
        for rel, table in iter_json_lines(path, part.start, stop):
            table = _select(table, cols)
            for start in range(0, table.num_rows, batch_rows):
                yield (
                    Where(path, lambda r=rel + start: base.value + r, "line"),
                    table.slice(start, batch_rows),
                )


def _select(table: pa.Table, columns: list[str] | None) -> pa.Table:
    return table if columns is None else table.select([c for c in columns if c in table.column_names])


def iter_tables(
    file: InputFile, batch_rows: int = 1000, columns: Sequence[str] | None = None
) -> Iterator[pa.Table]:
    """Yield the rows of ``file`` as tables of at most ``batch_rows`` rows (only ``columns`` if given)."""
    for _, table in iter_part(Part(file), batch_rows, columns):
        yield table


def read_schema(file: InputFile) -> pa.Schema:
    """The columns of ``file`` (for JSON, those of its first block: JSON has no schema)."""
    if file.kind == "parquet":
        return pq.read_schema(file.path)
    if file.kind == "arrow":
        return IpcReader(pa.memory_map(file.path, "r")).schema
    for _, table in iter_part(Part(file), 64):
        return table.schema
    return pa.schema([])


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """Read a ``.parquet`` file or an Arrow IPC file/stream (``.arrow``, ``.feather``, datasets cache files)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist.")
    if path.endswith(".parquet"):
        return pq.read_table(path, memory_map=True)
    if path.endswith((".arrow", ".feather", ".ipc")):
        return IpcReader(pa.memory_map(path, "r")).read_all()
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
