"""Offline packing of vision-language samples: JSON lines in TRL's vision format -> a packed folder, out of core.

:func:`pack_vision_files` runs the same four steps as the text pipeline, in the same crash-safe workspace
(:class:`~packtools.pipeline.workspace.Workspace`: a lock next to ``out``, a hidden work folder, the finished
folder renamed into place, so ``out`` is absent, the old or the new output whatever kills the run):

1. **Stage**: the rows are read ``block_rows`` at a time, each sample processed by the local processor folder
   (:func:`~packtools.integrations.vision_processor.process_vision_sample`: ``input_ids``, ``pixel_values``,
   ``image_grid_thw``, ``mm_token_type_ids``) and the block written as one Arrow file under ``stage/``
   (atomically; its name carries a key of the processor folder, the input file and the block, so a rerun after
   a kill reuses the blocks that were finished and never a block made from other inputs).
2. **Plan**: one global ``bfd`` plan from the staged lengths alone (image tokens included); a sample longer
   than ``max_length`` is refused by its file and line, never truncated.
3. **Write**: the plan cut into shards of at most ``shard_bytes`` of pixel values (at least one row each), each
   gathered from the staged files mapped anew (token columns per token, image columns whole per sample, in
   row order) and written; the mapped pages a shard read are given back with its maps.
4. **Install**: ``manifest.json`` and the ``datasets`` files, then the rename.  ``datasets.load_from_disk(out)``
   opens the result; :class:`~packtools.batches.vision.MultimodalCollator` collates its rows.

Memory: one block of ``block_rows`` processed samples while staging (built from NumPy buffers), one shard of
packed rows while writing (``shard_bytes`` of pixels, plus the mapped pages of the staged files it reads);
the whole dataset is never in memory (measured by ``benchmarks/bench_vision.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..constants import __version__
from ..core.arrow import numeric_array, read_list_column
from ..core.nested import check_whole_samples, gather_whole_samples
from ..core.pack import pack_columns
from ..core.plan import PackPlan, check_max_length
from ..core.plan import plan as make_plan
from ..errors import PackingError
from ..io.manifest import MANIFEST_FORMAT, write_manifest
from .gather import ShardFolder, write_shard
from .workspace import Workspace, checkpoint

TOKEN_COLUMNS = ("input_ids", "mm_token_type_ids")
IMAGE_COLUMNS = ("pixel_values", "image_grid_thw")


@dataclass(frozen=True)
class VisionPackResult:
    out: str
    rows_in: int
    rows_out: int
    images: int
    tokens: int
    staged_blocks: int
    reused_blocks: int


def _schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("mm_token_type_ids", pa.list_(pa.int8())),
            ("pixel_values", pa.list_(pa.list_(pa.float32(), dim))),
            ("image_grid_thw", pa.list_(pa.list_(pa.int64(), 3))),
        ]
    )


def _folder_key(path: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            digest.update(name.encode())
            with open(full, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


def _input_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def _blocks(path: str, block_rows: int) -> Iterator[tuple[int, list[tuple[int, dict[str, Any]]]]]:
    """``(block index, [(line number, row), ...])`` of a JSON-lines file, ``block_rows`` rows at a time."""
    block: list[tuple[int, dict[str, Any]]] = []
    index = 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise PackingError(f"{path}:{line_no}: not a JSON object ({err}).") from err
            if not isinstance(row, dict):
                raise PackingError(f"{path}:{line_no}: each line must be a JSON object with 'messages'.")
            block.append((line_no, row))
            if len(block) == block_rows:
                yield index, block
                index, block = index + 1, []
    if block:
        yield index, block


def _resolve(images: Any, base: str) -> list[Any]:
    return [os.path.join(base, v) if isinstance(v, str) and not os.path.isabs(v) else v for v in images or []]


def _stage_block(vp: Any, path: str, rows: list[tuple[int, dict[str, Any]]], schema: pa.Schema) -> pa.Table:
    from ..integrations.vision_processor import process_vision_sample

    base = os.path.dirname(os.path.abspath(path))
    done = []
    for line_no, row in rows:
        if "messages" not in row:
            raise PackingError(f"{path}:{line_no}: the row has no 'messages' (it has {sorted(row)}).")
        try:
            done.append(
                process_vision_sample(vp, row["messages"], _resolve(row.get("images"), base), line_no)
            )
        except PackingError as err:
            raise PackingError(f"{path}:{line_no}: {err}") from None
    dim = schema.field("pixel_values").type.value_type.list_size
    arrays = [
        _ragged([d["input_ids"].astype(np.int32) for d in done], pa.int32()),
        _ragged([d["mm_token_type_ids"].astype(np.int8) for d in done], pa.int8()),
        _ragged([d["pixel_values"].reshape(-1, dim).astype(np.float32) for d in done], pa.float32(), dim),
        _ragged([d["image_grid_thw"].reshape(-1, 3).astype(np.int64) for d in done], pa.int64(), 3),
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def _ragged(parts: list[np.ndarray], value_type: pa.DataType, width: int | None = None) -> pa.Array:
    """One list per sample from NumPy arrays, built from their buffers (never Python objects per value);
    ``width``: each item is a fixed-size list of that many values (a patch, a grid row)."""
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(x) for x in parts], out=offsets[1:])
    flat = np.ascontiguousarray(np.concatenate([x.reshape(-1) for x in parts]) if parts else np.zeros(0))
    values = numeric_array(flat.astype(value_type.to_pandas_dtype(), copy=False), value_type)
    if width is not None:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(numeric_array(offsets.astype(np.int32), pa.int32()), values)


def shard_bounds(p: PackPlan, patches: np.ndarray, dim: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Packed rows cut into shards whose pixel values take at most ``shard_bytes`` (at least one row each).

    >>> p = make_plan([4, 4, 4, 4], max_length=4)  # one sample per row
    >>> shard_bounds(p, np.array([10, 0, 30, 5]), dim=1, shard_bytes=100)  # 4 bytes per value
    [(0, 2), (2, 3), (3, 4)]
    """
    per_seg = patches[p.seg_source] * (4 * dim)
    csum = np.concatenate([[0], np.cumsum(per_seg)])
    row_bytes = csum[p.row_offsets[1:]] - csum[p.row_offsets[:-1]]
    bounds, start, used = [], 0, 0
    for r, b in enumerate(row_bytes.tolist()):
        if r > start and used + b > shard_bytes:
            bounds.append((start, r))
            start, used = r, 0
        used += b
    if p.num_rows:
        bounds.append((start, p.num_rows))
    return bounds


