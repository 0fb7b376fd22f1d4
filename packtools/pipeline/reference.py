"""transformers' ids without importing transformers, where that is proven to give the same ids.

Loading a tokenizer through transformers imports transformers (and with it torch): seconds of fixed cost per run,
more than tokenizing 100 MB of text with the fast engine takes.  For plain-text formats the reference ids (what
the fast engine is compared with, and what runs when it does not apply) need only the Rust ``tokenizers``
library that transformers itself calls, loaded from the same ``tokenizer.json`` with truncation and padding
off, and the EOS id from the tokenizer's config.

That this gives transformers' ids is not assumed: the first run with a tokenizer loads it through transformers
too, compares both on the built-in adversarial set (with and without special tokens) and their EOS ids, and
records the verdict in a small file keyed by the tokenizer's fingerprint, the file the library loads (tokenizer.json
or its copy with ``"a b"`` merges, :mod:`packtools.pipeline.tokenizer_load`) and the versions of transformers,
tokenizers and packtools (under ``$PACKTOOLS_CACHE_DIR``, default ``~/.cache/packtools``).  Later runs with a
"same" verdict skip transformers; anything else (a differing id, a new version, no verdict) loads transformers.
``PACKTOOLS_CACHE_DIR=''`` turns the shortcut off.

>>> import os
>>> saved = os.environ.get("PACKTOOLS_CACHE_DIR")
>>> os.environ["PACKTOOLS_CACHE_DIR"] = ""
>>> cache_dir() is None, load_verified(".", "0" * 64) is None
(True, True)
>>> _ = os.environ.pop("PACKTOOLS_CACHE_DIR") if saved is None else os.environ.update(PACKTOOLS_CACHE_DIR=saved)
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .._atomic import atomic_path
from ..constants import __version__
from ..io.fingerprint import cache_key

VERDICT_FORMAT = 1


def cache_dir() -> str | None:
    """Where verdicts are kept (None: the shortcut is off: ``$PACKTOOLS_CACHE_DIR=''``, or no home folder)."""
    env = os.environ.get("PACKTOOLS_CACHE_DIR")
    if env is not None:
        return env or None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home == "~" or not os.path.isabs(home):  # no home folder: no cache (never a folder named "~")
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "packtools")


def _versions() -> dict[str, str]:
    out = {"packtools": __version__}
    for name in ("transformers", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _verdict_path(tokenizer_fp: str, file: str | None = None) -> str | None:
    root = cache_dir()
    if root is None:
        return None
    source = {} if file is None else {"source": "compact"}  # the copy with "a b" merges (tokenizer_load)
    key = cache_key("reference", VERDICT_FORMAT, tokenizer=tokenizer_fp, versions=_versions(), **source)[:32]
    return os.path.join(root, "reference", key + ".json")


class LiteReference:
    """The ``tokenizers`` library's tokenizer of a folder, as transformers' ``__call__`` runs it; ``file``: a copy
    of its tokenizer.json to load instead (the one with ``"a b"`` merges, which loads faster)."""

    def __init__(self, tokenizer_dir: str, file: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(file or os.path.join(tokenizer_dir, "tokenizer.json"))
        self.backend.no_truncation()
        self.backend.no_padding()
        eos = _config_eos(tokenizer_dir)
        self.eos_id = self.backend.token_to_id(eos) if eos is not None else None


def _config_eos(tokenizer_dir: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(tokenizer_dir, name), encoding="utf-8") as fh:
                value = json.load(fh).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def write_verdict(path: str, body: dict[str, Any]) -> None:
    """Write a recorded verdict with the SHA-256 of its own content (checked by :func:`_whole_verdict`),
    atomically and flushed to disk; an :class:`OSError` (read-only or full cache) is the caller's to handle."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        json.dump({**body, "sha256": _digest(body)}, fh, sort_keys=True)


def _whole_verdict(path: str | None) -> dict[str, Any] | None:
    """The recorded verdict at ``path`` if it is whole: readable and equal to the SHA-256 it was written with
    (a damaged, cut or hand-edited file, or one written before the checksum, is no verdict)."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    body = {k: v for k, v in saved.items() if k != "sha256"}
    return body if saved.get("sha256") == _digest(body) else None


def read_verdict(path: str | None) -> dict[str, Any] | None:
    """A recorded passing verdict (a whole JSON object with ``"same": true``) at ``path``, or None: absent,
    unreadable, damaged or not a pass all mean "check again"."""
    verdict = _whole_verdict(path)
    return verdict if verdict is not None and verdict.get("same") is True else None


def load_verified(tokenizer_dir: str, tokenizer_fp: str, file: str | None = None) -> LiteReference | None:
    """The lite reference (loaded from ``file`` if given) when a recorded verdict says it gives transformers' ids
    for this tokenizer, source and these versions; None otherwise (then transformers must be loaded)."""
    verdict = read_verdict(_verdict_path(tokenizer_fp, file))
    if verdict is None:
        return None
    try:
        lite = LiteReference(tokenizer_dir, file)
    except Exception:  # noqa: BLE001 - unreadable for the library: transformers will say why
        return None
    return lite if lite.eos_id == verdict.get("eos_id") else None


def record(
    tokenizer_dir: str, tokenizer_fp: str, tok: Any, texts: list[str], file: str | None = None
) -> bool | None:
    """Compare the lite reference (from ``file`` if given) with transformers' tokenizer ``tok`` on ``texts`` and
    record the verdict; returns it (None when no verdict could be recorded: the shortcut is off or the cache is
    not writable)."""
    path = _verdict_path(tokenizer_fp, file)
    if path is None or _whole_verdict(path) is not None:  # off, or already decided ("different" is kept too)
        return None
    try:
        lite = LiteReference(tokenizer_dir, file)
        same = lite.eos_id == tok.eos_token_id
        for special in (True, False):
            if not same:
                break
            mine = [e.ids for e in lite.backend.encode_batch(texts, add_special_tokens=special)]
            same = mine == tok(texts, add_special_tokens=special)["input_ids"]
    except Exception:  # noqa: BLE001 - the library cannot load or run it: not the same
        same, lite = False, None
    try:
        write_verdict(path, {"same": same, "eos_id": getattr(lite, "eos_id", None), **_versions()})
    except OSError:
        return None
    return same
