"""Checks of ``out`` before a run: never write into an input, never replace what packtools did not write.

A run replaces ``out`` only when it is absent, an empty folder, or a packtools output (a ``manifest.json``
packtools wrote, see :func:`packtools.io.manifest.is_packtools_manifest`) holding nothing but what packtools
wrote there: its manifest, ``state.json``, ``dataset_info.json`` and the data files ``state.json`` lists.  Any
other file (notes, checkpoints, a web app) stops the run with the fix, since replacing the folder would delete
it.  Paths are compared by real path, so a symlink cannot put the output inside an input folder.

>>> import os, tempfile
>>> out = tempfile.mkdtemp()
>>> with open(os.path.join(out, "manifest.json"), "w") as fh:
...     _ = fh.write('{"name": "My PWA"}')
>>> check_out(out, [], [])
Traceback (most recent call last):
    ...
packtools.errors.PackingError: out=... has a manifest.json that packtools did not write ...
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..compat.datasets import saved_data_files
from ..constants import MANIFEST
from ..errors import PackingError
from ..io.direct import file_crc32
from ..io.discover import COMPRESSED, SUFFIX_KINDS, InputFile
from ..io.manifest import has_manifest_file, read_manifest
from .gather import run_token

#: Files of a packtools output besides the data files its ``state.json`` lists.
OUTPUT_FILES = (MANIFEST, "state.json", "dataset_info.json")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def foreign_entries(out: str) -> list[str]:
    """Entries of the packtools output ``out`` that packtools did not write (sorted names): not its manifest,
    ``state.json``, ``dataset_info.json``, a data file ``state.json`` lists, or a shard named by the
    manifest's run (``state.json`` lost: :func:`~packtools.pipeline.gather.shard_name`)."""
    ours = set(OUTPUT_FILES)
    # no readable state.json (PackingError is a ValueError): nothing listed
    with contextlib.suppress(OSError, ValueError):
        ours.update(saved_data_files(out))
    manifest = read_manifest(out) or {}
    run = run_token(str(manifest.get("fingerprint", "")))
    shard = re.compile(rf"data-{re.escape(run)}-\d{{5}}-of-\d{{5}}\.arrow") if run else None
    return sorted(
        name for name in os.listdir(out) if name not in ours and not (shard and shard.fullmatch(name))
    )


