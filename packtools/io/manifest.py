"""The one manifest format: ``manifest.json`` in an output folder, what decided the output and its statistics.

Written by the pipeline (:func:`packtools.pack_files`) into every output folder.  It holds only what is the
same wherever and however the run went (no timings, hosts or executors), so it is part of the output's bytes:
``manifest_format``, ``packtools_version``, ``fingerprint`` (see :mod:`packtools.io.fingerprint`), ``config``,
``inputs``, ``tokenizer_sha256``, ``format`` and ``stats``.  A folder is a packtools output when it has one.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> read_manifest(folder) is None
True
>>> _ = write_manifest(folder, {"manifest_format": MANIFEST_FORMAT, "stats": {"rows_out": 3}})
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


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``folder``, or ``None`` if it has none (or an unreadable one)."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(folder: str | os.PathLike[str], manifest: dict[str, Any]) -> str:
    """Write ``manifest`` to ``folder/manifest.json`` (sorted keys: the same content gives the same bytes)."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return path
