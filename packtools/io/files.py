"""Input files of the offline pipeline: finding them, fingerprinting them, reading them in bounded batches.

Accepted inputs: ``.jsonl``/``.json`` (JSON lines, or one JSON array of objects), ``.parquet``, Arrow IPC
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import atomic_path
from ..errors import PackingError

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


def _read_json(path: str) -> pa.Table:
    import pyarrow.json as pj

    try:
        return pj.read_json(path)
    except pa.ArrowInvalid as exc:
        arrow_error = exc
    # Not JSON lines that Arrow could type: one JSON document (an array of objects, or {"data": [...]}),
    # or JSON lines whose types vary between rows (parsed by Python, then typed by Arrow as a whole).
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        try:
            doc = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise PackingError(f"input {path!r} is neither JSON lines nor a JSON document: {exc}.") from None
    if isinstance(doc, dict) and len(doc) == 1 and isinstance(next(iter(doc.values())), list):
        doc = next(iter(doc.values()))
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise PackingError(f"input {path!r}: expected JSON lines or a JSON array of objects.")
    try:
        return pa.Table.from_pylist(doc)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise PackingError(f"input {path!r}: rows disagree on column types ({exc}; {arrow_error}).") from None


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


def iter_tables(
    file: InputFile, batch_rows: int = 1000, columns: Sequence[str] | None = None
) -> Iterator[pa.Table]:
    """Yield the rows of ``file`` as tables of at most ``batch_rows`` rows (only ``columns`` if given).

    Parquet and Arrow files are streamed with plain reads (memory bounded by one row group or record batch);
    a JSON file is parsed whole, then cut into batches.
    """
    cols = list(columns) if columns is not None else None
    if file.kind == "parquet":
        # Buffered reads (see _ipc_batches); pre_buffer=False, or pyarrow keeps the column chunks it read cached
        # until the file is closed, and memory grows with the file.
        pf = pq.ParquetFile(file.path, pre_buffer=False)
        yield from _rebatch(pf.iter_batches(batch_size=batch_rows, columns=cols), batch_rows)
    elif file.kind == "arrow":
        batches = _ipc_batches(file.path)
        if cols is not None:
            batches = (b.select(cols) for b in batches)
        yield from _rebatch(batches, batch_rows)
    else:
        yield from _rebatch(_json_batches(file.path, cols), batch_rows)


JSON_BLOCK_BYTES = 1 << 21


def _json_batches(path: str, cols: list[str] | None) -> Iterator[pa.RecordBatch]:
    """JSON lines streamed in 2 MiB blocks by Arrow's reader (memory bounded by a block, not the file);
    when the types vary between blocks (or it is not JSON lines), the rest comes from :func:`_read_json`."""
    import pyarrow.json as pj

    done = 0
    try:
        reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=JSON_BLOCK_BYTES))
        for batch in reader:
            batch = batch.select(cols) if cols is not None else batch
            yield batch
            done += batch.num_rows
        return
    except (pa.ArrowInvalid, KeyError):
        pass
    table = _read_json(path).slice(done)
    yield from (table.select(cols) if cols is not None else table).to_batches()


def read_schema(file: InputFile) -> pa.Schema:
    """The columns of ``file`` (of a JSON file: its first block's, or the whole file's if that block is unusual)."""
    if file.kind == "parquet":
        return pq.read_schema(file.path)
    if file.kind == "arrow":
        return IpcReader(pa.memory_map(file.path, "r")).schema
    import pyarrow.json as pj

    try:
        return pj.open_json(file.path, read_options=pj.ReadOptions(block_size=JSON_BLOCK_BYTES)).schema
    except pa.ArrowInvalid:
        return _read_json(file.path).schema


def count_rows(file: InputFile) -> int | None:
    """Rows in ``file`` when known without reading the data (parquet metadata), else ``None``."""
    if file.kind == "parquet":
        return pq.ParquetFile(file.path).metadata.num_rows
    return None


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
