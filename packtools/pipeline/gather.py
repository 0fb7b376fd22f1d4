"""Stage 3 of :func:`packtools.pack_files`: gather packed rows from memory-mapped data files and write them as
shards of a ``datasets.save_to_disk`` folder.

:func:`block_steps` runs one :class:`WriteJob` (one block of rows of the global plan) on any executor: it maps
only the files the block reads, copies the block's segments chunk by chunk, drops each chunk's mapped pages
once copied (so memory holds one block, whatever the token count), and writes one Arrow stream shard under a
temporary name renamed into place.  The bytes depend on the plan and the data only.

>>> import os, tempfile, pyarrow as pa
>>> folder = ShardFolder(tempfile.mkdtemp())
>>> folder.write(pa.table({"input_ids": [[1, 2], [3]]}))
>>> folder.finish(pa.schema([("input_ids", pa.list_(pa.int64()))]))
['data-00000-of-00001.arrow']
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from .._atomic import fsync_file, removed_on_error
from ..compat.datasets import STATE_FILE, saved_state
from ..core.arrow import ListColumn
from ..core.pack import pack_columns, read_columns
from ..core.plan import PackPlan
from ..io.direct import DirectFile, arrow_sink
from ..io.files import IpcReader, reading
from ..io.pages import PageReleaser
from .executors import TwoSteps


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")


# -- output shards -------------------------------------------------------------------------------------
def write_shard(path: str, table: pa.Table) -> int:
    """Write one Arrow stream file (the format of ``datasets`` cache files), past the page cache
    (:mod:`packtools.io.direct`: the run does not read it back).  Returns the file's CRC-32, computed from the
    buffers as they are written (the output's manifest records it: :func:`~.outcheck.output_damage`)."""
    direct = DirectFile(path, crc=True)
    with arrow_sink(direct) as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert direct.crc32 is not None
    return direct.crc32


class ShardFolder:
    """Shards written under temporary names, renamed ``data-XXXXX-of-NNNNN.arrow`` once their count is known."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.paths: list[str] = []
        self.schema: pa.Schema | None = None
        #: each shard's ``[bytes, crc32]`` by its final name (filled in by :meth:`finish`): the manifest's
        #: ``shards``
        self.sums: dict[str, list[int]] = {}
        self._sums: list[list[int]] = []

    def write(self, table: pa.Table) -> None:
        path = os.path.join(self.folder, f"_shard-{len(self.paths):05d}.arrow")
        crc = write_shard(path, table)
        self.paths.append(path)
        self._sums.append([os.path.getsize(path), crc])
        self.schema = table.schema

    def finish(self, empty_schema: pa.Schema, fingerprint: str = "") -> list[str]:
        if not self.paths:
            self.write(empty_schema.empty_table())
        n = len(self.paths)
        names = [shard_name(i, n, run_token(fingerprint)) for i in range(n)]
        for path, name, sums in zip(self.paths, names, self._sums):
            os.replace(path, os.path.join(self.folder, name))
            self.sums[name] = sums
        write_dataset_files(self.folder, names, fingerprint)
        return names


def shard_rows(weights: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``(start, stop)`` whose ``weights`` add up to at most ``budget`` (at least one
    row each), as :meth:`packtools.core.plan.PackPlan.row_blocks` cuts a plan by its tokens.

    >>> shard_rows(np.array([40, 0, 120, 20]), 100)
    [(0, 2), (2, 3), (3, 4)]
    """
    csum = np.concatenate(([0], np.cumsum(weights)))
    blocks, start = [], 0
    while start < len(weights):
        stop = max(int(np.searchsorted(csum, csum[start] + budget, side="right")) - 1, start + 1)
        blocks.append((start, stop))
        start = stop
    return blocks


def shard_name(i: int, n: int, run: str = "") -> str:
    """``data-RUN-XXXXX-of-NNNNN.arrow``: ``run`` (the start of the run's fingerprint) differs between runs with
    other inputs or options, so a replacing run never reuses an old shard's name: a reader holding the old
    ``state.json`` then fails to find its shards instead of reading the new ones in their place (a mix)."""
    return f"data-{run}-{i:05d}-of-{n:05d}.arrow" if run else f"data-{i:05d}-of-{n:05d}.arrow"


def run_token(fingerprint: str) -> str:
    """The part of a run's fingerprint that goes into its shard names."""
    return fingerprint[:12]


def write_dataset_files(folder: str, names: Sequence[str], fingerprint: str) -> None:
    """``state.json`` and ``dataset_info.json`` of a ``datasets.save_to_disk`` folder holding shards ``names``.

    ``fingerprint`` (the run's, from its inputs and options) becomes the dataset's ``_fingerprint``: the files
    are the same bytes for the same run wherever and however it ran."""
    digest = hashlib.sha256((fingerprint + "".join(names)).encode()).hexdigest()[:16]
    write_json(os.path.join(folder, STATE_FILE), saved_state(list(names), digest))
    write_json(os.path.join(folder, "dataset_info.json"), {"description": "packed by packtools"})


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
            with reading(path, "arrow"):
                table = IpcReader(pa.BufferReader(pa.py_buffer(mm)), path).read_all()
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
            # a view is still alive somewhere; the mapping goes with it
            with contextlib.suppress(BufferError):
                mm.close()
            fh.close()
        self._maps = []


# -- one block of output rows (runs in a worker) -----------------------------------------------------------
@dataclass(frozen=True)
class WriteJob:
    """Rows of the global plan to gather and write as one shard (picklable).

    ``seg_*`` and ``row_offsets`` are that block of the plan (sources are global row numbers); ``sources`` are
    the data files it reads, as ``(path, first global row, rows)``.
    """

    path: str
    max_length: int
    strategy: str
    columns: tuple[str, ...]
    sources: tuple[tuple[str, int, int], ...]
    seg_source: np.ndarray
    seg_start: np.ndarray
    seg_length: np.ndarray
    row_offsets: np.ndarray


def gather_block(job: WriteJob, scratch: dict[str, np.ndarray] | None = None) -> pa.Table:
    """The packed rows of one block, gathered from the (memory-mapped) data files it reads.

    With ``scratch`` (:func:`packtools.core.pack.pack_columns`'s: column name -> buffer, filled in on first
    use), the values are gathered into those buffers: the table is then a view of them, to be written before
    they are handed to another block (:class:`BlockBuffers`)."""
    mapped = MappedArrow([p for p, _, _ in job.sources], job.columns)
    try:
        cols, lengths = read_columns(mapped.table, list(job.columns))
        local_start = np.cumsum([0] + [n for _, _, n in job.sources[:-1]]).astype(np.int64)
        global_start = np.array([r for _, r, _ in job.sources], np.int64)
        which = np.searchsorted(global_start, job.seg_source, side="right") - 1
        local = (job.seg_source - global_start[which] + local_start[which]).astype(np.int64)
        p = PackPlan(
            job.max_length, job.strategy, local, job.seg_start, job.seg_length, job.row_offsets, lengths
        )
        return pack_columns(cols, p, release=mapped.release, scratch=scratch)
    finally:
        mapped.close()


def save_block(job: WriteJob, table: pa.Table) -> dict[str, Any]:
    """Write the gathered ``table`` of one block to ``job.path``, via a temporary name in the same folder.
    Returns ``{"rows", "bytes", "crc32", "phases"}``."""
    tmp = f"{job.path}.tmp-{os.getpid()}"
    with removed_on_error(tmp):
        t = time.perf_counter()
        crc = write_shard(tmp, table)
        t_flush = time.perf_counter()
        # flushed here, while the next block is gathered: the install's flush of the output finds it on disk
        fsync_file(tmp)
        os.replace(tmp, job.path)
    done = time.perf_counter()
    return {
        "rows": table.num_rows,
        "bytes": os.path.getsize(job.path),
        "crc32": crc,
        "phases": {"write": round(t_flush - t, 4), "flush": round(done - t_flush, 4)},
    }


class BlockBuffers:
    """The value buffers of a run's gathered blocks, handed from a written block to the next one gathered
    (thread-safe).

    A block's values are ~64 MB: gathered into fresh memory, each block paid a page fault per page, most of the
    gather's time at 1 GB where fresh memory is expensive (``docs/tokenize.md``).  A set of buffers is held by
    one block at a time, from its gather until its shard is written, then kept for the next block: at most
    two sets exist (the local executor gathers one block ahead of the one it writes).  Each run makes its own
    (:func:`block_steps`), so none outlives it; a copy sent to a worker process starts empty.
    """

    KEEP = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[dict[str, np.ndarray]] = []

    def take(self) -> dict[str, np.ndarray]:
        with self._lock:
            return self._free.pop() if self._free else {}

    def give(self, scratch: dict[str, np.ndarray]) -> None:
        """Hand back a block's buffers, once nothing reads its table any more."""
        with self._lock:
            if len(self._free) < self.KEEP:
                self._free.append(scratch)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()


def gather_timed(
    job: WriteJob, buffers: BlockBuffers | None = None
) -> tuple[pa.Table, float, dict[str, np.ndarray] | None]:
    """:func:`gather_block` (into buffers of ``buffers``), the seconds it took (the run's timings report them),
    and the buffers, to hand back once the table is written (:func:`save_gathered`)."""
    t = time.perf_counter()
    scratch = buffers.take() if buffers is not None else None
    table = gather_block(job, scratch)  # failed: its buffers are dropped
    return table, time.perf_counter() - t, scratch


def save_gathered(
    job: WriteJob,
    gathered: tuple[pa.Table, float, dict[str, np.ndarray] | None],
    buffers: BlockBuffers | None = None,
) -> dict[str, Any]:
    """:func:`save_block` of a :func:`gather_timed` block, its gather seconds added to its ``phases``; its
    buffers go back to ``buffers`` once the shard is written (not after a failed write)."""
    table, seconds, scratch = gathered
    out = save_block(job, table)
    del table, gathered  # the buffers' views: the shard holds the bytes now
    if buffers is not None and scratch is not None:
        buffers.give(scratch)
    out["phases"]["gather"] = round(seconds, 4)
    return out


def block_steps() -> TwoSteps:
    """One run's job function for its :class:`WriteJob` s: gather one block of packed rows, then write it to
    ``job.path`` (:func:`gather_block`, then :func:`save_block`); the local executor gathers the next block
    while this one is written, into the buffers of a written one (:class:`BlockBuffers`)."""
    buffers = BlockBuffers()
    return TwoSteps(partial(gather_timed, buffers=buffers), partial(save_gathered, buffers=buffers))
