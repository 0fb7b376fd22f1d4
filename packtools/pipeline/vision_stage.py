"""Staging of the vision pipeline (:func:`packtools.pipeline.vision.pack_vision_files`, step 1): TRL vision rows
processed block by block into Arrow files, and the rule for reusing them.

A staged block is named by :func:`stage_key` (everything that decides its bytes, the content of the image
files its rows name included).  It is written aside, flushed and renamed, then its sidecar (size and SHA-256)
the same way; a later run reuses it only when the sidecar is there and its bytes match (:func:`block_damage`),
else stages it again.  A row key that would not reach the model is refused by name (:func:`check_row_keys`).

>>> import os, tempfile
>>> block = os.path.join(tempfile.mkdtemp(), "b.arrow")
>>> write_block(block, pa.table({"input_ids": [[1, 2, 3]]}))
>>> block_damage(block) is None
True
>>> with open(block, "r+b") as fh:
...     _ = fh.seek(-9, 2); _ = fh.write(b"X")   # one byte changed, the size kept
>>> block_damage(block)
'its data file is not the one it was written with (checksum differs)'
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._atomic import fsync_dir, fsync_file
from ..constants import __version__
from ..core.arrow import numeric_array
from ..errors import PackingError
from ..io.discover import input_file_of
from ..io.fingerprint import source_hash
from .gather import write_shard
from .tokenizer.folder import file_sha256
from .tokenizer.spec import library_versions

#: The keys of a TRL vision row that reach the model; :func:`check_row_keys` refuses any other by name.
ROW_KEYS = ("messages", "images")
#: Libraries besides :func:`~packtools.pipeline.tokenizer.spec.library_versions` whose versions can change the pixels
#: (image decoding and resizing) of a processor folder.
PIXEL_LIBRARIES = ("Pillow", "numpy", "torch", "torchvision")
#: Files of a processor folder that do not decide what it produces (model weights): not hashed.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
#: Version of the staged block layout (its schema and sidecar): part of the stage key.
STAGE_FORMAT = 2  # 2: assistant_masks staged


def schema_of(dim: int) -> pa.Schema:
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("mm_token_type_ids", pa.list_(pa.int8())),
            ("assistant_masks", pa.list_(pa.int8())),
            ("pixel_values", pa.list_(pa.list_(pa.float32(), dim))),
            ("image_grid_thw", pa.list_(pa.list_(pa.int64(), 3))),
        ]
    )


def _folder_key(path: str) -> str:
    """SHA-256 over the processor folder's files (names and contents; weights left out), read in blocks."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and not name.endswith(WEIGHT_SUFFIXES):
            digest.update(name.encode() + b"\0" + bytes.fromhex(file_sha256(full)))
    return digest.hexdigest()


