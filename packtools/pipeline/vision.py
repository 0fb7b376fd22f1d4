"""Offline packing of vision-language samples: JSON lines in TRL's vision format -> a packed folder, out of core.

:func:`pack_vision_files` runs the text pipeline's steps in its crash-safe workspace
(:class:`~packtools.pipeline.workspace.Workspace`): ``out`` checked as for text
(:mod:`packtools.pipeline.outcheck`) and kept as it is when its manifest has this run's fingerprint; the
samples processed ``block_rows`` at a time into staged Arrow files (:mod:`packtools.pipeline.vision_stage`: a
rerun after a kill reuses the finished, undamaged blocks); one global ``bfd`` plan from the staged lengths,
image tokens included (a sample longer than ``max_length`` is refused by its file and line, never truncated);
shards of at most ``shard_bytes`` of pixel values gathered from the staged files mapped anew (token columns
per token, image columns whole per sample, in row order); then the manifest, the ``datasets`` files and the
rename.  Memory holds one staged block or one shard and its mapped pages, never the dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..constants import IMAGE_COLUMNS, __version__
from ..core.arrow import read_list_column
from ..core.nested import gather_whole_samples, plan_whole_samples
from ..core.pack import pack_columns
from ..core.plan import PackPlan, WholeLengths, check_max_length
from ..errors import PackingError
from ..io.discover import input_file_of
from ..io.files import mapped_table
from ..io.json import is_json_array, iter_json_array
from ..io.json_cells import CHAT_COLUMNS, cells
from ..io.manifest import MANIFEST_FORMAT, read_manifest, write_manifest
from .formats import non_text_part
from .gather import ShardFolder, shard_rows
from .outcheck import check_out, check_replaceable, output_damage
from .vision_stage import (
    block_damage,
    blocks,
    check_names,
    images_key,
    schema_of,
    sidecar,
    stage_block,
    stage_key,
    write_block,
)
from .workspace import Workspace, checkpoint, tidy_after_dead_run

TOKEN_COLUMNS = ("input_ids", "mm_token_type_ids", "assistant_masks")


@dataclass(frozen=True)
class VisionPackResult:
    out: str
    rows_in: int
    rows_out: int
    images: int
    tokens: int
    staged_blocks: int
    reused_blocks: int
    cached: bool = False  # the output was already there (same fingerprint): nothing was done
    #: samples without an assistant turn: they train nothing under the default assistant-only loss
    samples_untrained: int = 0
    #: what the run says beside its numbers (a damaged output packed again), as ``PipelineResult.notes``
    notes: list[str] = field(default_factory=list)


def shard_bounds(p: PackPlan, patches: np.ndarray, dim: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Packed rows cut into shards whose pixel values take at most ``shard_bytes`` (at least one row each).

    >>> from packtools import plan
    >>> p = plan([4, 4, 4, 4], max_length=4)  # one sample per row
    >>> shard_bounds(p, np.array([10, 0, 30, 5]), dim=1, shard_bytes=100)  # 4 bytes per value
    [(0, 2), (2, 3), (3, 4)]
    """
    per_seg = patches[p.seg_source] * (4 * dim)
    csum = np.concatenate([[0], np.cumsum(per_seg)])
    return shard_rows(csum[p.row_offsets[1:]] - csum[p.row_offsets[:-1]], shard_bytes)


