"""Packing and truncating Hugging Face ``datasets`` (extra ``packtools[datasets]``), imported only when used.

:func:`pack_dataset` packs a ``Dataset`` / ``DatasetDict`` with one global plan (in memory, or block by block into
an Arrow cache file) and an ``IterableDataset`` window by window; :func:`truncate_dataset` cuts list columns.
Views without copies are in :mod:`packtools.integrations.dataset_views`, preference pairs and groups in
:mod:`packtools.integrations.preference_data`; what they read of ``datasets``' internals is in
:mod:`packtools.integrations.compat.datasets`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import require
from ..constants import SEQ_LENGTHS
from ..core.pack import pack_columns, read_columns, truncate_table
from ..core.plan import PackPlan, Strategy, check_max_length, check_strategy
from ..core.plan import plan as make_plan
from ..errors import PackingError
from .compat.datasets import dataset_table, format_type, memory_mapped_table, temporary_cache_directory
from .compat.datasets import fingerprint as datasets_fingerprint
from .drops import DropReport, TokensDroppedWarning, untrained_pieces, warn_dropped, warn_untrained
from .vision_data import has_images, pack_vision_table

DEFAULT_WINDOW = 100_000


def datasets_module() -> Any:
    return require("datasets", "packing a datasets.Dataset")


def derived_fingerprint(dataset: Any, operation: str, **params: Any) -> str:
    """A fingerprint for a dataset made from ``dataset`` (else ``datasets`` pickles every token to hash it).

    Besides ``datasets``' own fingerprint it takes the size and mtime of the Arrow files behind the dataset:
    files replaced under an unchanged ``state.json`` (same fingerprint, other rows) must not reuse the packing
    of the old rows."""
    from ..io.fingerprint import cache_key

    files = []
    for f in getattr(dataset, "cache_files", None) or []:
        try:
            st = os.stat(f["filename"])
            files.append([f["filename"], st.st_size, st.st_mtime_ns])
        except (OSError, KeyError, TypeError):
            files.append([str(f), None, None])
    return cache_key(operation, 1, dataset=datasets_fingerprint(dataset), files=files, params=params)[:16]


def restore_format(ds: Any, fmt: dict[str, Any], added: list[str]) -> Any:
    columns = fmt.get("columns")
    if columns is not None:
        columns = [c for c in columns if c in ds.column_names] + [c for c in added if c not in columns]
    return ds.with_format(
        fmt.get("type"),
        columns=columns,
        output_all_columns=fmt.get("output_all_columns", False),
        **(fmt.get("format_kwargs") or {}),
    )


BLOCK_TOKENS = 1 << 26  # tokens gathered and written at a time when packing to a cache file


def _cache_file(dataset: Any, fingerprint: str) -> tuple[str, bool]:
    """Where the packed rows of ``dataset`` go, and whether an existing file there may be reused.

    Like ``datasets.map``: next to the dataset's own cache files when it has some (and caching is on),
    else in ``datasets``' temporary folder, which is deleted when the Python session ends.
    """
    ds_mod = datasets_module()
    caching = ds_mod.is_caching_enabled()
    if caching and dataset.cache_files:
        directory = os.path.dirname(dataset.cache_files[0]["filename"])
        if os.access(directory, os.W_OK):
            return os.path.join(directory, f"packtools-{fingerprint}.arrow"), True
    directory = temporary_cache_directory(ds_mod)
    return os.path.join(directory, f"packtools-{fingerprint}.arrow"), False


def _write_packed(path: str, cols: list, p: PackPlan, indices: np.ndarray | None) -> None:
    """Gather and write the packed rows block by block, giving back mapped input pages as it goes."""
    from .._atomic import atomic_path
    from ..io.pages import PageReleaser

    release = PageReleaser().release
    blocks = p.row_blocks(BLOCK_TOKENS) or [(0, 0)]
    scratch: dict[str, np.ndarray] = {}  # one buffer per column, reused: the writer copies each block out
    with atomic_path(path) as tmp, pa.OSFile(tmp, "wb") as sink:
        writer = None
        for start, stop in blocks:
            table = pack_columns(cols, p.slice_rows(start, stop), indices, release, scratch)
            if writer is None:
                writer = pa.ipc.new_stream(sink, table.schema)
            writer.write_table(table)
            del table
        writer.close()


def pack_split(
    dataset: Any,
    max_length: int,
    strategy: str,
    columns: Sequence[str] | None,
    *,
    shuffle: bool,
    seed: int,
    keep_in_memory: bool | None,
    plan: PackPlan | None = None,
) -> tuple[Any, DropReport]:
    """Pack one ``Dataset`` and report its drops; with ``plan`` (made for these arguments, e.g. by
    :func:`~packtools.integrations.dataset_views.packed_view`) reuse it."""
    ds_mod = datasets_module()
    table, indices = dataset_table(dataset)
    if plan is None and has_images(table):  # processed vision-language samples: whole, images in row order
        packed, p = pack_vision_table(
            table, indices, max_length, strategy, columns, shuffle=shuffle, seed=seed
        )
        fingerprint = derived_fingerprint(
            dataset,
            "pack",
            max_length=max_length,
            strategy=strategy,
            columns=columns,
            shuffle=shuffle,
            seed=seed,
        )
        out = ds_mod.Dataset(packed, split=dataset.split, fingerprint=fingerprint)
        return restore_format(out, dict(dataset.format), [SEQ_LENGTHS]), DropReport.from_plan(p)
    cols, lengths = read_columns(table, columns)
    if plan is not None:
        p = plan
    else:
        if indices is not None:
            lengths = lengths[indices]
        p = make_plan(lengths, max_length, strategy)
        if shuffle:
            p = p.shuffled(seed)
    fingerprint = derived_fingerprint(
        dataset, "pack", max_length=max_length, strategy=strategy, columns=columns, shuffle=shuffle, seed=seed
    )
    if keep_in_memory is None:
        keep_in_memory = not dataset.cache_files
    if keep_in_memory:
        out = ds_mod.Dataset(pack_columns(cols, p, indices), split=dataset.split, fingerprint=fingerprint)
    else:
        path, reuse = _cache_file(dataset, fingerprint)
        if not (reuse and os.path.exists(path)):
            _write_packed(path, cols, p, indices)
        mapped = memory_mapped_table(ds_mod, path)
        out = ds_mod.Dataset(mapped, split=dataset.split, fingerprint=fingerprint)
    added = [SEQ_LENGTHS] if SEQ_LENGTHS in out.column_names else []
    if p.strategy in ("bfd_split", "wrapped"):  # pieces of a cut that train nothing are said, never silent
        warn_untrained(untrained_pieces(table, indices, p), f"pack_dataset(strategy={p.strategy!r})", 3)
    return restore_format(out, dict(dataset.format), added), DropReport.from_plan(p)


def pack_dataset(
    dataset: Any,
    max_length: int,
    strategy: Strategy | str = "bfd",
    columns: Sequence[str] | None = None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    window: int = DEFAULT_WINDOW,
    keep_in_memory: bool | None = None,
    return_report: bool = False,
    processor: Any = None,
) -> Any:
    """Pack a ``datasets.Dataset``, ``DatasetDict`` or ``IterableDataset`` into rows of ``max_length`` tokens.

    A ``Dataset`` (each split of a ``DatasetDict``) is packed with one global plan, so rows are as full as
    best-fit decreasing can make them; the result has the same format, with ``seq_lengths`` added for
    ``bfd``/``bfd_split``.  For a dataset of at most 1000 rows the output equals
    ``trl.pack_dataset(dataset, max_length, strategy)`` row for row.

    Where the packed rows go (``keep_in_memory``): by default, a dataset that lives in memory is packed in
    memory (fastest), and a memory-mapped one (``load_from_disk``, ``load_dataset``, ``map`` results) is
    packed, as ``datasets.map`` would, block by block into an Arrow cache file next to its own cache files,
    then memory-mapped: peak memory stays at about one block of 2**26 tokens, the input's pages are given
    back as they are read, and a later call with the same dataset and arguments reuses the file (with
    ``datasets`` caching on).  ``True`` / ``False`` force one way (``False`` on an in-memory dataset writes to
    ``datasets``' temporary folder, deleted when Python exits).

    An ``IterableDataset`` is packed lazily in windows of ``window`` rows, each with its own plan.  A window
    ends with one partly filled row, so a window of ``w`` rows of mean length ``m`` adds about
    ``max_length / (2 * w * m)`` relative rows over a global plan: ~0.5% for TRL's 1000-row windows at
    ``m / max_length = 0.1``, under 0.01% from 100k rows on.

    A dataset that is already packed is refused, since packing it again would merge the sequences of its
    rows: packtools tells from a ``seq_lengths`` column, a ``cu_seq_lens*`` / ``cu_seqlens`` / ``seq_idx``
    column, or ``position_ids`` that restart inside a row (:func:`packtools.core.pack.check_not_packed`).  It
    cannot tell rows that were concatenated with none of these left (e.g. ``seq_lengths`` removed from
    packtools output that had no ``position_ids``): keep ``seq_lengths`` with packed data.

    Tokens dropped (``bfd`` cuts sequences longer than ``max_length``) raise a
    :class:`~packtools.integrations.drops.TokensDroppedWarning` with their share and the ``bfd_split`` hint;
    ``return_report=True`` returns ``(packed, report)`` (a :class:`~packtools.integrations.drops.DropReport`, a
    dict of them for a ``DatasetDict``; not for an ``IterableDataset``, packed lazily).

    Processed vision-language samples (``pixel_values`` and ``image_grid_thw`` columns beside ``input_ids``)
    are packed by :mod:`packtools.integrations.vision_data`: ``bfd`` only, every sample whole (one longer than
    ``max_length`` is refused, never truncated), its patches and grids concatenated in row order, in memory;
    ``bfd_split`` / ``wrapped`` and ``IterableDataset`` inputs are refused.  ``processor=DIR`` (a local
    folder of the model's processor) first processes rows in TRL's vision format (``messages`` with image
    parts, ``images``: paths, bytes or PIL images) into those columns
    (:func:`~packtools.integrations.vision_processor.process_vision_dataset`).

    ``shuffle=True`` reorders the packed rows with ``seed`` (BFD emits the fullest rows first); for an
    ``IterableDataset`` each window is shuffled on its own, with the same seed (shuffle the stream's
    shards too, e.g. ``IterableDataset.shuffle``, for order across windows).

    >>> from datasets import Dataset
    >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    >>> pack_dataset(ds, 4)[:]
    {'input_ids': [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], 'seq_lengths': [[4], [3, 1], [2]]}
    """
    ds_mod = datasets_module()
    strategy = check_strategy(strategy)
    max_length = check_max_length(max_length)
    how = {"shuffle": shuffle, "seed": seed, "keep_in_memory": keep_in_memory}
    if processor is not None:
        from .vision_processor import load_vision_processor, process_vision_dataset

        if not isinstance(dataset, (ds_mod.Dataset, ds_mod.DatasetDict)):
            raise PackingError("processor= needs a Dataset or DatasetDict.", param="processor")
        vp = load_vision_processor(processor) if isinstance(processor, (str, os.PathLike)) else processor
        if isinstance(dataset, ds_mod.DatasetDict):
            dataset = ds_mod.DatasetDict({k: process_vision_dataset(v, vp) for k, v in dataset.items()})
        else:
            dataset = process_vision_dataset(dataset, vp)
    if isinstance(dataset, ds_mod.DatasetDict):
        results = {
            name: pack_split(split, max_length, strategy, columns, **how) for name, split in dataset.items()
        }
        for name, (_, report) in results.items():
            warn_dropped(report, "pack_dataset", name)
        out = ds_mod.DatasetDict({name: r[0] for name, r in results.items()})
        return (out, {name: r[1] for name, r in results.items()}) if return_report else out
    if isinstance(dataset, ds_mod.Dataset):
        out, report = pack_split(dataset, max_length, strategy, columns, **how)
        warn_dropped(report, "pack_dataset")
        return (out, report) if return_report else out
    if isinstance(dataset, ds_mod.IterableDataset):
        if has_images(dataset):
            raise PackingError(
                "an IterableDataset with image columns (pixel_values / image_grid_thw) cannot be packed yet; "
                "load it as a Dataset (its samples are packed whole, images in row order).",
                param="dataset",
            )
        if return_report:
            raise PackingError(
                "return_report=True needs a Dataset: an IterableDataset is packed lazily, window by window.",
                param="return_report",
            )
        return _pack_iterable(
            dataset, max_length, strategy, columns, shuffle=shuffle, seed=seed, window=window
        )
    raise PackingError(
        f"dataset must be a datasets.Dataset, DatasetDict or IterableDataset, got {type(dataset).__name__}; "
        f"for a pyarrow.Table use packtools.pack_table."
    )


def _pack_iterable(
    dataset: Any,
    max_length: int,
    strategy: str,
    columns: Sequence[str] | None,
    *,
    shuffle: bool,
    seed: int,
    window: int,
) -> Any:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise PackingError(f"window must be a positive number of rows, got {window!r}.")
    names = list(columns) if columns is not None else None

    def pack_window(batch: pa.Table) -> pa.Table:
        cols, lengths = read_columns(batch, names)
        p = make_plan(lengths, max_length, strategy)
        if shuffle:
            p = p.shuffled(seed)
        return pack_columns(cols, p)

    fmt_type = format_type(dataset)
    packed = dataset.with_format("arrow").map(pack_window, batched=True, batch_size=window)
    return packed.with_format(fmt_type)


def truncate_dataset(
    dataset: Any, max_length: int, columns: Sequence[str] | None = None, *, return_report: bool = False
) -> Any:
    """Keep the first ``max_length`` values of each list column (all, or those named) of a dataset.

    Works on ``Dataset`` and ``DatasetDict`` (and on a ``pyarrow.Table``); the format is kept.  Tokens cut
    (counted on ``input_ids``, else the first truncated column) raise a
    :class:`~packtools.integrations.drops.TokensDroppedWarning`; ``return_report=True`` returns
    ``(truncated, report)``.

    >>> from datasets import Dataset
    >>> truncate_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 2)[:]
    {'input_ids': [[1, 2], [4]]}
    """
    if isinstance(dataset, pa.Table):
        out = truncate_table(dataset, max_length, columns)
        report = _truncate_report(dataset, max_length, columns)
        warn_dropped(report, "truncate_dataset")
        return (out, report) if return_report else out
    ds_mod = datasets_module()
    max_length = check_max_length(max_length)
    if isinstance(dataset, ds_mod.DatasetDict):
        results = {}
        for k, v in dataset.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TokensDroppedWarning)
                results[k] = truncate_dataset(v, max_length, columns, return_report=True)
            warn_dropped(results[k][1], "truncate_dataset", k)
        out = ds_mod.DatasetDict({k: r[0] for k, r in results.items()})
        return (out, {k: r[1] for k, r in results.items()}) if return_report else out
    if not isinstance(dataset, ds_mod.Dataset):
        raise PackingError(
            f"dataset must be a datasets.Dataset or DatasetDict, got {type(dataset).__name__}."
        )
    table, indices = dataset_table(dataset)
    if indices is not None:
        table = table.take(pa.array(indices))
    fingerprint = derived_fingerprint(dataset, "truncate", max_length=max_length, columns=columns)
    out = ds_mod.Dataset(
        truncate_table(table, max_length, columns), split=dataset.split, fingerprint=fingerprint
    )
    report = _truncate_report(table, max_length, columns)
    warn_dropped(report, "truncate_dataset")
    out = restore_format(out, dict(dataset.format), [])
    return (out, report) if return_report else out


def _truncate_report(table: pa.Table, max_length: int, columns: Sequence[str] | None) -> DropReport:
    from ..core.arrow import column_lengths, is_list_type

    names = [f.name for f in table.schema if is_list_type(f.type)] if columns is None else list(columns)
    name = "input_ids" if "input_ids" in names else (names[0] if names else None)
    lengths = column_lengths(table.column(name)) if name else np.zeros(0, np.int64)
    return DropReport.from_lengths(lengths, max_length, "truncate")