def _pixel_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = dict(library_versions())
    for name in PIXEL_LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def stage_key(  # noqa: PLR0913 - every input that decides a staged block's bytes
    processor_dir: str,
    paths: Sequence[str],
    block_rows: int,
    dim: int,
    leave_out: Sequence[str] = (),
    images: str = "",
) -> str:
    """The key of staged blocks (16 hex digits): what decides a block's bytes, namely the processor folder's
    content, packtools' sources, the versions of the libraries that build ids and pixels, the inputs (path,
    size, mtime), the content of the image files the rows name (``images``: :func:`images_key`), ``block_rows``
    and the patch width, and the row keys it was allowed to leave out (a block
    staged past a refusal is never reused by a run that would refuse).  A block staged under another key is
    never reused."""
    body = {
        "kind": "vision-stage",
        "format": STAGE_FORMAT,
        "packtools_version": __version__,
        "packtools_sources": source_hash(),
        "processor": _folder_key(processor_dir),
        "libraries": _pixel_versions(),
        "inputs": [_input_key(p) for p in paths],
        "images": images,
        "block_rows": block_rows,
        "dim": dim,
        "leave_out": sorted(leave_out),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def sidecar(block: str) -> str:
    return block[: -len(".arrow")] + ".sha256.json"


def write_block(target: str, table: pa.Table) -> None:
    """Write a staged block aside, flush it, rename it into place, then its sidecar (size and SHA-256), the
    same way: a block counts as finished only once its sidecar is in place."""
    tmp = f"{target}.tmp-{os.getpid()}"  # a kill leaves a ".tmp-" file, which the next run removes
    write_shard(tmp, table)
    fsync_file(tmp)
    os.replace(tmp, target)
    side = sidecar(target)
    side_tmp = f"{side}.tmp-{os.getpid()}"
    with open(side_tmp, "w") as fh:
        json.dump({"size": os.path.getsize(target), "sha256": file_sha256(target)}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(side_tmp, side)
    fsync_dir(os.path.dirname(target))


def block_damage(target: str) -> str | None:
    """Why the staged block ``target`` cannot be reused (no sidecar, or not the bytes its sidecar records),
    else ``None``."""
    try:
        with open(sidecar(target)) as fh:
            side = json.load(fh)
        size, digest = int(side["size"]), str(side["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no readable sidecar (not finished)"
    if not os.path.exists(target):
        return "its data file is missing"
    if os.path.getsize(target) != size:
        return "its data file is cut (size differs)"
    if file_sha256(target) != digest:
        return "its data file is not the one it was written with (checksum differs)"
    return None


def _input_key(path: str) -> dict[str, object]:
    # the one rule of what identifies an input file (a rewrite with its old size and mtime put back is a miss)
    return input_file_of(path, "json").fingerprint()


def blocks(
    path: str, block_rows: int, *, strict: bool = True
) -> Iterator[tuple[int, list[tuple[int, dict[str, Any]]]]]:
    """``(block index, [(line number, row), ...])`` of a JSON-lines file, ``block_rows`` rows at a time; a line
    that is not a JSON object is refused by file and line (skipped when not ``strict``)."""
    block: list[tuple[int, dict[str, Any]]] = []
    index = 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                if not strict:
                    continue
                raise PackingError(f"{path}:{line_no}: not a JSON object ({err}).") from err
            if not isinstance(row, dict):
                if not strict:
                    continue
                raise PackingError(f"{path}:{line_no}: each line must be a JSON object with 'messages'.")
            block.append((line_no, row))
            if len(block) == block_rows:
                yield index, block
                index, block = index + 1, []
    if block:
        yield index, block


def _resolve(images: Any, base: str, where: str) -> list[Any]:
    """A row's images with paths relative to its file's folder made absolute (URLs and non-lists are refused
    by :func:`~packtools.integrations.multimodal.images.image_list` / ``open_image``, by name)."""
    from ..integrations.multimodal.images import URL_SCHEMES, image_list

    def one(v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("path"), str) and not v.get("bytes"):
            v = v["path"]
        if isinstance(v, str) and not os.path.isabs(v) and not v.lower().startswith(URL_SCHEMES):
            return os.path.join(base, v)
        return v

    return [one(v) for v in image_list(images, where)]


def images_key(paths: Sequence[str]) -> str:
    """SHA-256 over the content of every image file the rows of ``paths`` name (each file hashed once, in
    sorted order of its absolute path; a file that cannot be read counts as missing, and staging refuses its
    row by name).  Part of :func:`stage_key`: a replaced image changes the key, so its blocks are staged again
    and the output's fingerprint changes.  Lines that are not JSON objects, and rows whose ``images`` are not
    a list, are left to staging, which refuses them by file and line."""
    files: set[str] = set()
    for path in paths:
        base = os.path.dirname(os.path.abspath(path))
        for _, row in blocks(path, 1 << 12, strict=False):
            for _, r in row:
                try:
                    found = _resolve(r.get("images"), base, path)
                except PackingError:
                    continue
                files.update(os.path.abspath(v) for v in found if isinstance(v, str))
    digest = hashlib.sha256()
    for name in sorted(files):
        try:
            h = file_sha256(name) if os.path.isfile(name) else "missing"
        except OSError:
            h = "unreadable"
        digest.update(name.encode() + b"\0" + h.encode() + b"\n")
    return digest.hexdigest()


def row_keys_message(where: str, extra: Sequence[str], cli: bool = False) -> str:
    """The refusal of row keys that would not reach the model, with the fix the caller can apply: from Python,
    ``leave_out``; from ``packtools pack`` (which has no such option), removing the keys from the rows."""
    fix = (
        f"Remove them from the rows (packtools pack has no option to leave row keys out; from Python, "
        f"pack_vision_files(..., leave_out={list(extra)!r}) does)."
        if cli
        else f"Remove them from the rows, or say they may be left out: pack_vision_files(..., "
        f"leave_out={list(extra)!r})."
    )
    return (
        f"{where}: the row has the key(s) {list(extra)}, which the packed output does not carry (only "
        f"{list(ROW_KEYS)} reach the model; 'tools' is not passed to the processor's chat template). {fix}"
    )


class RowKeysError(PackingError):
    """A row key refused by :func:`check_row_keys`; ``where`` and ``keys`` let a front end word the fix."""

    def __init__(self, where: str, keys: Sequence[str]) -> None:
        super().__init__(row_keys_message(where, keys), param="leave_out")
        self.where, self.keys = where, list(keys)


def check_row_keys(row: dict[str, Any], where: str, leave_out: frozenset[str]) -> None:
    """Refuse, by name, a key of a TRL vision row that would not reach the model."""
    if "messages" not in row:
        from ..integrations.multimodal.processor import not_vision_rows

        raise PackingError(not_vision_rows(f"{where}: the row", list(row)))
    extra = sorted(k for k in row if k not in ROW_KEYS and k not in leave_out)
    if extra:
        raise RowKeysError(where, extra)


def stage_block(
    vp: Any, path: str, rows: list[tuple[int, dict[str, Any]]], schema: pa.Schema, leave_out: frozenset[str]
) -> pa.Table:
    from ..integrations.multimodal.processor import process_vision_sample

    base = os.path.dirname(os.path.abspath(path))
    done = []
    for line_no, row in rows:
        where = f"{path}:{line_no}"
        check_row_keys(row, where, leave_out)
        done.append(
            process_vision_sample(vp, row["messages"], _resolve(row.get("images"), base, where), where)
        )
    dim = schema.field("pixel_values").type.value_type.list_size
    arrays = [
        _ragged([d["input_ids"].astype(np.int32) for d in done], pa.int32()),
        _ragged([d["mm_token_type_ids"].astype(np.int8) for d in done], pa.int8()),
        _ragged([d["assistant_masks"].astype(np.int8) for d in done], pa.int8()),
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


def check_names(leave_out: object) -> frozenset[str]:
    if isinstance(leave_out, str) or not all(isinstance(k, str) for k in leave_out):  # type: ignore[union-attr]
        raise PackingError(f"leave_out must be a list of row keys, got {leave_out!r}.", param="leave_out")
    return frozenset(leave_out)  # type: ignore[arg-type]
