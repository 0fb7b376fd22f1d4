"""One fingerprint scheme for every cache key in packtools.

A key is the SHA-256 of canonical JSON (sorted keys) holding what it is for (``kind``), the packtools version,
a hash of packtools' own sources (:func:`source_hash`), that kind's format version, and the parts that decide
the cached content.  A new packtools version or format version, or a code change in a development checkout
under the same version number, therefore never reuses anything cached before it.  Files are fingerprinted by
absolute path, size, modification time, inode and status-change time (ctime, which the kernel sets on every write
and ``utime``, so a file rewritten with its old size and mtime put back is a miss;
:meth:`packtools.io.discover.InputFile.fingerprint`), never by reading their content.

>>> a = cache_key("example", 1, rows=[1, 2])
>>> a == cache_key("example", 1, rows=[1, 2]), a == cache_key("example", 2, rows=[1, 2]), len(a)
(True, False, 64)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

from ..constants import __version__


@functools.cache
def source_hash() -> str:
    """SHA-256 over packtools' Python sources (every ``.py`` file of the package, by path and content), read
    once per process: the code that runs is the code loaded."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, names in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                h.update(os.path.relpath(path, root).encode() + b"\0" + hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def cache_key(kind: str, format_version: int, **parts: Any) -> str:
    """SHA-256 (hex) of ``kind``, the packtools version and sources, ``format_version`` and ``parts``."""
    body = {
        "kind": kind,
        "packtools_version": __version__,
        "packtools_sources": source_hash(),
        "format_version": format_version,
        **parts,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
