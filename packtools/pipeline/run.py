"""Offline preprocessing in one call: raw or tokenized files to packed shards on disk, out of core.

``pack_files(inputs, out, max_length, strategy, ...)`` runs three steps:

1. **Stage**: read the inputs in batches, tokenize them (unless already tokenized) and append the token
   columns to one uncompressed Arrow IPC file inside a temporary folder next to ``out``.
2. **Plan**: memory-map the staged file, read the row lengths from its offsets (no token is touched), apply
   the ``overlong`` policy to the lengths and plan globally (:func:`packtools.plan`).
3. **Write**: cut the plan into slices of at most ``shard_tokens`` tokens; for each slice gather the packed
   rows from the mapped file and write them as one Arrow stream shard, then drop the mapped pages, so memory
   holds O(rows) of lengths and plan plus one slice, whatever the token count.

The output folder is what ``datasets.Dataset.save_to_disk`` writes (``data-XXXXX-of-NNNNN.arrow`` stream
files, ``state.json``, ``dataset_info.json``): ``datasets.load_from_disk(out)`` opens it memory-mapped, and
``pyarrow.ipc.open_stream`` reads each shard.  ``manifest.json`` records the configuration, the inputs'
fingerprint (absolute path, size and mtime of every file, plus a content hash of the tokenizer folder), the
packtools version and the statistics; a rerun whose fingerprint matches does nothing.  Everything is written
to a temporary folder renamed to ``out`` at the end, so an interrupted run leaves no output folder.

Preference data (``prompt``/``chosen``/``rejected``) is packed by pairs: each pair's ``[prompt + chosen][prompt +
rejected]`` side by side in a row, never split (``input_ids``, ``completion_mask``, ``seq_lengths``; see
:func:`packtools.pipeline.preference.write_packed_preference` and :func:`packtools.pack_preference`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .._progress import progress
from ..constants import MANIFEST, __version__
from ..core.arrow import is_list_type
from ..core.pack import pack_columns, read_columns
from ..core.plan import check_max_length, check_strategy
from ..core.plan import plan as make_plan
from ..errors import PackingError
from ..io.files import InputFile, count_rows, discover, iter_tables, read_schema
from .gather import (
    MappedArrow,
    ShardFolder,
    Staging,
    first_loss,
    write_json,
)
from .preference import write_packed_preference
from .tokenize import FORMATS, detect_format, output_columns

OVERLONG = ("truncate", "drop", "split")
STAGED = "_staged.arrow"


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides the output (``num_proc`` and ``quiet`` do not, and are not fingerprinted)."""

    max_length: int
    strategy: str = "bfd"
    format: str | None = None
    tokenizer: str | None = None
    overlong: str | None = None
    columns: tuple[str, ...] | None = None
    add_eos: bool = True
    max_prompt_length: int | None = None
    shuffle: bool = False
    seed: int = 0
    shard_tokens: int = 1 << 24

    def __post_init__(self) -> None:
        check_max_length(self.max_length)
        check_strategy(self.strategy)
        if self.format is not None and self.format not in FORMATS:
            raise PackingError(
                f"format={self.format!r} is unknown; use one of {', '.join(FORMATS)}.", param="format"
            )
        if self.overlong is not None and self.overlong not in OVERLONG:
            raise PackingError(
                f"overlong={self.overlong!r} is unknown; use one of {', '.join(OVERLONG)}.", param="overlong"
            )
        if self.overlong == "split" and self.strategy == "bfd":
            raise PackingError(
                "overlong=split needs strategy=bfd_split (or wrapped); bfd keeps one piece per sequence.",
                param="overlong",
            )
        if self.max_prompt_length is not None and not 0 < self.max_prompt_length < self.max_length:
            raise PackingError(
                f"max_prompt_length={self.max_prompt_length} must be in [1, max_length={self.max_length}).",
                param="max_prompt_length",
            )
        if self.shard_tokens < 1:
            raise PackingError(f"shard_tokens must be >= 1, got {self.shard_tokens}.")

    @property
    def overlong_policy(self) -> str:
        """``overlong`` or its default: ``truncate`` for bfd, ``split`` for bfd_split and wrapped."""
        return self.overlong or ("truncate" if self.strategy == "bfd" else "split")