def _value_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """Items per row of a list column, chunk by chunk (``combine_chunks`` would copy every value)."""
    parts = [np.asarray(c.value_lengths().fill_null(0), np.int64) for c in column.chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _mapped(paths: Sequence[str]) -> pa.Table:
    tables = [pa.ipc.open_stream(pa.memory_map(p)).read_all() for p in paths]
    return pa.concat_tables(tables)


def pack_vision_files(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    processor: str | os.PathLike[str],
    max_length: int,
    block_rows: int = 64,
    shard_bytes: int = 64 << 20,
    shuffle: bool = False,
    seed: int = 0,
) -> VisionPackResult:
    """Pack JSON-lines files of TRL-format vision samples into ``out`` (see the module docstring)."""
    from ..integrations.vision_processor import load_vision_processor

    max_length = check_max_length(max_length)
    paths = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    for p in paths:
        if not os.path.isfile(p) or not p.endswith((".jsonl", ".json")):
            raise PackingError(
                f"input {p!r}: pass JSON-lines files (.jsonl) of TRL vision rows.", param="inputs"
            )
    vp = load_vision_processor(processor)
    dim = (
        3
        * int(getattr(vp.image_processor, "temporal_patch_size", 2))
        * int(vp.image_processor.patch_size) ** 2
    )
    schema = _schema(dim)
    key = hashlib.sha256(
        json.dumps(
            [__version__, _folder_key(vp.path), [_input_key(p) for p in paths], block_rows, dim]
        ).encode()
    ).hexdigest()[:16]
    ws = Workspace(os.fspath(out))
    ws.acquire()
    ok = False
    try:
        os.makedirs(ws.stage, exist_ok=True)
        staged, reused = [], 0
        for f, path in enumerate(paths):
            for b, rows in _blocks(path, block_rows):
                target = os.path.join(ws.stage, f"vision-{key}-{f:05d}-{b:06d}.arrow")
                if os.path.exists(target):
                    reused += 1
                else:  # written aside, then renamed: a kill leaves a ".tmp-" file, which the next run removes
                    tmp = f"{target}.tmp-{os.getpid()}"
                    write_shard(tmp, _stage_block(vp, path, rows, schema))
                    os.replace(tmp, target)
                staged.append(target)
                checkpoint(f"stage:{len(staged)}")
        table = _mapped(staged) if staged else schema.empty_table()
        cols = [read_list_column(table.column(n), n) for n in TOKEN_COLUMNS]
        lengths = cols[0].lengths()
        over = np.flatnonzero(lengths > max_length)
        if over.size:
            raise PackingError(
                f"sample {int(over[0])} has {int(lengths[over[0]])} tokens (image tokens included) > max_length="
                f"{max_length} ({over.size} in all): multimodal samples are never truncated. Raise max_length.",
                param="max_length",
            )
        p = make_plan(lengths, max_length, "bfd")
        if shuffle:
            p = p.shuffled(seed)
        check_whole_samples(p, "samples with images")
        checkpoint("plan")
        os.makedirs(ws.build, exist_ok=True)
        shards = ShardFolder(ws.build)
        patches = _value_lengths(table.column("pixel_values"))
        del table, cols  # each shard maps the staged files anew: the pages it read are given back after it
        for i, (start, stop) in enumerate(shard_bounds(p, patches, dim, shard_bytes)):
            mapped = _mapped(staged)
            part = p.slice_rows(start, stop)
            block = pack_columns([read_list_column(mapped.column(n), n) for n in TOKEN_COLUMNS], part)
            for name in IMAGE_COLUMNS:
                block = block.append_column(name, gather_whole_samples(mapped.column(name), part))
            shards.write(block)
            del block, mapped
            checkpoint(f"write:{i + 1}")
        images = int(_value_lengths(_mapped(staged).column("image_grid_thw")).sum()) if staged else 0
        names = shards.finish(schema.append(pa.field("seq_lengths", pa.list_(pa.int32()))).empty_table(), key)
        stats = {
            "rows_in": len(lengths),
            "rows_out": p.num_rows,
            "images": images,
            "tokens": int(lengths.sum()),
        }
        write_manifest(
            ws.build,
            {
                "manifest_format": MANIFEST_FORMAT,
                "packtools_version": __version__,
                "fingerprint": key,
                "config": {"max_length": max_length, "strategy": "bfd", "shuffle": shuffle, "seed": seed,
                           "block_rows": block_rows, "shard_bytes": shard_bytes, "kind": "vision"},
                "inputs": [os.path.basename(p) for p in paths],
                "stats": {**stats, "shards": len(names)},
            },
        )  # fmt: skip
        ws.install()
        ok = True
        return VisionPackResult(
            ws.out, stats["rows_in"], p.num_rows, images, stats["tokens"], len(staged), reused
        )
    finally:
        ws.finish(ok=ok, keep_stage=not ok)
