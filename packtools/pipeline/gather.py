"""The out-of-core parts of the pipeline: a staging file, memory-mapped Arrow inputs, a gather that gives
mapped pages back, plan slices, and shard folders in the ``datasets.save_to_disk`` layout.

>>> from packtools.core.plan import plan
>>> p = plan([5, 2, 3, 1], max_length=4)
>>> plan_slices(p, shard_tokens=8), slice_plan(p, 1, 3).row_lengths.tolist()
([(0, 2), (2, 3)], [4, 2])
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

from ..constants import IGNORE_INDEX, SEQ_LENGTHS
from ..core.arrow import ListColumn, list_array
from ..core.pack import gather_column
from ..core.plan import PackPlan
from ..errors import PackingError
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
            source = pa.BufferReader(pa.py_buffer(mm))
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
            tables.append(table.select(list(columns)) if columns is not None else table)
        self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        self._releaser = PageReleaser()  # after mapping, so it knows these mappings

    def _find(self, values: np.ndarray) -> tuple[mmap.mmap, int] | None:
        for _, mm, base in self._maps:
            offset = values.ctypes.data - base.ctypes.data
            if 0 <= offset <= base.nbytes - values.nbytes:
                return mm, offset
        return None

    def zero_copy(self, cols: list[ListColumn]) -> bool:
        """Whether every chunk's values lie in a mapping (not so for compressed IPC files)."""
        return all(
            c.values.nbytes == 0 or self._find(c.values) is not None for col in cols for c in col.chunks
        )

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


def gather_released(col: ListColumn, p: PackPlan, mapped: MappedArrow) -> np.ndarray:
    """:func:`packtools.core.pack.gather_column`, dropping each chunk's mapped pages after use."""
    return gather_column(col, p, release=mapped.release)


def pack_slice(cols: list[ListColumn], p: PackPlan, mapped: MappedArrow) -> pa.Table:
    """:func:`packtools.core.pack.pack_columns` with :func:`gather_released`."""
    offsets = p.token_offsets
    arrays = [
        list_array(
            offsets, gather_released(col, p, mapped), pa.types.is_large_list(col.type), col.type.value_type
        )
        for col in cols
    ]
    names = [col.name for col in cols]
    if p.strategy != "wrapped":
        arrays.append(p.seq_lengths)
        names.append(SEQ_LENGTHS)
    return pa.Table.from_arrays(arrays, names=names)


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
def plan_slices(p: PackPlan, shard_tokens: int) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of at most ``shard_tokens`` tokens each (at least one row each)."""
    return p.row_blocks(shard_tokens)


def slice_plan(p: PackPlan, r0: int, r1: int) -> PackPlan:
    """The rows ``r0:r1`` of a plan, as a plan of their own over the same sources."""
    return p.slice_rows(r0, r1)


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
