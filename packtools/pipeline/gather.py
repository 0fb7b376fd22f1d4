"""The out-of-core parts of the pipeline: a staging file, memory-mapped Arrow inputs, a gather that gives
mapped pages back, and shard folders in the ``datasets.save_to_disk`` layout.

>>> import os, tempfile, pyarrow as pa
>>> folder = ShardFolder(tempfile.mkdtemp())
>>> folder.write(pa.table({"input_ids": [[1, 2], [3]]}))
>>> folder.finish(pa.schema([("input_ids", pa.list_(pa.int64()))]))
['data-00000-of-00001.arrow']
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..constants import IGNORE_INDEX
from ..core.arrow import ListColumn
from ..errors import PackingError
from ..io.files import IpcReader
from ..io.pages import PageReleaser


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")


# -- output shards -------------------------------------------------------------------------------------
def write_shard(path: str, table: pa.Table) -> None:
    """Write one Arrow stream file (the format of ``datasets`` cache files)."""
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


class ShardFolder:
    """Shards written under temporary names, renamed ``data-XXXXX-of-NNNNN.arrow`` once their count is known."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.paths: list[str] = []
        self.schema: pa.Schema | None = None

    def write(self, table: pa.Table) -> None:
        path = os.path.join(self.folder, f"_shard-{len(self.paths):05d}.arrow")
        write_shard(path, table)
        self.paths.append(path)
        self.schema = table.schema

    def finish(self, empty_schema: pa.Schema) -> list[str]:
        if not self.paths:
            self.write(empty_schema.empty_table())
        n = len(self.paths)
        names = [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
        for path, name in zip(self.paths, names):
            os.replace(path, os.path.join(self.folder, name))
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": hashlib.sha256("".join(names).encode() + self.folder.encode()).hexdigest()[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        write_json(os.path.join(self.folder, "state.json"), state)
        write_json(os.path.join(self.folder, "dataset_info.json"), {"description": "packed by packtools"})
        return names


# -- memory-mapped staged tokens -----------------------------------------------------------------------
class MappedArrow:
    """Arrow IPC files mapped read-only, whose touched pages can be handed back to the OS.

    Mapped pages that were read count in the process's RSS until unmapped, and the kernel maps up to 16
    neighbouring pages on each fault, so a scattered gather would soon hold the whole file.  The gather
    therefore works chunk by chunk and drops each chunk's pages (``MADV_DONTNEED``) once done with it.
    ``table`` holds the ``columns`` of all files, one after the other, as zero-copy views of the maps.
    """

    def __init__(self, paths: Sequence[str], columns: Sequence[str] | None = None) -> None:
        self._maps: list[tuple[Any, mmap.mmap, np.ndarray]] = []
        tables = []
        for path in paths:
            fh = open(path, "rb")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append((fh, mm, np.frombuffer(mm, np.uint8)))
            table = IpcReader(pa.BufferReader(pa.py_buffer(mm))).read_all()
            tables.append(table.select(list(columns)) if columns is not None else table)
        self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        self._releaser = PageReleaser()  # after mapping, so it knows these mappings

    def _maps_over(self, values: np.ndarray) -> bool:
        """Whether ``values`` lies inside one of the mappings."""
        for _, _, base in self._maps:
            offset = values.ctypes.data - base.ctypes.data
            if 0 <= offset <= base.nbytes - values.nbytes:
                return True
        return False

    def zero_copy(self, cols: list[ListColumn]) -> bool:
        """Whether every chunk's values lie in a mapping (not so for compressed IPC files)."""
        return all(c.values.nbytes == 0 or self._maps_over(c.values) for col in cols for c in col.chunks)

    def release(self, values: np.ndarray) -> None:
        """Drop the mapped pages under ``values`` (a view into one of the mappings)."""
        self._releaser.release(values)

    def close(self) -> None:
        self.table = None
        for fh, mm, _ in self._maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
            fh.close()
        self._maps = []


class Staging:
    """Appends token tables to an Arrow IPC file, in record batches of up to ``batch_rows`` rows / ``batch_bytes``."""

    def __init__(self, path: str, batch_rows: int = 65536, batch_bytes: int = 1 << 26) -> None:
        self.path, self.batch_rows, self.batch_bytes = path, batch_rows, batch_bytes
        self.pending: list[pa.Table] = []
        self.pending_rows = self.pending_bytes = 0
        self.writer: Any = None
        self.sink: Any = None
        self.schema: pa.Schema | None = None

    def append(self, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
            self.sink = pa.OSFile(self.path, "wb")
            self.writer = pa.ipc.new_file(self.sink, self.schema)
        elif table.schema != self.schema:
            try:
                table = table.cast(self.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
                raise PackingError(
                    f"input files disagree on columns or types: {table.schema} vs {self.schema} ({exc})."
                ) from None
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.pending_bytes += table.nbytes
        if self.pending_rows >= self.batch_rows or self.pending_bytes >= self.batch_bytes:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending).combine_chunks())
            self.pending, self.pending_rows, self.pending_bytes = [], 0, 0

    def close(self, schema: pa.Schema) -> None:
        if self.writer is None:
            self.append(schema.empty_table())
        self.flush()
        self.writer.close()
        self.sink.close()


# -- plans and labels ----------------------------------------------------------------------------------
def first_loss(labels: ListColumn, mapped: MappedArrow) -> np.ndarray:
    """Per row, the position of the first token with a label (not -100); the row length if there is none."""
    parts = []
    for chunk in labels.chunks:
        lengths = np.diff(chunk.offsets)
        first = lengths.copy()
        idx = np.flatnonzero(chunk.values[: chunk.offsets[-1]] != IGNORE_INDEX)
        rows = np.searchsorted(chunk.offsets, idx, side="right") - 1
        uniq, where = np.unique(rows, return_index=True)
        first[uniq] = idx[where] - chunk.offsets[uniq]
        parts.append(first)
        mapped.release(chunk.values)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
