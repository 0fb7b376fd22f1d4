"""The one manifest format: ``manifest.json`` in an output folder, what decided the output and its statistics.

Written by the pipeline (:func:`packtools.pack_files`) into every output folder.  It holds only what is the
same wherever and however the run went (no timings, hosts or executors), so it is part of the output's bytes:
``manifest_format``, ``packtools_version``, ``fingerprint`` (see :mod:`packtools.io.fingerprint`), ``config``,
``inputs``, ``tokenizer_sha256``, ``format`` and ``stats``.  A folder is a packtools output when it has one
that carries packtools' marks (an integer ``manifest_format``, a ``packtools_version`` and a ``fingerprint``):
any other ``manifest.json`` (a web app's, another tool's) is someone else's, and the folder is never replaced.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> read_manifest(folder) is None
True
>>> _ = write_manifest(folder, {"name": "My PWA", "start_url": "/"})  # someone else's manifest.json
>>> read_manifest(folder) is None
True
>>> mine = {"manifest_format": MANIFEST_FORMAT, "packtools_version": "0", "fingerprint": "f", "stats": {"rows_out": 3}}
>>> _ = write_manifest(folder, mine)
>>> read_manifest(folder)["stats"]
{'rows_out': 3}
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..constants import MANIFEST

#: Version of the manifest and output layout; part of the run's fingerprint.
MANIFEST_FORMAT = 2


def is_packtools_manifest(data: Any) -> bool:
    """Whether ``data`` (a parsed ``manifest.json``) is one packtools wrote."""
    return (
        isinstance(data, dict)
        and isinstance(data.get("manifest_format"), int)
        and not isinstance(data.get("manifest_format"), bool)
        and isinstance(data.get("packtools_version"), str)
        and isinstance(data.get("fingerprint"), str)
    )


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The packtools manifest of ``folder``, or ``None`` if it has none (no file, an unreadable one, or a
    ``manifest.json`` packtools did not write: see :func:`is_packtools_manifest`)."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if is_packtools_manifest(data) else None


def has_manifest_file(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a file named ``manifest.json`` (packtools' or not)."""
    return os.path.isfile(os.path.join(os.fspath(folder), MANIFEST))


def write_manifest(folder: str | os.PathLike[str], manifest: dict[str, Any]) -> str:
    """Write ``manifest`` to ``folder/manifest.json`` (sorted keys: the same content gives the same bytes)."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return path
