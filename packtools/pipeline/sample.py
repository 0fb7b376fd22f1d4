"""A built-in corpus that needs no download: the Python standard library's source files as byte-level ids."""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import pyarrow as pa


def stdlib_files(limit: int | None = None) -> list[str]:
    """Sorted paths of the ``.py`` files of the running interpreter's standard library."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in {"site-packages", "__pycache__", "dist-packages"}
        )
        paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return paths[:limit] if limit is not None else paths


def byte_level_table(texts: list[bytes]) -> pa.Table:
    """``input_ids`` = the bytes of each text as int32 ids 0..255 (a byte-level vocabulary of 256)."""
    lengths = np.fromiter(map(len, texts), np.int64, count=len(texts))
    values = np.frombuffer(b"".join(texts), np.uint8).astype(np.int32)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})


def stdlib_table(limit: int | None = 2000) -> pa.Table:
    """One row per standard-library source file, its UTF-8 bytes as ids (:func:`byte_level_table`).

    >>> t = stdlib_table(limit=3)
    >>> t.column_names, t.num_rows
    (['input_ids'], 3)
    """
    texts = []
    for path in stdlib_files(limit):
        with open(path, "rb") as fh:
            texts.append(fh.read())
    return byte_level_table(texts)