def manifest_stamp(out: str) -> tuple[int, int, int, int] | None:
    """The identity of ``out``'s ``manifest.json`` (device, inode, size, mtime; None: none there).  A run
    installs an output by renaming a whole new folder over ``out`` (:meth:`Workspace.install`), so a stamp that
    is unchanged says no run installed an output meanwhile: a damage found before stands without reading the
    shards again."""
    try:
        st = os.stat(os.path.join(out, "manifest.json"))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def output_damage(out: str, manifest: Mapping[str, Any]) -> list[str]:
    """Why the packtools output ``out`` (whose manifest is ``manifest``) is not whole, one phrase each; empty
    when it is.  A rerun whose fingerprint matches rebuilds a damaged output instead of reporting it done (its
    stats would count rows that are no longer there, or a reader would fail on it):

    - a file it needs is gone: ``state.json``, ``dataset_info.json`` or a data file ``state.json`` lists;
    - ``state.json`` or ``dataset_info.json`` is not the JSON ``datasets`` reads (cut, overwritten);
    - a shard's size or CRC-32 differs from what the run wrote (``manifest["shards"]``: name -> ``[bytes,
      crc32]``, recorded while writing; outputs written before it have none and are checked for files only).
      The sizes are one ``stat`` each; the CRC-32 reads every shard once (zlib, about as fast as the disk
      reads), and only when nothing else is wrong.
    """
    missing = [name for name in OUTPUT_FILES if not os.path.isfile(os.path.join(out, name))]
    why: list[str] = []
    listed: list[str] | None = None
    if "state.json" not in missing:
        try:
            listed = saved_data_files(out)
        except (OSError, ValueError) as exc:  # not JSON, or not the shape datasets writes (PackingError)
            why.append(f"state.json is damaged ({_short(exc)})")
    if "dataset_info.json" not in missing:
        try:
            with open(os.path.join(out, "dataset_info.json")) as fh:
                if not isinstance(json.load(fh), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            why.append(f"dataset_info.json is damaged ({_short(exc)})")
    missing += [name for name in listed or () if not os.path.isfile(os.path.join(out, name))]
    if missing:
        shown = ", ".join(sorted(set(missing))[:3]) + (
            f" and {len(set(missing)) - 3} more" if len(set(missing)) > 3 else ""
        )
        why.insert(0, f"lacked {shown} (deleted since it was written)")
    sums = manifest.get("shards")
    if why or not isinstance(sums, dict):
        return why
    if listed is not None and sorted(listed) != sorted(sums):
        return ["state.json lists other data files than the run wrote"]
    for name, (size, _) in sorted(sums.items()):
        found = os.path.getsize(os.path.join(out, name))
        if found != size:
            why.append(f"{name} has {found:,} bytes where {size:,} were written")
    if not why:
        why = [
            f"{name} is not the bytes that were written (CRC-32 differs)"
            for name, (_, crc) in sorted(sums.items())
            if file_crc32(os.path.join(out, name)) != crc
        ]
    return why


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def check_out(out: str, inputs: Sequence[str], files: Sequence[InputFile]) -> None:
    """Refuse an ``out`` that holds or is inside an input, or that is not packtools' to replace."""
    real_out = os.path.realpath(out)
    for f in files:
        for path in {f.path, os.path.realpath(f.path)}:
            if _inside(path, out) or _inside(path, real_out):
                raise PackingError(
                    f"out={out!r} contains the input {f.path!r}; write the output somewhere else.",
                    param="out",
                )
    for item in inputs:
        folder = os.path.abspath(os.fspath(item))
        if not os.path.isdir(folder):
            continue
        for place in {folder, os.path.realpath(folder)}:
            if _inside(out, place) or _inside(real_out, place):
                via = "" if real_out == out else f" (through a symlink: it is {real_out!r})"
                raise PackingError(
                    f"out={out!r} is inside the input folder {folder!r}{via}, so a later run would read the packed "
                    f"output as input; write it outside the input folder.",
                    param="out",
                )
    if not os.path.lexists(out):
        _refuse_file_name(out)
        return
    if not os.path.isdir(out):
        raise PackingError(
            f"out={out!r} exists and is a file, not a packtools output folder; remove it or choose another "
            f"out (a folder).",
            param="out",
        )
    if read_manifest(out) is None:
        if has_manifest_file(out):
            raise PackingError(
                f"out={out!r} has a {MANIFEST} that packtools did not write (no manifest_format, "
                f"packtools_version and fingerprint in it), so it is someone else's folder and replacing it would "
                f"delete their files; choose another out.",
                param="out",
            )
        if os.listdir(out):
            raise PackingError(
                f"out={out!r} exists and is not a packtools output (no {MANIFEST}); remove it or choose another "
                f"folder.",
                param="out",
            )


def _refuse_file_name(out: str) -> None:
    """Refuse a new ``out`` named like a data file (``packed.jsonl``, ``train.parquet``): the run writes a folder,
    and a folder under a file's name is not what was asked for (and a later run given its parent would take
    that folder for a file of that type)."""
    suffix = os.path.splitext(out.rstrip(os.sep))[1].lower()
    if suffix in SUFFIX_KINDS or suffix in COMPRESSED:
        raise PackingError(
            f"out={out!r} is named like a {suffix} file, but the output is a folder (a datasets save_to_disk "
            f"dataset with its manifest, which datasets.load_from_disk opens); name a folder, e.g. "
            f"{os.path.splitext(out.rstrip(os.sep))[0]!r}. (Tokenized input packed into one file: packtools pack "
            f"IN.parquet --out FILE.parquet|.arrow, or packtools.pack_table.)",
            param="out",
        )


def check_replaceable(out: str) -> None:
    """Refuse to replace the packtools output ``out`` while it holds files packtools did not write (a run that
    finds its output already there, a cache hit, deletes nothing and is not refused)."""
    if read_manifest(out) is None or not os.path.isdir(out):
        return
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise PackingError(
            f"out={out!r} is a packtools output but also holds {shown}, which packtools did not write; a new run "
            f"replaces the whole folder and would delete them. Move them out of {out!r} (or choose another out).",
            param="out",
        )
