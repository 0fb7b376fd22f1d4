"""A local tokenizer folder: its files, the check that it is one, its fingerprint, and loading it (transformers).

Never touches the network: the folder is what ``tokenizer.save_pretrained(DIR)`` wrote (or a model checkpoint's
folder with its ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..._optional import require
from ...errors import PackingError

#: Files that make up a tokenizer folder (what ``save_pretrained`` writes); the fingerprint reads only these.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def tokenizer_files(path: str) -> list[str]:
    """The tokenizer files in folder ``path`` (see :data:`TOKENIZER_FILES`), sorted.

    >>> tokenizer_files("/no/such/folder")
    []
    """
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        names += sorted(os.path.join("additional_chat_templates", n) for n in os.listdir(extra))
    return sorted(names)


def tokenizer_arg(value: Any) -> str:
    """``tokenizer=`` as a path string: the files decide the ids (and the cache keys hash them), so a loaded
    tokenizer object is refused with the way to give its folder, instead of ``os.fspath``'s ``TypeError``."""
    if not isinstance(value, (str, os.PathLike)):
        raise PackingError(
            f"tokenizer= takes a local tokenizer folder (a str or path), got a {type(value).__name__}; save it "
            f"with tokenizer.save_pretrained(DIR) and pass DIR (the folder's files decide the ids and the cache "
            f"keys).",
            param="tokenizer",
        )
    return os.fspath(value)


def check_tokenizer_dir(path: str | os.PathLike[str]) -> str:
    """``path`` as an absolute folder that holds tokenizer files, or an error that says what to pass."""
    path = os.path.abspath(tokenizer_arg(path))
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a directory"
        raise PackingError(
            f"tokenizer={path!r} {what}; give a local tokenizer folder (tokenizer.json, tokenizer_config.json), "
            f"e.g. one written by tokenizer.save_pretrained(DIR).",
            param="tokenizer",
        )
    if not tokenizer_files(path):
        raise PackingError(
            f"tokenizer={path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); give the "
            f"folder tokenizer.save_pretrained(DIR) wrote (for a model checkpoint, its folder with tokenizer.json).",
            param="tokenizer",
        )
    return path


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a fast tokenizer from a local directory (``save_pretrained`` output); never touches the network."""
    path = check_tokenizer_dir(path)
    transformers = require("transformers", "tokenizing text (--tokenizer)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; say which folder and why
        raise PackingError(
            f"tokenizer={path!r}: transformers cannot load a tokenizer from it ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); check the folder's tokenizer files.",
            param="tokenizer",
        ) from exc
    if not getattr(tok, "is_fast", False):
        raise PackingError(
            f"tokenizer={path!r} loads a slow tokenizer; packtools needs a fast (Rust) one.",
            param="tokenizer",
        )
    return tok


#: per-file hashes taken in this process, keyed by the files' stat (a run asks for them several times)
_HASHES: dict[tuple[Any, ...], dict[str, str]] = {}


def tokenizer_file_hashes(path: str | os.PathLike[str]) -> dict[str, str]:
    """SHA-256 of the content of each of the tokenizer's own files (:func:`tokenizer_files`), whatever its size.
    Model weights and other files in the folder are not read.  Taken once per process while no file's size,
    mtime, ctime or inode changes (any write changes ctime)."""
    path = os.fspath(path)
    stats = []
    for name in tokenizer_files(path):
        st = os.stat(os.path.join(path, name))
        stats.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    key = (os.path.abspath(path), *stats)
    if key not in _HASHES:
        _HASHES[key] = {name: file_sha256(os.path.join(path, name)) for name, *_ in stats}
    return dict(_HASHES[key])


def file_sha256(path: str) -> str:
    """SHA-256 of a file's content, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 over the tokenizer's own files (:func:`tokenizer_files`): their names and the SHA-256 of their
    contents (:func:`tokenizer_file_hashes`), whatever their size."""
    files = tuple(sorted(tokenizer_file_hashes(path).items()))
    if files not in _FINGERPRINTS:
        h = hashlib.sha256()
        for name, digest in files:
            h.update(name.encode() + b"\0" + bytes.fromhex(digest))
        _FINGERPRINTS[files] = h.hexdigest()
    return _FINGERPRINTS[files]


_FINGERPRINTS: dict[tuple[tuple[str, str], ...], str] = {}


#: The named special tokens (transformers passes them to a chat template too).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: the special-token fields of tokenizer_config.json / special_tokens_map.json that transformers adds as tokens
SPECIAL_FIELDS = (*SPECIAL_NAMES, "additional_special_tokens", "extra_special_tokens")


def _contents(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        content = value.get("content")
        return [content] if isinstance(content, str) else [c for v in value.values() for c in _contents(v)]
    if isinstance(value, list):
        return [c for v in value for c in _contents(v)]
    return []


def added_tokens_outside(tokenizer_dir: str, known: list[str]) -> list[str]:
    """Tokens transformers adds when it loads the folder that are not among ``known`` (tokenizer.json's
    ``added_tokens``): from ``added_tokens.json``, ``tokenizer_config.json`` (``added_tokens_decoder`` and the
    special-token fields) and ``special_tokens_map.json``.  The ``tokenizers`` library and the fast engine read
    tokenizer.json alone, so neither reproduces transformers' ids where this is not empty.

    >>> added_tokens_outside("/no/such/folder", [])
    []
    """
    found: list[str] = []
    for name in ("added_tokens.json", "tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(tokenizer_dir, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "added_tokens.json":
            found += [k for k in data if isinstance(k, str)]
            continue
        if name == "tokenizer_config.json":
            found += _contents(list((data.get("added_tokens_decoder") or {}).values()))
        found += [c for f in SPECIAL_FIELDS for c in _contents(data.get(f))]
    have = set(known)
    return sorted({t for t in found if t and t not in have})
