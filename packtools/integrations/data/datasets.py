"""Packing and truncating Hugging Face ``datasets`` (extra ``packtools[datasets]``), imported only when used.

:func:`pack_dataset` packs a ``Dataset`` / ``DatasetDict`` with one global plan (in memory, or block by block
into an Arrow cache file) and an ``IterableDataset`` window by window; processed vision-language samples are
packed whole, their images with them (:func:`pack_vision_table`, ``docs/vision.md``).  :func:`truncate_dataset`
cuts list columns to ``max_length`` values, with the drops reported (never silent).  Views without copies are
in :mod:`packtools.integrations.data.views`, preference pairs and groups in
:mod:`packtools.integrations.preference.data`; what they read of ``datasets``' internals is in
:mod:`packtools.compat.datasets`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..._optional import require
from ...compat.datasets import dataset_table, format_type, memory_mapped_table, temporary_cache_directory
from ...compat.datasets import fingerprint as datasets_fingerprint
from ...constants import ANYRES_COLUMNS, IMAGE_COLUMNS, PIXEL_MASK, SEQ_LENGTHS
from ...core.arrow import check_row_counts, column_lengths, is_list_type
from ...core.cp_budget import check_context_parallel, plan_for_cp
from ...core.nested import gather_whole_samples, plan_whole_samples
from ...core.pack import check_no_images, pack_columns, read_columns, refuse_unpacked_media, truncate_table
from ...core.plan import PackPlan, Strategy, check_max_length, check_strategy
from ...errors import PackingError
from .drops import DropReport, untrained_pieces, warn_dropped, warn_empty, warn_untrained

DEFAULT_WINDOW = 100_000


def datasets_module() -> Any:
    return require("datasets", "packing a datasets.Dataset")


def derived_fingerprint(dataset: Any, operation: str, **params: Any) -> str:
    """A fingerprint for a dataset made from ``dataset`` (else ``datasets`` pickles every token to hash it).

    Besides ``datasets``' own fingerprint it takes the size, mtime, inode and ctime of the Arrow files behind the
    dataset: files replaced under an unchanged ``state.json`` (same fingerprint, other rows), even with their old
    size and mtime put back, must not reuse the packing of the old rows."""
    from ...io.discover import input_file_of
    from ...io.fingerprint import cache_key

    files = []
    for f in getattr(dataset, "cache_files", None) or []:
        try:
            files.append(input_file_of(f["filename"], "arrow").fingerprint())
        except (OSError, KeyError, TypeError):
            files.append([str(f), None, None])
    return cache_key(operation, 1, dataset=datasets_fingerprint(dataset), files=files, params=params)[:16]


def each_split(dataset: Any, one: Any, warn: Any, return_report: bool) -> Any:
    """``one(split) -> (out, report)`` on a ``Dataset`` or ``pyarrow.Table``, or on every split of a
    ``DatasetDict`` (a ``DatasetDict`` out, a dict of reports); ``warn(report, split_name)`` for each (name
    ``""`` for a single one).  Returns the output, with its report(s) when ``return_report``."""
    if not isinstance(dataset, pa.Table) and isinstance(dataset, datasets_module().DatasetDict):
        results = {name: one(split) for name, split in dataset.items()}
        for name, (_, report) in results.items():
            warn(report, name)
        out = datasets_module().DatasetDict({name: r[0] for name, r in results.items()})
        return (out, {name: r[1] for name, r in results.items()}) if return_report else out
    out, report = one(dataset)
    warn(report, "")
    return (out, report) if return_report else out


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
    from ..._atomic import atomic_path
    from ...io.pages import PageReleaser

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


#: How ``pack_dataset`` output records what it was packed with (``DatasetInfo.description``, which ``datasets``
#: carries through ``shuffle``, ``select``, ``map``, ``remove_columns`` and ``save_to_disk``).
RECORD_PREFIX = "packtools.pack_dataset: "


def packing_record(dataset: Any) -> dict[str, Any] | None:
    """What ``pack_dataset`` packed ``dataset`` with (``max_length``, ``strategy``, ``context_parallel``), read
    from its ``DatasetInfo.description``; ``None`` for any other dataset.

    >>> from datasets import Dataset
    >>> packing_record(pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 4))
    {'max_length': 4, 'strategy': 'bfd', 'context_parallel': 1}
    """
    description = getattr(getattr(dataset, "info", None), "description", None)
    if not isinstance(description, str) or not description.startswith(RECORD_PREFIX):
        return None
    try:
        record = json.loads(description[len(RECORD_PREFIX) :])
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("max_length"), int)
    return record if ok else None


def _packed(dataset: Any, table: Any, fingerprint: str, record: dict[str, Any]) -> Any:
    ds_mod = datasets_module()
    info = ds_mod.DatasetInfo(description=RECORD_PREFIX + json.dumps(record))
    return ds_mod.Dataset(table, info=info, split=dataset.split, fingerprint=fingerprint)


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
    context_parallel: int = 1,
) -> tuple[Any, DropReport]:
    """Pack one ``Dataset`` and report its drops; with ``plan`` (made for these arguments, e.g. by
    :func:`~packtools.integrations.data.views.packed_view`) reuse it.  ``context_parallel``: already checked
    (:func:`~packtools.core.cp_budget.check_context_parallel`)."""
    ds_mod = datasets_module()
    table, indices = dataset_table(dataset)
    how = {
        "max_length": max_length,
        "strategy": strategy,
        "columns": columns,
        "shuffle": shuffle,
        "seed": seed,
    }
    if context_parallel > 1:  # in the key only when used: keys of runs without CP stay as they were
        how["context_parallel"] = context_parallel
    fingerprint = derived_fingerprint(dataset, "pack", **how)
    record = {"max_length": max_length, "strategy": strategy, "context_parallel": context_parallel}
    _refuse_videos(table, "pack_dataset")  # whatever columns= names: images only are packed with their pixels
    if plan is not None:  # a plan made for the token columns alone (packed_view's): never for image rows
        check_no_images(table, "pack_split(plan=...) (packed_view(...).materialize())")
    if plan is None and has_images(table):  # processed vision-language samples: whole, images in row order
        if context_parallel > 1:
            raise PackingError(
                f"context_parallel={context_parallel} with vision-language samples (pixel_values / "
                f"image_grid_thw): packtools does not train them under context parallelism. Pack them without "
                f"context_parallel.",
                param="context_parallel",
            )
        packed, p = pack_vision_table(
            table, indices, max_length, strategy, columns, shuffle=shuffle, seed=seed
        )
        out = _packed(dataset, packed, fingerprint, record)
        return restore_format(out, dict(dataset.format), [SEQ_LENGTHS]), DropReport.from_plan(p)
    cols, lengths = read_columns(table, columns)
    p = plan
    if p is None:
        p = plan_for_cp(
            lengths if indices is None else lengths[indices], max_length, strategy, context_parallel
        )
        if shuffle:
            p = p.shuffled(seed)
    if keep_in_memory is None:
        keep_in_memory = not dataset.cache_files
    if keep_in_memory:
        out = _packed(dataset, pack_columns(cols, p, indices), fingerprint, record)
    else:
        path, reuse = _cache_file(dataset, fingerprint)
        if not (reuse and os.path.exists(path)):
            _write_packed(path, cols, p, indices)
        out = _packed(dataset, memory_mapped_table(ds_mod, path), fingerprint, record)
    added = [SEQ_LENGTHS] if SEQ_LENGTHS in out.column_names else []
    if p.strategy in ("bfd_split", "wrapped"):  # pieces of a cut that train nothing are said, never silent
        warn_untrained(untrained_pieces(table, indices, p), f"pack_dataset(strategy={p.strategy!r})", 3)
    return restore_format(out, dict(dataset.format), added), DropReport.from_plan(p, context_parallel)


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
    context_parallel: int = 1,
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
    ``max_length / (2 * w * m)`` relative rows over a global plan.

    A dataset with a transform (``with_transform`` / ``set_transform``) is refused: packing reads its stored
    Arrow data, not the rows the function makes; apply it first (``ds.with_format(None).map(fn, batched=True)``).

    A dataset that is already packed is refused (:func:`packtools.core.pack.check_not_packed` says what it can
    tell): keep ``seq_lengths`` with packed data.

    Tokens dropped (``bfd`` cuts sequences longer than ``max_length``) raise a
    :class:`~packtools.integrations.data.drops.TokensDroppedWarning` with their share and the ``bfd_split`` hint;
    ``return_report=True`` returns ``(packed, report)`` (a :class:`~packtools.integrations.data.drops.DropReport`, a
    dict of them for a ``DatasetDict``; not for an ``IterableDataset``, packed lazily).

    Processed vision-language samples (``pixel_values`` and ``image_grid_thw`` columns beside ``input_ids``)
    are packed ``bfd`` only, every sample whole (one longer than
    ``max_length`` is refused, never truncated), its patches and grids concatenated in row order, in memory;
    ``bfd_split`` / ``wrapped`` and ``IterableDataset`` inputs are refused.  ``processor=DIR`` (a local
    folder of the model's processor) first processes rows in TRL's vision format (``messages`` with image
    parts, ``images``: paths, bytes or PIL images) into those columns
    (:func:`~packtools.integrations.multimodal.processor.process_vision_dataset`).

    ``context_parallel=N`` packs the rows for context parallelism over ``N`` processes
    (:mod:`packtools.core.cp_budget`, the rule ``pack_files(..., context_parallel=N)`` plans with offline): every
    document is planned at its length padded to a multiple of ``2N``, so each row still fits ``max_length`` once
    :class:`~packtools.batches.ContextParallelCollator` pads it; the rows hold real tokens only (``seq_lengths``
    the real lengths), and the padding is reported as fill lost (the report's ``cp_padding_tokens`` and
    ``cp_fill_lost``).  ``max_length`` must be a multiple of ``2N``; ``wrapped`` rows are one sequence each,
    planned as without CP (only a row shorter than ``max_length`` is padded).  The output records what it was
    packed with (:func:`packing_record`), so ``prepare_trainer(trainer, context_parallel=N)`` holds every row to
    that ``max_length`` once padded before training.

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
    context_parallel = check_context_parallel(context_parallel, max_length)
    how = {
        "shuffle": shuffle,
        "seed": seed,
        "keep_in_memory": keep_in_memory,
        "context_parallel": context_parallel,
    }
    if processor is not None:
        from ..multimodal.processor import load_vision_processor, process_vision_dataset

        if not isinstance(dataset, (ds_mod.Dataset, ds_mod.DatasetDict)):
            raise PackingError(
                f"processor= needs a datasets.Dataset or DatasetDict in TRL's vision format, got "
                f"{type(dataset).__name__}; build one (datasets.Dataset.from_list(rows), images as paths or bytes), "
                f"or pack JSON lines offline with packtools pack --processor DIR.",
                param="dataset",
            )
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
    # pack_split is called here, not through each_split: its untrained-pieces warning counts these frames
    if isinstance(dataset, ds_mod.Dataset):
        out, report = pack_split(dataset, max_length, strategy, columns, **how)
        warn_dropped(report, "pack_dataset")
        return (out, report) if return_report else out
    if isinstance(dataset, ds_mod.IterableDataset):
        _refuse_videos(dataset, "pack_dataset (an IterableDataset)")
        if has_images(dataset):
            _refuse_streamed_images()
        if return_report:
            raise PackingError(
                "return_report=True needs a Dataset: an IterableDataset is packed lazily, window by window.",
                param="return_report",
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PackingError(f"window must be a positive number of rows, got {window!r}.")
        names = list(columns) if columns is not None else None

        def pack_window(batch: pa.Table) -> pa.Table:
            # an IterableDataset of unknown features (from_generator, after map) shows its columns only here:
            # columns=['input_ids'] would otherwise pack the tokens and leave the images out, with no error
            _refuse_videos(batch, "pack_dataset (an IterableDataset window)")
            if has_images(batch):
                _refuse_streamed_images()
            cols, lengths = read_columns(batch, names)
            p = plan_for_cp(lengths, max_length, strategy, context_parallel)
            if p.num_empty:  # said window by window, as they are packed
                warn_empty(p.num_empty, p.num_sequences, "pack_dataset (an IterableDataset window)")
            if shuffle:
                p = p.shuffled(seed)
            return pack_columns(cols, p)

        packed = dataset.with_format("arrow").map(pack_window, batched=True, batch_size=window)
        return packed.with_format(format_type(dataset))
    raise PackingError(
        f"dataset must be a datasets.Dataset, DatasetDict or IterableDataset, got {type(dataset).__name__}; "
        f"for a pyarrow.Table use packtools.pack_table."
    )


# -- truncation ----------------------------------------------------------------------------------------------
def truncate_dataset(
    dataset: Any, max_length: int, columns: Sequence[str] | None = None, *, return_report: bool = False
) -> Any:
    """Keep the first ``max_length`` values of each list column (all, or those named) of a dataset.

    Works on ``Dataset`` and ``DatasetDict`` (and on a ``pyarrow.Table``); the format is kept.  Tokens cut
    (counted on ``input_ids``, else the first truncated column) raise a
    :class:`~packtools.integrations.data.drops.TokensDroppedWarning`; ``return_report=True`` returns
    ``(truncated, report)``.

    >>> from datasets import Dataset
    >>> truncate_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 2)[:]
    {'input_ids': [[1, 2], [4]]}
    """
    if not isinstance(dataset, pa.Table):
        ds_mod = datasets_module()
        max_length = check_max_length(max_length)
        if not isinstance(dataset, (ds_mod.Dataset, ds_mod.DatasetDict)):
            raise PackingError(
                f"dataset must be a datasets.Dataset or DatasetDict, got {type(dataset).__name__}."
            )

    def one(split: Any) -> tuple[Any, DropReport]:
        if isinstance(split, pa.Table):
            return truncate_table(split, max_length, columns), _truncate_report(split, max_length, columns)
        table, indices = dataset_table(split)
        if indices is not None:
            table = table.take(pa.array(indices))
        fingerprint = derived_fingerprint(split, "truncate", max_length=max_length, columns=columns)
        out = datasets_module().Dataset(
            truncate_table(table, max_length, columns), split=split.split, fingerprint=fingerprint
        )
        return restore_format(out, dict(split.format), []), _truncate_report(table, max_length, columns)

    return each_split(
        dataset,
        one,
        lambda report, name: warn_dropped(report, "truncate_dataset", name, stacklevel=4),
        return_report,
    )


def _truncate_report(table: pa.Table, max_length: int, columns: Sequence[str] | None) -> DropReport:
    names = [f.name for f in table.schema if is_list_type(f.type)] if columns is None else list(columns)
    name = "input_ids" if "input_ids" in names else (names[0] if names else None)
    lengths = column_lengths(table.column(name)) if name else np.zeros(0, np.int64)
    return DropReport.from_lengths(lengths, max_length, "truncate")


# -- vision data ---------------------------------------------------------------------------------------------
def has_images(dataset_or_table: Any) -> bool:
    """Whether a ``Dataset`` or table carries per-sample image columns.

    >>> has_images(pa.table({"input_ids": [[1]], "image_grid_thw": [[[1, 2, 2]]]})), has_images(pa.table({"a": [1]}))
    (True, False)
    """
    names = getattr(dataset_or_table, "column_names", None) or []
    return any(c in names for c in IMAGE_COLUMNS)


def _refuse_videos(dataset_or_table: Any, what: str) -> None:
    """Refuse rows with video or audio columns (:data:`~packtools.constants.VIDEO_COLUMNS`,
    :data:`~packtools.constants.AUDIO_COLUMNS`) whatever ``columns=`` says."""
    refuse_unpacked_media(getattr(dataset_or_table, "column_names", None) or [], what, "dataset")


def _refuse_streamed_images() -> None:
    raise PackingError(
        "an IterableDataset with image columns (pixel_values / image_grid_thw) cannot be packed yet; "
        "load it as a Dataset (its samples are packed whole, images in row order).",
        param="dataset",
    )


def _check_patches(table: pa.Table) -> None:
    """Every sample's ``pixel_values`` hold exactly the patches its ``image_grid_thw`` announces."""
    missing = [c for c in IMAGE_COLUMNS if c not in table.column_names]
    # LLaVA-style rows: whole images, no grid (MultimodalCollator checks them per row)
    if missing == ["image_grid_thw"]:
        depth, kind = _list_depth(table.schema.field("pixel_values").type)
        if depth == 5:  # any-resolution (LLaVA-NeXT, OneVision): (images, tiles, c, h, w), with image_sizes
            if "image_sizes" not in table.column_names:
                raise PackingError(
                    "'pixel_values' holds 5-D values per sample (images, tiles, channels, size, size: LLaVA-NeXT / "
                    "LLaVA-OneVision) but there is no 'image_sizes' column: each image's tokens follow from its "
                    "original size. Keep the processor's image_sizes (and batch_num_images) columns with the rows.",
                    param="columns",
                )
            _check_anyres_counts(table)
            return
        if depth != 4 and (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
            raise PackingError(
                f"'pixel_values' holds {depth}-D values per sample but there is no 'image_grid_thw' column: rows "
                f"without it are LLaVA-style, one (channels, size, size) image per entry (4-D per sample); patches "
                f"one per line (Qwen-VL's processor) need their 'image_grid_thw'. Keep the processor's "
                f"image_grid_thw column with the rows.",
                param="columns",
            )
        return
    if missing:
        raise PackingError(
            f"the rows have image columns but not {missing}: keep both 'pixel_values' and 'image_grid_thw' "
            f"(the processor's output) so every image travels with its sample.",
            param="columns",
        )
    grid = table.column("image_grid_thw").combine_chunks()
    images = np.asarray(grid.value_lengths().fill_null(0), np.int64)
    sides = np.asarray(grid.flatten().flatten(), np.int64) if len(grid) else np.zeros(0, np.int64)
    if sides.shape[0] != 3 * int(images.sum()):
        raise PackingError("'image_grid_thw' must hold three sides (t, h, w) per image.", param="columns")
    prods = sides.reshape(-1, 3).prod(axis=1)
    expected = np.zeros(images.shape[0], np.int64)
    np.add.at(expected, np.repeat(np.arange(images.shape[0]), images), prods)
    patches = np.asarray(table.column("pixel_values").combine_chunks().value_lengths().fill_null(0), np.int64)
    fix = "pass the processor's output for every sample unchanged."
    check_row_counts(patches, expected, "'pixel_values' holds {} patches", "its image_grid_thw gives {}", fix)


def _check_anyres_counts(table: pa.Table) -> None:
    """LLaVA-NeXT / OneVision rows: every sample's ``image_sizes`` holds one size per image of its ``pixel_values``,
    and OneVision's ``batch_num_images`` counts them (packed, a row's sizes are matched to its images by order
    alone: a sample short of an image and a later one holding it would give the later one's tokens another image)."""

    def lengths(name: str) -> np.ndarray:
        return np.asarray(table.column(name).combine_chunks().value_lengths().fill_null(0), np.int64)

    images = lengths("pixel_values")
    fix = "pass the processor's output for every sample unchanged (one size per image, in order)."
    check_row_counts(
        lengths("image_sizes"),
        images,
        "'image_sizes' holds {} sizes",
        "'pixel_values' holds {} images",
        fix,
        param="image_sizes",
    )
    if "batch_num_images" not in table.column_names:
        return
    counts = table.column("batch_num_images").combine_chunks()
    values = np.asarray(counts.flatten().fill_null(0), np.int64) if len(counts) else np.zeros(0, np.int64)
    per = lengths("batch_num_images")
    total = np.zeros(images.shape[0], np.int64)
    np.add.at(total, np.repeat(np.arange(images.shape[0]), per), values)
    fix = (
        "pass the processor's batch_num_images for every sample unchanged (its images per processor sample)."
    )
    check_row_counts(
        total,
        images,
        "'batch_num_images' counts {} images",
        "'pixel_values' holds {}",
        fix,
        param="batch_num_images",
    )


def _check_tile_masks(table: pa.Table) -> None:
    """Idefics3 / SmolVLM rows: every sample's ``pixel_attention_mask`` holds one mask per tile of its
    ``pixel_values`` (packed, the masks of a row are matched to its tiles by order alone)."""
    if PIXEL_MASK not in table.column_names:
        return
    if "pixel_values" not in table.column_names:
        raise PackingError(
            f"the rows have '{PIXEL_MASK}' but no 'pixel_values': keep the processor's pixel_values column.",
            param="columns",
        )
    counts = [
        np.asarray(table.column(n).combine_chunks().value_lengths().fill_null(0), np.int64)
        for n in (PIXEL_MASK, "pixel_values")
    ]
    fix = "pass the processor's output for every sample unchanged (one mask per tile, in order)."
    check_row_counts(*counts, f"'{PIXEL_MASK}' holds {{}} masks", "'pixel_values' holds {} tiles", fix)


def _list_depth(kind: pa.DataType) -> tuple[int, pa.DataType]:
    """How many list levels a column type nests, and the type inside them."""
    depth = 0
    while is_list_type(kind):
        kind, depth = kind.value_type, depth + 1
    return depth, kind


def pack_vision_table(
    table: pa.Table,
    indices: np.ndarray | None,
    max_length: int,
    strategy: str,
    columns: Sequence[str] | None,
    *,
    shuffle: bool,
    seed: int,
) -> tuple[pa.Table, PackPlan]:
    """Pack processed vision-language samples whole (``bfd`` only), images in row order; the plan too.

    ``indices`` maps the dataset's rows to rows of ``table`` (a ``select``/``shuffle`` mapping), or None.
    """
    if strategy != "bfd":
        raise PackingError(
            f"strategy={strategy!r} cuts samples, and a vision-language sample cut in two splits an image from "
            f"its placeholder tokens; multimodal rows are packed with strategy='bfd' (every sample whole).",
            param="strategy",
        )
    names = list(table.column_names) if columns is None else list(columns)
    whole = (
        *IMAGE_COLUMNS,
        *ANYRES_COLUMNS,
        PIXEL_MASK,
    )  # per-sample image columns, gathered whole in row order
    left_out = [c for c in whole if c in table.column_names and c not in names]
    if left_out:
        raise PackingError(
            f"columns={names} leaves out {left_out}: the packed rows would lose their images. Include them.",
            param="columns",
        )
    _check_patches(table)
    _check_tile_masks(table)
    token_names = [n for n in names if n not in whole]
    non_list = [
        n for n in token_names if n in table.column_names and not is_list_type(table.schema.field(n).type)
    ]
    if non_list:
        raise PackingError(
            f"columns {non_list} are not list columns, so they cannot be packed; pass columns=[...] with the "
            f"token and image columns (the others are left out), or remove {non_list} first.",
            param="columns",
        )
    cols, lengths = read_columns(table, token_names)
    if indices is not None:
        lengths = lengths[indices]
    p = plan_whole_samples(lengths, max_length, shuffle=shuffle, seed=seed, where=lambda i: f"sample {i}")
    packed = pack_columns(cols, p, indices)
    for name in whole:
        if name in table.column_names:  # LLaVA-style rows have no image_grid_thw, only tiles a pixel mask
            packed = packed.append_column(name, gather_whole_samples(table.column(name), p, indices))
    return packed, p