def _value_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """Items per row of a list column, chunk by chunk (``combine_chunks`` would copy every value)."""
    parts = [np.asarray(c.value_lengths().fill_null(0), np.int64) for c in column.chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _mapped(paths: Sequence[str]) -> pa.Table:
    return pa.concat_tables([mapped_table(p) for p in paths])


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
    leave_out: Sequence[str] = (),
) -> VisionPackResult:
    """Pack JSON-lines files of TRL-format vision samples into ``out`` (see the module docstring); a rerun
    whose fingerprint matches the output's manifest does nothing (``cached=True``).  A row key other than
    ``messages`` and ``images`` is refused by name unless ``leave_out`` lists it."""
    from ..integrations.multimodal.processor import load_vision_processor

    max_length = check_max_length(max_length)
    leave = check_names(leave_out)
    for name, value in (("block_rows", block_rows), ("shard_bytes", shard_bytes), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
            raise PackingError(
                f"{name}={value!r} must be an int >= {0 if name == 'seed' else 1}.", param=name
            )
    paths = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    for p in paths:
        if not os.path.isfile(p) or not p.endswith((".jsonl", ".json")):
            raise PackingError(
                f"input {p!r}: pass JSON-lines files (.jsonl) of TRL vision rows.", param="inputs"
            )
    out = os.path.abspath(os.fspath(out))
    check_out(out, paths, [input_file_of(p, "json") for p in paths])
    vp = load_vision_processor(processor)
    dim = (
        3
        * int(getattr(vp.image_processor, "temporal_patch_size", 2))
        * int(vp.image_processor.patch_size) ** 2
    )
    schema = schema_of(dim)
    key = stage_key(vp.path, paths, block_rows, dim, sorted(leave), images_key(paths))
    config = {
        "kind": "vision",
        "max_length": max_length,
        "strategy": "bfd",
        "shuffle": bool(shuffle),
        "seed": seed,
        "block_rows": block_rows,
        "shard_bytes": shard_bytes,
        "leave_out": sorted(leave),
    }
    fingerprint = hashlib.sha256(json.dumps([key, config], sort_keys=True).encode()).hexdigest()
    previous = read_manifest(out)
    # a file deleted or damaged since (a shard, state.json, dataset_info.json): packed again, and said, as
    # run_pipeline does
    same = previous is not None and previous.get("fingerprint") == fingerprint
    damage = output_damage(out, previous) if same else []
    if same and not damage:
        tidy_after_dead_run(out)  # a run killed after installing this output may have left its work folder
        st = previous.get("stats", {})
        return VisionPackResult(
            out, st["rows_in"], st["rows_out"], st["images"], st["tokens"], 0, 0, cached=True,
            samples_untrained=st.get("samples_untrained", 0),
        )  # fmt: skip
    check_replaceable(out)
    ws = Workspace(out)
    ws.acquire()
    ok = False
    try:
        os.makedirs(ws.stage, exist_ok=True)
        staged, reused = [], 0
        origin: list[tuple[str, int]] = []  # each sample's file and line, for the errors
        for f, path in enumerate(paths):
            for b, rows in blocks(path, block_rows):
                origin.extend((path, line_no) for line_no, _ in rows)
                target = os.path.join(ws.stage, f"vision-{key}-{f:05d}-{b:06d}.arrow")
                if os.path.exists(sidecar(target)) and block_damage(target) is None:
                    reused += 1
                else:
                    for stale in (sidecar(target), target):  # damaged or unfinished: staged again
                        if os.path.exists(stale):
                            os.unlink(stale)
                    write_block(target, stage_block(vp, path, rows, schema, leave))
                staged.append(target)
                checkpoint(f"stage:{len(staged)}")
        table = _mapped(staged) if staged else schema.empty_table()
        cols = [read_list_column(table.column(n), n) for n in TOKEN_COLUMNS]
        lengths = cols[0].lengths()
        masks = cols[2]  # assistant_masks: a sample with no assistant token trains nothing by default
        csum = np.concatenate([[0], np.cumsum(masks.flat_values(), dtype=np.int64)])
        bounds = np.concatenate([[0], np.cumsum(masks.lengths())])
        untrained = int(np.count_nonzero(csum[bounds[1:]] == csum[bounds[:-1]]))
        p = plan_whole_samples(
            lengths,
            max_length,
            shuffle=shuffle,
            seed=seed,
            where=lambda i: f"{origin[i][0]}:{origin[i][1]}: the sample",
        )
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
        names = shards.finish(
            schema.append(pa.field("seq_lengths", pa.list_(pa.int32()))).empty_table(), fingerprint
        )
        stats = {
            "rows_in": len(lengths),
            "rows_out": p.num_rows,
            "images": images,
            "tokens": int(lengths.sum()),
            "samples_untrained": untrained,
        }
        write_manifest(
            ws.build,
            {
                "manifest_format": MANIFEST_FORMAT,
                "packtools_version": __version__,
                "fingerprint": fingerprint,
                "stage_key": key,
                "config": config,
                "inputs": [os.path.basename(p) for p in paths],
                "stats": {**stats, "shards": len(names)},
                "shards": shards.sums,  # each shard's [bytes, crc32]: a rerun checks them
            },
        )
        ws.install()
        ok = True
        return VisionPackResult(
            ws.out, stats["rows_in"], p.num_rows, images, stats["tokens"], len(staged), reused,
            samples_untrained=untrained,
            notes=[f"{ws.out} {'; '.join(damage)}: packed again"] if damage else [],
        )  # fmt: skip
    finally:
        ws.finish(ok=ok, keep_stage=not ok)


def is_vision_file(path: str, rows: int = 64) -> bool:
    """Whether a JSON-lines file holds TRL vision rows: one of its first ``rows`` objects has an ``images``
    key, or a message content part of type ``image`` or ``video``."""
    for _, block in blocks(path, rows, strict=False):
        return any("images" in row or _image_parts(row) for _, row in block)
    return False


def first_non_text_part(path: str) -> tuple[str, str, int, int, str] | None:
    """Where a row of a JSON file (JSON lines, or one JSON array of objects) first has a message content part
    that a text tokenizer's chat template would lose (:func:`~packtools.pipeline.formats.non_text_part`: any part
    but ``{"type": "text"}``) in a chat column (``messages``, ``prompt``, ``completion``, ``chosen``,
    ``rejected``), as ``(where, column, turn, part, type)``: ``("line 7", "messages", 0, 1, "image_url")``;
    None where no row has one.  Read to the first such row; a file whose bytes never hold a content list or
    object (``"content": [`` or ``"content": {``) is not parsed."""
    import mmap
    import re

    if os.path.getsize(path) == 0:
        return None
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if re.search(rb'"content"\s*:\s*[\[{]', mm) is None:
            return None
    for where, row in _json_rows(path):
        for column in CHAT_COLUMNS:
            found = non_text_part(row.get(column)) if column != "tools" else None  # tools: function schemas
            if found is not None:
                return (where, column, *found)
    return None


def _json_rows(path: str) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` of each row of a JSON file: each line of JSON lines (``line 7``; a line that is no object
    skipped: the reader names it), or the chat columns of each object of a JSON array (``object 7 of the
    array``, counted from 1)."""
    if is_json_array(path):
        n = 0
        for _, table in iter_json_array(path, 4096):
            names = [c for c in CHAT_COLUMNS if c in table.column_names]
            values = [cells(table, c) for c in names]
            for i in range(table.num_rows):
                n += 1
                yield f"object {n} of the array", {c: v[i] for c, v in zip(names, values)}
        return
    for _, block in blocks(path, 4096, strict=False):
        for line_no, row in block:
            yield f"line {line_no}", row


def _image_parts(row: dict, columns: Sequence[str] = ("messages",)) -> bool:
    for column in columns:
        messages = row.get(column) if column != "tools" else None  # tools: function schemas
        for m in messages if isinstance(messages, list) else ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(
                isinstance(c, dict) and c.get("type") in ("image", "video") for c in content
            ):
                return True
    return False


def vision_file_lengths(paths: Sequence[str], processor: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Token counts of the samples of JSON-lines files in TRL's vision format as the model sees them (image
    tokens counted from each image's size through the image processor's resize rule, no pixel processed:
    :func:`~packtools.integrations.multimodal.processor.sample_length`), and the number of images.  Image paths
    resolve against each file's folder, as :func:`pack_vision_files` resolves them; errors name file and line."""
    from ..integrations.multimodal.processor import load_vision_processor, sample_length
    from .vision_stage import _resolve

    vp = load_vision_processor(processor)
    out, images = [], 0
    for path in paths:
        base = os.path.dirname(os.path.abspath(path))
        for _, rows in blocks(path, 256):
            for line_no, row in rows:
                where = f"{path}:{line_no}"
                found = _resolve(row.get("images"), base, where)
                images += len(found)
                out.append(sample_length(vp, row.get("messages"), found, where))
    return np.asarray(out, np.int64).view(WholeLengths), images  # packed whole: recommend() holds every one