@dataclass
class PipelineResult:
    """What a run did: the output folder, its statistics and whether the manifest made it a no-op."""

    out: str
    stats: dict[str, Any]
    cached: bool = False
    manifest: dict[str, Any] = field(default_factory=dict)


# -- fingerprint and manifest --------------------------------------------------------------------------
def fingerprint(files: Sequence[InputFile], config: PipelineConfig) -> dict[str, Any]:
    """What the manifest compares: config, input files (path, size, mtime), tokenizer content, version."""
    from .tokenize import tokenizer_fingerprint

    cfg = asdict(config)
    cfg["columns"] = list(config.columns) if config.columns else None
    cfg["overlong"] = config.overlong_policy
    tok = tokenizer_fingerprint(config.tokenizer) if config.tokenizer else None
    body = {"config": cfg, "inputs": [f.fingerprint() for f in files], "tokenizer_sha256": tok}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": digest, "packtools_version": __version__, **body}


def read_manifest(out: str) -> dict[str, Any] | None:
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


# -- step 1: stage ----------------------------------------------------------------------------------------
def _single_threaded_worker() -> None:
    """Worker processes each tokenize one batch at a time on one thread; num_proc is the parallelism."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


_WORKER_TOKENIZERS: dict[tuple[str, str, bool], Any] = {}


def _tokenize_in_worker(key: tuple[str, str, bool], table: pa.Table, row: int) -> pa.Table:
    """Tokenize one batch in a worker process, loading the tokenizer once per process."""
    from .tokenize import BatchTokenizer

    if key not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[key] = BatchTokenizer(*key)
    return _WORKER_TOKENIZERS[key](table, row)


def _token_batches(
    files: Sequence[InputFile], config: PipelineConfig, fmt: str, num_proc: int, quiet: bool
) -> Iterator[pa.Table]:
    """Token tables in input order: read (and tokenize, in ``num_proc`` processes) batch after batch."""
    from .tokenize import input_columns

    total = (
        sum(n for n in (count_rows(f) for f in files) if n is not None)
        if all(f.kind == "parquet" for f in files)
        else None
    )
    bar = progress(total, "tokenize" if fmt != "tokenized" else "stage", quiet=quiet)
    try:
        if fmt == "tokenized":
            for f in files:
                for table in iter_tables(f, 8192, config.columns):
                    bar.update(table.num_rows)
                    yield table
            return
        from .tokenize import BatchTokenizer

        if config.tokenizer is None:
            raise PackingError(
                f"format={fmt} needs a tokenizer: pass tokenizer=DIR (a local tokenizer folder).",
                param="format",
            )
        tokenizer = BatchTokenizer(config.tokenizer, fmt, config.add_eos)
        needed = input_columns(fmt)

        def batches() -> Iterator[tuple[pa.Table, int]]:
            row = 0
            for f in files:
                names = read_schema(f).names if f.kind != "json" else None
                cols = [c for c in needed if names is None or c in names] if names is not None else None
                for table in iter_tables(f, 1000, cols):
                    yield table, row
                    row += table.num_rows

        if num_proc <= 1:
            for table, row in batches():
                yield tokenizer(table, row)
                bar.update(table.num_rows)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads (Rust, Numba)
        with ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_single_threaded_worker) as pool:
            inflight: deque = deque()
            for table, row in batches():
                job = pool.submit(_tokenize_in_worker, (config.tokenizer, fmt, config.add_eos), table, row)
                inflight.append((job, table.num_rows))
                if len(inflight) >= 2 * num_proc:
                    fut, n = inflight.popleft()
                    yield fut.result()
                    bar.update(n)
            while inflight:
                fut, n = inflight.popleft()
                yield fut.result()
                bar.update(n)
    finally:
        bar.close()


def _token_columns(files: Sequence[InputFile], config: PipelineConfig) -> list[str]:
    schema = read_schema(files[0])
    if config.columns:
        missing = [c for c in config.columns if c not in schema.names]
        if missing:
            raise PackingError(
                f"columns={missing} are not in {files[0].path!r}; it has {schema.names}.", param="columns"
            )
        return list(config.columns)
    cols = [
        f.name
        for f in schema
        if is_list_type(f.type)
        and (pa.types.is_integer(f.type.value_type) or pa.types.is_floating(f.type.value_type))
    ]
    if "input_ids" not in cols:
        raise PackingError(
            f"{files[0].path!r} has no list column 'input_ids' (columns: {schema.names}); pass format= and "
            f"tokenizer= for text, or columns= naming the token columns.",
            param="columns",
        )
    return cols


# -- step 2 + 3: plan and write ---------------------------------------------------------------------------
def apply_overlong(lengths: np.ndarray, max_length: int, policy: str) -> tuple[np.ndarray, dict[str, int]]:
    """Lengths to plan with under ``policy``, and what it cut.

    >>> eff, counts = apply_overlong(np.array([5, 2, 9]), 4, "drop")
    >>> eff.tolist(), counts["rows_dropped_overlong"], counts["tokens_dropped_overlong"]
    ([0, 2, 0], 2, 14)
    """
    over = lengths > max_length
    excess = np.maximum(lengths - max_length, 0)
    counts = {
        "rows_truncated": 0,
        "tokens_truncated": 0,
        "rows_dropped_overlong": 0,
        "tokens_dropped_overlong": 0,
        "rows_split": 0,
    }
    if policy == "truncate":
        counts["rows_truncated"] = int(over.sum())
        counts["tokens_truncated"] = int(excess.sum())
        return np.minimum(lengths, max_length), counts
    if policy == "drop":
        counts["rows_dropped_overlong"] = int(over.sum())
        counts["tokens_dropped_overlong"] = int(lengths[over].sum())
        return np.where(over, 0, lengths), counts
    counts["rows_split"] = int(over.sum())
    return lengths, counts


def _map_inputs(files: Sequence[InputFile], columns: Sequence[str]) -> MappedArrow | None:
    """Map tokenized Arrow inputs directly when they need no staging copy (uncompressed, same types)."""
    if not all(f.kind == "arrow" for f in files):
        return None
    try:
        mapped = MappedArrow([f.path for f in files], columns)
    except (pa.ArrowInvalid, KeyError, ValueError):
        return None
    try:
        cols, _ = read_columns(mapped.table, None)
        if mapped.zero_copy(cols):
            return mapped
    except (PackingError, pa.ArrowInvalid):
        pass
    mapped.close()
    return None


def _pack_mapped(mapped: MappedArrow, folder: str, config: PipelineConfig, quiet: bool) -> dict[str, Any]:
    try:
        cols, lengths = read_columns(mapped.table, None)
        policy = config.overlong_policy
        eff, counts = apply_overlong(lengths, config.max_length, policy)
        rows_no_loss = 0
        if "labels" in mapped.table.column_names:
            # Rows with no label left after truncation would only cost compute: drop them.
            first = first_loss(next(c for c in cols if c.name == "labels"), mapped)
            kept = eff > 0
            no_loss = kept & (first >= np.minimum(eff, lengths))
            rows_no_loss = int(no_loss.sum())
            eff = np.where(no_loss, 0, eff)
        p = make_plan(eff, config.max_length, config.strategy)
        if config.shuffle:
            p = p.shuffled(config.seed)
        shards = ShardFolder(folder)
        slices = p.row_blocks(config.shard_tokens)
        bar = progress(p.num_rows, "write", quiet=quiet)
        for r0, r1 in slices:
            shards.write(pack_columns(cols, p.slice_rows(r0, r1), release=mapped.release))
            bar.update(r1 - r0)
        bar.close()
        empty = pack_columns(cols, p.slice_rows(0, 0)).schema
        shards.finish(empty)
        tokens_in = int(lengths.sum())
        return {
            "rows_in": int(lengths.shape[0]),
            "rows_empty": int(np.count_nonzero(lengths == 0)),
            "rows_no_loss": rows_no_loss,
            **counts,
            "rows_out": p.num_rows,
            "sequences_packed": int(np.count_nonzero(eff)),
            "lower_bound": p.lower_bound,
            "tokens_in": tokens_in,
            "tokens_kept": p.tokens_kept,
            "tokens_dropped": tokens_in - p.tokens_kept,
            "fill": p.fill,
            "shards": len(slices) or 1,
            "packed": True,
        }
    finally:
        mapped.close()


# -- the whole run -----------------------------------------------------------------------------------------
def _install(tmp: str, out: str) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an earlier packtools output there."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rmdir(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def pack_files(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    max_length: int,
    strategy: str = "bfd",
    *,
    num_proc: int = 1,
    quiet: bool = True,
    **options: Any,
) -> PipelineResult:
    """Tokenize (if needed), truncate or filter, pack and write ``inputs`` to the folder ``out``.

    ``options`` are the other fields of :class:`PipelineConfig` (``tokenizer``, ``format``, ``overlong``,
    ``columns``, ``add_eos``, ``max_prompt_length``, ``shuffle``, ``seed``, ``shard_tokens``); see the module
    docstring for the steps and the output.  ``num_proc`` tokenizer processes; ``quiet=False`` shows progress.

    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
    >>> d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), os.path.join(d, "in.parquet"))
    >>> res = pack_files(os.path.join(d, "in.parquet"), os.path.join(d, "out"), max_length=4)
    >>> res.stats["rows_out"], res.stats["fill"], sorted(os.listdir(res.out))[0]
    (2, 0.75, 'data-00000-of-00001.arrow')
    >>> pack_files(os.path.join(d, "in.parquet"), os.path.join(d, "out"), max_length=4).cached
    True
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    config = PipelineConfig(max_length=max_length, strategy=strategy, **options)
    return run_pipeline(inputs, out, config, num_proc=num_proc, quiet=quiet)


