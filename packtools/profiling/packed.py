"""Packed input (a ``seq_lengths`` column): profiled by its sequences, with its rows' fill, never by its rows.

A packed row holds several sequences; ``seq_lengths`` lists their lengths.  Profiling the rows (or counting
the segments of ``seq_lengths`` as tokens) would describe the packing, not the data, so
:func:`packtools.profile_lengths` reads the ``seq_lengths`` values instead and reports the rows, their
``max_length`` (from a packtools folder's ``manifest.json``, else the longest row) and their fill.

>>> import pyarrow as pa
>>> seqs, rows = packed_rows(pa.chunked_array([pa.array([[3, 4], [5], []])]))
>>> seqs.tolist(), rows.tolist(), packed_info(rows, 8, "given", None)["fill"]
([3, 4, 5], [7, 5, 0], 0.5)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..constants import SEQ_LENGTHS
from ..core.arrow import is_list_type
from ..errors import PackingError
from ..io.files import open_ipc, reading


def packed_rows(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(sequence lengths, tokens per row)`` of a packed ``seq_lengths`` column (list of ints per row)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    seqs, rows = [], []
    for chunk in chunks:
        if not is_list_type(chunk.type) or not pa.types.is_integer(chunk.type.value_type):
            raise PackingError(
                f"column {SEQ_LENGTHS!r} has type {chunk.type}; packed data holds a list of ints per row."
            )
        offsets = np.asarray(chunk.offsets).astype(np.int64)
        values = np.asarray(chunk.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]], np.int64)
        cs = np.concatenate(([0], np.cumsum(values)))
        rows.append(cs[offsets[1:] - offsets[0]] - cs[offsets[:-1] - offsets[0]])
        seqs.append(values)
    if not seqs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(seqs), np.concatenate(rows)


def packed_info(
    row_tokens: np.ndarray, max_length: int | None, source: str, split: str | None
) -> dict[str, Any]:
    rows = int(row_tokens.shape[0])
    m = int(max_length) if max_length else (int(row_tokens.max()) if rows else 0)
    src = source if max_length else "the longest row: no manifest says the max_length"
    fill = float(row_tokens.sum()) / (rows * m) if rows and m else 0.0
    return {"rows": rows, "max_length": m, "source": src, "fill": fill, "split": split}


def _manifest_of(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any] | None:
    from ..io.manifest import read_manifest

    for p in paths:
        if os.path.isdir(p):
            m = read_manifest(p)
            if m is not None:
                return m
    return None


def file_schema(path: str) -> pa.Schema:
    """The columns of a ``.parquet`` or Arrow IPC file; a cut, corrupted or non-Arrow file raises
    :class:`PackingError` naming it (:func:`packtools.io.files.reading`), not pyarrow's bare error."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with reading(path, "parquet"):
            return pq.read_schema(path)
    with reading(path, "arrow"), open_ipc(path) as reader:
        return reader.schema


def refuse_wrapped(given: Sequence[Any]) -> None:
    """Refuse a packtools folder packed with ``wrapped``: its rows are ``max_length`` cuts of one token stream
    with no ``seq_lengths``, so profiling them would describe the cut (every row ``max_length`` long), not the
    data, and recommend a ``max_length`` from it."""
    manifest = _manifest_of(given)
    stats = (manifest or {}).get("stats", {})
    if stats.get("packed") and stats.get("strategy") == "wrapped":
        inputs = [i.get("path") for i in manifest.get("inputs", []) if isinstance(i, dict)]
        raise PackingError(
            f"{os.fspath(given[0])!r} was packed with strategy 'wrapped': its rows are max_length="
            f"{stats.get('max_length')} cuts of one token stream, without sequence boundaries (no "
            f"{SEQ_LENGTHS!r}), so they say nothing about your sequences' lengths; profile the inputs it was "
            f"packed from{' (' + ', '.join(map(repr, inputs[:3])) + ')' if inputs else ''} instead.",
            param="paths",
        )


def _file_column(path: str, column: str) -> pa.ChunkedArray:
    """A small column read whole (``seq_lengths``: a few ints per packed row); read errors as in
    :func:`file_schema` (a file whose footer reads may still hold corrupted pages or batches)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with reading(path, "parquet"):
            return pq.read_table(path, columns=[column]).column(column)
    with reading(path, "arrow"), open_ipc(path) as reader:
        return reader.read_all().column(column).combine_chunks()


def profile_packed(
    paths: list[str], given: Sequence[Any], name: str | None
) -> tuple[np.ndarray, str, dict[str, Any]]:
    """Sequence lengths, name and :func:`packed_info` of packed files (``given``: what the user passed)."""
    seqs, rows = [], []
    for p in paths:
        if SEQ_LENGTHS not in file_schema(p).names:
            raise PackingError(
                f"file {p!r} has no {SEQ_LENGTHS!r} column but other inputs are packed; profile packed and "
                f"unpacked data apart.",
                param="paths",
            )
        s, r = packed_rows(_file_column(p, SEQ_LENGTHS))
        seqs.append(s)
        rows.append(r)
    manifest = _manifest_of(given) or {}
    stats = manifest.get("stats", {})
    split = stats.get("strategy") if stats.get("rows_split") else None
    info = packed_info(
        np.concatenate(rows),
        stats.get("max_length"),
        "from manifest.json",
        split if split in ("bfd_split", "wrapped") else None,
    )
    info["truncated"] = int(stats.get("rows_truncated") or 0)  # their lengths here are the cut ones
    if name is None:
        name = (
            os.path.basename(os.path.normpath(os.fspath(given[0])))
            if len(given) == 1
            else f"{len(paths)} files"
        )
    return np.concatenate(seqs), name, info
