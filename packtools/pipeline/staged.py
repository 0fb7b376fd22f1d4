"""A staged part on disk: its sidecar and the checks that make it trusted.

A part staged by :mod:`packtools.pipeline.stage` is an Arrow file plus a sidecar ``.npz`` with each row's
length, the position of its first label token and its trained tokens, each conversation's head, the closing
ids of a template with ``{% generation %}`` markers, the path of the data to gather from, the tokenizer engine
report it was tokenized with, and the size of that data file and, for the stage cache's long-lived entries,
its SHA-256 (a run's own parts are flushed to disk instead, which costs less than hashing them, and carry the
CRC-32 of their bytes, taken as they are written: a flipped byte in a part a killed run left is found before a
rerun reuses it; docs/pipeline.md has its cost).
:func:`damage` checks a part's content against its sidecar before a rerun or the stage cache trusts it, and
:func:`drop_staged` removes a part so it is staged again.

>>> import hashlib, os, tempfile, numpy as np
>>> d = tempfile.mkdtemp(); data = os.path.join(d, "p.arrow"); side = os.path.join(d, "p.npz")
>>> _ = open(data, "wb").write(b"tokens")
>>> digest = hashlib.sha256(b"tokens").hexdigest()
>>> save_sidecar(side, np.array([3, 2]), np.zeros(0, np.int64), data, data_sha256=digest, data_size=6)
>>> load_sidecar(side)[0].tolist(), damage(side)
([3, 2], None)
>>> _ = open(data, "wb").write(b"tokenz")
>>> damage(side)
'its data file is not the one it was written with (checksum differs)'

What the labels of staged rows say, per row: where the first label token is, and how many tokens train.

>>> import pyarrow as pa
>>> labels = pa.chunked_array([pa.array([[-100, 5, 6], [-100, -100], [7, -100, 8]])])
>>> first_label(labels).tolist(), trained_per_row(labels).tolist()
([1, 2, 0], [2, 0, 1])
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.lib.npyio import NpzFile

from .._atomic import fsync_dir
from ..constants import IGNORE_INDEX
from ..core.arrow import read_list_column


def save_sidecar(
    path: str,
    lengths: np.ndarray,
    first: np.ndarray,
    data: str,
    *,
    report: dict[str, Any] | None = None,
    data_sha256: str = "",
    data_size: int = -1,
    data_crc32: int = -1,
    trained: np.ndarray | None = None,
    heads: np.ndarray | None = None,
    closing: np.ndarray | None = None,
    tool_opener: np.ndarray | None = None,
) -> None:
    """Write a part's sidecar (written last: its presence means the part is done)."""
    none = np.zeros(0, np.int64)
    arrays = {
        "lengths": lengths,
        "first_label": first,
        "trained": trained if trained is not None else none,
        "heads": heads if heads is not None else none,
        "closing": closing if closing is not None else none,
        "tool_opener": tool_opener if tool_opener is not None else none,
        "data": np.array(data),
        "tokenizer": np.array(json.dumps(report, sort_keys=True) if report else ""),
        "data_sha256": np.array(data_sha256),
        "data_size": np.array(data_size, np.int64),
        "data_crc32": np.array(data_crc32, np.int64),
    }
    _write_sidecar(path, arrays)


