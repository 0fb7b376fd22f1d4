"""Every read of Hugging Face ``datasets`` internals, checked against the versions in :data:`CHECKED`.

packtools reads a ``Dataset`` without copying it: the Arrow table behind it (``dataset.data.table``, public)
and its row mapping after ``select`` / ``shuffle`` / ``train_test_split`` (``Dataset._indices``, private: a
one-column table of row numbers, or None).  It keys its caches on ``Dataset._fingerprint`` (private) and keeps
an ``IterableDataset``'s output format (``IterableDataset._formatting``, private: there is no public getter).
``pack_dataset`` writes its packed rows where ``datasets.map`` would (``datasets.fingerprint.
get_temporary_cache_files_directory``, :func:`temporary_cache_directory`) and maps them back as ``datasets``
maps its own cache files (``datasets.table.MemoryMappedTable.from_file``, :func:`memory_mapped_table`); the
module is passed in, never imported here.  The pipeline writes ``save_to_disk`` folders itself, so it writes and reads ``datasets``' private
``state.json`` (:func:`saved_state`, :func:`saved_data_files`).

Nothing here patches ``datasets``; everything reads.  An object that lacks the shape checked here raises
:func:`~packtools.compat.unknown_shape` (a ``PackingError`` naming the version), never a silent
fallback that would read the rows unmapped or reuse a stale cache.  This module imports neither ``datasets``
nor any packtools layer above ``errors``, so every layer that receives a ``Dataset`` reads it through here.

>>> import datasets
>>> table, indices = dataset_table(datasets.Dataset.from_dict({"x": [[1], [2, 3]]}).select([1, 0]))
>>> table.num_rows, indices.tolist()
(2, [1, 0])
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from . import unknown_shape, warn_unchecked

#: The ``datasets`` versions whose shapes this module was checked against (lowest and newest CI runs).
CHECKED = "4.7.0 - 5.2.0"
warn_unchecked("datasets", CHECKED)  # once per process, when the installed datasets is outside it
#: The file of a ``save_to_disk`` folder that lists its data files (a ``datasets`` internal format).
STATE_FILE = "state.json"


def _unknown(what: str) -> Exception:
    return unknown_shape("datasets", CHECKED, what)


def dataset_table(dataset: Any) -> tuple[pa.Table, np.ndarray | None]:
    """The Arrow table behind a ``datasets.Dataset`` and its row mapping (int64 row numbers, or None).

    Row ``i`` of the dataset is row ``indices[i]`` of the table (after ``select``, ``shuffle``, ...).  A dataset
    with a transform (``with_transform`` / ``set_transform``: its public ``format`` type ``"custom"``) is refused:
    its rows are what the function makes of the table, which ``datasets.map`` sees and the table does not.
    """
    fmt = getattr(dataset, "format", None)
    if isinstance(fmt, dict) and fmt.get("type") == "custom":
        transform = (fmt.get("format_kwargs") or {}).get("transform")
        name = getattr(transform, "__name__", type(transform).__name__)
        raise PackingError(
            f"the dataset has a transform ({name!r}, set by with_transform / set_transform) that packtools would "
            f"not apply: it reads the dataset's Arrow data, so the rows the transform makes (labels, masks, ids) "
            f"would be replaced by the stored ones without a word. Apply it first: "
            f"dataset.with_format(None).map({name}, batched=True) (what datasets.map on the dataset sees), or "
            f"drop it with dataset.with_format(None) to use the stored columns.",
            param="dataset",
        )
    data = getattr(dataset, "data", None)
    table = getattr(data, "table", None)
    if not isinstance(table, pa.Table):
        raise _unknown(f"{type(dataset).__name__}.data.table is {type(table).__name__}, not a pyarrow.Table")
    if "_indices" not in vars(dataset):
        raise _unknown(f"{type(dataset).__name__} has no _indices (its row mapping after select/shuffle)")
    mapping = vars(dataset)["_indices"]
    if mapping is None:
        return table, None
    column = getattr(mapping, "column", None)
    if column is None or getattr(mapping, "num_columns", None) != 1:
        raise _unknown(f"{type(dataset).__name__}._indices is {type(mapping).__name__}, not a 1-column table")
    values = column(0)
    if not pa.types.is_integer(values.type):
        raise _unknown(f"{type(dataset).__name__}._indices holds {values.type}, not row numbers")
    return table, values.to_numpy().astype(np.int64)


def fingerprint(dataset: Any) -> str:
    """``datasets``' own fingerprint of ``dataset`` (``Dataset._fingerprint``), the base of packtools' cache keys."""
    found = vars(dataset).get("_fingerprint") if hasattr(dataset, "__dict__") else None
    if not isinstance(found, str) or not found:
        raise _unknown(f"{type(dataset).__name__} has no _fingerprint string (got {type(found).__name__})")
    return found


def format_type(dataset: Any) -> str | None:
    """The output format (``"torch"``, ``"numpy"``, ..., or None) an ``IterableDataset`` was given by ``with_format``."""
    if "_formatting" not in vars(dataset):
        raise _unknown(f"{type(dataset).__name__} has no _formatting (its with_format setting)")
    formatting = vars(dataset)["_formatting"]
    if formatting is None:
        return None
    if not hasattr(formatting, "format_type"):
        raise _unknown(f"{type(dataset).__name__}._formatting is {type(formatting).__name__}, no format_type")
    return formatting.format_type


def saved_state(names: list[str], fingerprint: str) -> dict[str, Any]:
    """The ``state.json`` of a ``save_to_disk`` folder holding the Arrow files ``names``, unformatted, no split.

    >>> saved_state(["data-00000-of-00001.arrow"], "ab12")["_data_files"]
    [{'filename': 'data-00000-of-00001.arrow'}]
    """
    return {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }


def saved_data_files(folder: str) -> list[str]:
    """The data file names (relative to ``folder``) that a ``save_to_disk`` folder's ``state.json`` lists.

    Raises ``OSError`` / ``ValueError`` when the file is missing or not JSON, and the unknown-shape
    ``PackingError`` when it is JSON without the ``_data_files`` list ``datasets`` writes.
    """
    with open(os.path.join(folder, STATE_FILE)) as fh:
        state = json.load(fh)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise _unknown(f"{os.path.join(folder, STATE_FILE)} has no _data_files list of {{'filename': ...}}")
    return [str(f["filename"]) for f in files]


def temporary_cache_directory(ds_mod: Any) -> str:
    """``datasets``' temporary cache folder (deleted when the Python session ends), as ``datasets.map`` uses it."""
    get = getattr(getattr(ds_mod, "fingerprint", None), "get_temporary_cache_files_directory", None)
    if not callable(get):
        raise _unknown("datasets.fingerprint has no get_temporary_cache_files_directory()")
    return str(get())


def memory_mapped_table(ds_mod: Any, path: str) -> Any:
    """The Arrow file at ``path`` as the memory-mapped table a ``datasets.Dataset`` holds its cache files in."""
    cls = getattr(getattr(ds_mod, "table", None), "MemoryMappedTable", None)
    if cls is None or not callable(getattr(cls, "from_file", None)):
        raise _unknown("datasets.table has no MemoryMappedTable.from_file()")
    return cls.from_file(path)