def run_pipeline(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    config: PipelineConfig,
    *,
    num_proc: int = 1,
    quiet: bool = True,
) -> PipelineResult:
    """:func:`pack_files` with a ready :class:`PipelineConfig`."""
    started = time.perf_counter()
    out = os.path.abspath(os.fspath(out))
    files = discover(inputs)
    if any(os.path.commonpath([out, f.path]) == out for f in files):
        raise PackingError(
            f"out={out!r} contains an input file; write the output somewhere else.", param="out"
        )
    fp = fingerprint(files, config)
    previous = read_manifest(out)
    if previous is not None and previous.get("fingerprint") == fp["fingerprint"]:
        return PipelineResult(out, previous.get("stats", {}), cached=True, manifest=previous)
    if os.path.exists(out) and previous is None:
        raise PackingError(
            f"out={out!r} exists and is not a packtools output (no {MANIFEST}); remove it or pick another folder.",
            param="out",
        )
    fmt = config.format or detect_format(read_schema(files[0]).names)
    if fmt == "preference" and config.overlong == "split":
        raise PackingError(
            "overlong=split does not apply to preference data; use truncate or drop.", param="overlong"
        )
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes the folder private; the output is meant to be shared
    try:
        if fmt == "tokenized":
            config = PipelineConfig(**{**asdict(config), "columns": tuple(_token_columns(files, config))})
        t0 = time.perf_counter()
        batches = _token_batches(files, config, fmt, num_proc, quiet)
        if fmt == "preference":
            stats = write_packed_preference(batches, tmp, config)
            tokenize_s = time.perf_counter() - t0
            pack_s = 0.0
        else:
            # Tokenized uncompressed Arrow inputs (e.g. save_to_disk folders) are mapped as they are;
            # everything else is tokenized or copied into one uncompressed Arrow file first.
            mapped = _map_inputs(files, config.columns) if fmt == "tokenized" else None
            staged = None
            if mapped is None:
                staged = os.path.join(tmp, STAGED)
                staging = Staging(staged)
                for table in batches:
                    staging.append(table)
                names = list(config.columns) if fmt == "tokenized" else output_columns(fmt)
                staging.close(pa.schema([(c, pa.list_(pa.int32())) for c in names]))
                mapped = MappedArrow([staged])
            tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            stats = _pack_mapped(mapped, tmp, config, quiet)
            stats["staged"] = staged is not None
            if staged is not None:
                os.unlink(staged)
            pack_s = time.perf_counter() - t1
        stats.update(
            {
                "format": fmt,
                "strategy": config.strategy if stats["packed"] else None,
                "max_length": config.max_length,
                "overlong": config.overlong_policy if stats["packed"] else (config.overlong or "truncate"),
                "stage_s": round(tokenize_s, 3),
                "pack_s": round(pack_s, 3),
                "time_s": round(time.perf_counter() - started, 3),
            }
        )
        manifest = {**fp, "format": fmt, "stats": stats, "created_unix": int(time.time())}
        write_json(os.path.join(tmp, MANIFEST), manifest)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PipelineResult(out, stats, cached=False, manifest=manifest)