def relink_sidecar(source: str, path: str, data: str) -> None:
    """Write at ``path`` the sidecar ``source`` with its data file at ``data`` (a stage-cache entry a job takes):
    its rows, engine report and checksum as they are."""
    with np.load(source, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    _write_sidecar(path, {**arrays, "data": np.array(data)})


def _write_sidecar(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Flushed to disk before the rename and the folder after it, so that a machine crash leaves no sidecar
    whose data never landed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())  # whole on disk before the rename that marks the part done
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def _members(sidecar: str | NpzFile) -> Iterator[NpzFile]:
    """The members of a sidecar: a path is opened (and closed) here; a sidecar already open (``damage`` reads
    several things from one open) is used as it is, and its opener closes it."""
    if isinstance(sidecar, NpzFile):
        yield sidecar
        return
    with np.load(sidecar, allow_pickle=False) as z:
        yield z


def load_sidecar(path: str | NpzFile) -> tuple[np.ndarray, np.ndarray, str]:
    """``(lengths, first_label, data path)`` of a staged part (``path``: the sidecar, or the sidecar open)."""
    with _members(path) as z:
        return z["lengths"], z["first_label"], str(z["data"])


def sidecar_turns(path: str | NpzFile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trained tokens, head length)`` of each row of a staged part (empty arrays: the part has no labels,
    resp. no heads: every head is 0), and the ids a turn's closing text has after its labelled span
    (:func:`packtools.pipeline.tokenizer.chat.head.closing_ids`; empty for most templates)."""
    with _members(path) as z:
        return z["trained"], z["heads"], z["closing"]


def sidecar_tool_opener(path: str | NpzFile) -> np.ndarray:
    """The ids that start a tool message in a staged part's chat template
    (:func:`packtools.pipeline.tokenizer.chat.head.tool_opener_ids`; empty: none known)."""
    with _members(path) as z:
        return z["tool_opener"] if "tool_opener" in z.files else np.zeros(0, np.int64)


def sidecar_report(path: str | NpzFile) -> dict[str, Any] | None:
    """The tokenizer engine report a staged part was written with (None for tokenized input)."""
    with _members(path) as z:
        text = str(z["tokenizer"]) if "tokenizer" in z.files else ""
    return json.loads(text) if text else None


def sidecar_checksum(path: str | NpzFile) -> tuple[str, int, int]:
    """The SHA-256 ("" if none was taken), the size (-1: unknown) and the CRC-32 (-1: none taken) of the data
    file the sidecar was written with."""
    with _members(path) as z:
        digest = str(z["data_sha256"]) if "data_sha256" in z.files else ""
        size = int(z["data_size"]) if "data_size" in z.files else -1
        crc = int(z["data_crc32"]) if "data_crc32" in z.files else -1
    return digest, size, crc


def damage(sidecar: str) -> str | None:
    """Why the staged part of ``sidecar`` cannot be used (cut, emptied, changed since it was written: its
    sidecar unreadable, its data missing, or not the bytes whose SHA-256 the sidecar holds), else None.  A zip
    member's CRC guards the sidecar itself.  The sidecar is opened once; the readers above read its members."""
    from ..io.direct import file_crc32
    from .tokenizer.folder import file_sha256

    try:
        with np.load(sidecar, allow_pickle=False) as z:
            lengths, _, data = load_sidecar(z)
            checksum, size, crc = sidecar_checksum(z)
            sidecar_report(z)
            trained, heads, _ = sidecar_turns(z)
    except Exception as exc:  # noqa: BLE001 - a cut or damaged .npz raises many kinds (BadZipFile, EOFError, ...)
        return f"its sidecar cannot be read ({type(exc).__name__})"
    for name, per_row in (("trained tokens", trained), ("heads", heads)):
        if per_row.shape[0] not in (0, lengths.shape[0]):
            return f"its {name} do not match its rows ({per_row.shape[0]} for {lengths.shape[0]} rows)"
    if not os.path.exists(data):
        return "its data file is missing"
    if size >= 0 and os.path.getsize(data) != size:
        return "its data file is cut or not the one it was written with (size differs)"
    if checksum and file_sha256(data) != checksum:
        return "its data file is not the one it was written with (checksum differs)"
    if not checksum and crc >= 0 and file_crc32(data) != crc:
        return "its data file is not the one it was written with (CRC-32 differs)"
    return None


def drop_staged(job: Any) -> None:
    """Remove a staged part (the sidecar first: without it the part is not done), so that it is staged again."""
    for path in (job.sidecar, job.staged):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# -- label counts --------------------------------------------------------------------------------------------
def first_label(labels: pa.ChunkedArray) -> np.ndarray:
    """Per row, the position of the first token with a label (not -100); the row length if there is none."""
    parts = []
    for chunk in read_list_column(labels, "labels").chunks:
        starts, ends = chunk.offsets[:-1], chunk.offsets[1:]
        first = ends - starts
        idx = np.flatnonzero(chunk.values[: chunk.offsets[-1]] != IGNORE_INDEX)  # sorted
        lo = np.searchsorted(idx, starts)  # the row's first labelled token, if it has one, is idx[lo]
        has = lo < np.searchsorted(idx, ends)
        first[has] = idx[lo[has]] - starts[has]
        parts.append(first)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def trained_per_row(labels: pa.ChunkedArray) -> np.ndarray:
    """Per row, its tokens that train: labels other than -100 after the row's first token (a padding-free batch
    masks every sequence's first label)."""
    parts = []
    for chunk in read_list_column(labels, "labels").chunks:
        values = chunk.values[: chunk.offsets[-1]] != IGNORE_INDEX
        starts, ends = chunk.offsets[:-1], chunk.offsets[1:]
        csum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        has = ends > starts
        first = np.zeros(starts.shape[0], np.int64)
        first[has] = values[starts[has]]
        parts.append(csum[ends] - csum[starts] - first)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
