"""transformers' ids without importing transformers, where that is proven to give the same ids.

Loading a tokenizer through transformers imports transformers (and with it torch): a fixed cost per run larger
than tokenizing a large corpus with the fast engine (docs/tokenize.md).  For plain-text formats the reference ids (what
the fast engine is compared with, and what runs when it does not apply) need only the Rust ``tokenizers``
library that transformers itself calls, loaded from the same ``tokenizer.json`` with truncation and padding
off, and the EOS id from the tokenizer's config.

That this gives transformers' ids is not assumed: the first run with a tokenizer loads it through transformers
too, compares both on the built-in adversarial set (with and without special tokens) and their EOS ids, and
records the verdict in a small file keyed by the tokenizer's fingerprint and the versions of transformers,
tokenizers and packtools (under ``$PACKTOOLS_CACHE_DIR``, default ``~/.cache/packtools``).  Later runs with a
"same" verdict skip transformers; anything else (a differing id, a new version, no verdict) loads transformers.
``PACKTOOLS_CACHE_DIR=''`` turns the shortcut off.  A pipeline's first run of plain text does that check in a
child process while it stages on the library's tokenizer as a provisional reference
(:mod:`packtools.pipeline.tokenizer.reference_check`), and waits for it before anything is planned or installed (docs/tokenize.md).

The library parses ``tokenizer.json``'s merges faster when they are spelled ``"a b"`` than as ``["a", "b"]`` pairs,
and the fast engine keeps such a copy
(:mod:`packtools.pipeline.tokenizer.load`).  The reference loads that copy only where the same run that checked
``tokenizer.json`` against transformers also found the copy *identical* to it: both loaded by the library and
serialized back (its whole state: vocabulary, every merge in order, normalizer, pre-tokenizer, added tokens,
post-processor), the two serializations equal.  That finding is recorded with the copy's SHA-256, which is checked
before every load: a damaged, cut, rewritten or unrecorded copy is never loaded (``tokenizer.json`` is), and a copy
that was not identical is removed.  So the copy cannot be "compared with itself": what is loaded is, byte for byte,
the file that was proven to be ``tokenizer.json``'s tokenizer.

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
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..._atomic import atomic_path, discard
from ...constants import __version__
from ...io.fingerprint import cache_key
from .folder import file_sha256

VERDICT_FORMAT = 1

#: the methods of ``tokenizers.Tokenizer`` the lite reference calls (``encode_batch``: with offsets, which the chat
#: formats' labels read; ``encode_batch_fast``, ids alone, is taken where the library has it: :func:`batch_encoder`)
LITE_CALLS = ("from_file", "no_truncation", "no_padding", "token_to_id", "encode_batch", "to_str")


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
    source = {} if file is None else {"source": "compact"}  # the copy with "a b" merges (tokenizer.load)
    key = cache_key("reference", VERDICT_FORMAT, tokenizer=tokenizer_fp, versions=_versions(), **source)[:32]
    return os.path.join(root, "reference", key + ".json")


class LiteUnavailable(RuntimeError):
    """The installed ``tokenizers`` cannot be the lite reference (:func:`library_gap` says why)."""


def library_gap() -> str | None:
    """Why the installed ``tokenizers`` cannot be the lite reference, in a sentence: its ``Tokenizer`` lacks one of
    :data:`LITE_CALLS` (a release that renamed or removed it), or it is not installed; None where it has them all.
    transformers is then the reference: the ids are its own either way, only the run loads it."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return "the tokenizers library is not installed, so transformers is loaded as the reference"
    lacking = [name for name in LITE_CALLS if not callable(getattr(Tokenizer, name, None))]
    if not lacking:
        return None
    return (
        f"the installed tokenizers {_versions()['tokenizers']} has no Tokenizer.{', Tokenizer.'.join(lacking)}, "
        f"which packtools' lite reference calls, so transformers is loaded as the reference: the same ids, a "
        f"longer load (a tokenizers release that has it brings the shortcut back)"
    )


def batch_encoder(backend: Any) -> Callable[..., list[Any]]:
    """The batch encoder of a ``tokenizers.Tokenizer`` for ids alone: ``encode_batch_fast`` (no offsets, the same
    ids) where the library has it, else ``encode_batch``."""
    fast = getattr(backend, "encode_batch_fast", None)
    return fast if fast is not None else backend.encode_batch


class LiteReference:
    """The ``tokenizers`` library's tokenizer of a folder, as transformers' ``__call__`` runs it; ``file``: the
    copy of its tokenizer.json to load instead (with ``"a b"`` merges; only one recorded identical to it).
    :class:`LiteUnavailable` where the installed library lacks a method it calls (:func:`library_gap`), checked
    before any is called: a reference that loaded has every method it is later asked for."""

    def __init__(self, tokenizer_dir: str, file: str | None = None) -> None:
        gap = library_gap()
        if gap is not None:
            raise LiteUnavailable(gap)
        from tokenizers import Tokenizer

        #: what was loaded: ``tokenizer.json``, or ``copy`` (its copy checked identical, see the module docstring)
        self.source = "tokenizer.json" if file is None else "copy"
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


def _copy_verdict(tokenizer_fp: str, copy: str | None) -> dict[str, Any] | None:
    """The recorded finding that ``copy`` is identical to the folder's tokenizer.json, when it is a pass and the
    copy's SHA-256 is still the one it was found with; None otherwise."""
    if copy is None:
        return None
    verdict = read_verdict(_verdict_path(tokenizer_fp, copy))
    if verdict is None or verdict.get("identical") is not True:
        return None
    try:
        return verdict if file_sha256(copy) == verdict.get("copy_sha256") else None
    except OSError:  # removed meanwhile (the fast engine's own check removes a damaged copy)
        return None


def load_verified(tokenizer_dir: str, tokenizer_fp: str, copy: str | None = None) -> LiteReference | None:
    """The lite reference when a recorded verdict says it gives transformers' ids for this tokenizer and these
    versions; None otherwise (then transformers must be loaded).  ``copy``: the fast engine's copy of
    tokenizer.json, loaded instead only where it was recorded identical to it with this very SHA-256."""
    verdict = read_verdict(_verdict_path(tokenizer_fp))
    if verdict is None:
        return None
    twin = _copy_verdict(tokenizer_fp, copy)
    for file in ((copy,) if twin is not None else ()) + (None,):
        try:
            lite = LiteReference(tokenizer_dir, file)
        except Exception:  # noqa: BLE001 - unreadable for the library: the next source, or transformers says why
            continue
        return lite if lite.eos_id == verdict.get("eos_id") else None
    return None


def transformers_ids(tok: Any, texts: list[str]) -> dict[str, Any]:
    """What the check compares the lite reference with: transformers' tokenizer ``tok``'s EOS id and its ids of
    ``texts`` with special tokens (``"special"``) and without (``"plain"``), through its ``__call__``."""
    ids = {
        name: tok(texts, add_special_tokens=name == "special")["input_ids"] for name in ("special", "plain")
    }
    return {"eos_id": tok.eos_token_id, "ids": ids}


def compare(lite: LiteReference, theirs: dict[str, Any], texts: list[str]) -> str | None:
    """Where the lite reference first differs from transformers' answer ``theirs`` (:func:`transformers_ids`:
    its EOS id, then its ids of ``texts`` with and without special tokens), or None where it gives the same."""
    if lite.eos_id != theirs["eos_id"]:
        return f"the EOS id differs ({lite.eos_id} against transformers' {theirs['eos_id']})"
    encode = batch_encoder(lite.backend)  # the ids alone, no offsets
    for name in ("special", "plain"):
        mine = [e.ids for e in encode(texts, add_special_tokens=name == "special")]
        for i, (a, b) in enumerate(zip(mine, theirs["ids"][name])):
            if a != b:
                return f"adversarial text {i} (special tokens {'on' if name == 'special' else 'off'}) gives other ids"
        if len(mine) != len(theirs["ids"][name]):
            return "a different number of encodings"
    return None


def record(
    tokenizer_dir: str, tokenizer_fp: str, tok: Any, texts: list[str], copy: str | None = None
) -> bool | None:
    """Compare the lite reference with transformers' tokenizer ``tok`` on ``texts`` and record the verdict;
    returns it (None when no verdict could be recorded: the shortcut is off or the cache is not writable).
    ``copy``: the fast engine's copy of tokenizer.json, then also compared with tokenizer.json's tokenizer as a
    whole (:func:`record_copy`)."""
    path = _verdict_path(tokenizer_fp)
    if path is None or _whole_verdict(path) is not None:  # off, or already decided ("different" is kept too)
        return None
    try:
        lite = LiteReference(tokenizer_dir)
        same = compare(lite, transformers_ids(tok, texts), texts) is None
    except Exception:  # noqa: BLE001 - the library cannot load or run it: not the same
        same, lite = False, None
    try:
        write_verdict(path, {"same": same, "eos_id": getattr(lite, "eos_id", None), **_versions()})
    except OSError:
        return None
    if same and copy is not None and lite is not None:
        record_copy(tokenizer_fp, lite, copy)
    return same


def unchecked(tokenizer_fp: str) -> bool:
    """Whether no verdict is recorded for this tokenizer and these versions while the cache is on: the run that
    finds it so checks the lite reference against transformers (now, or
    :class:`~packtools.pipeline.tokenizer.reference_check.ReferenceCheck`)."""
    path = _verdict_path(tokenizer_fp)
    return path is not None and _whole_verdict(path) is None


def copy_identical(lite: LiteReference | str, copy: str) -> tuple[str | None, bool]:
    """The SHA-256 of ``copy`` and whether it loads as the very tokenizer ``lite`` loaded from tokenizer.json
    (their serialized states equal: vocabulary, every merge in order, normalizer, pre-tokenizer, added tokens,
    post-processor).  ``lite`` may be given as the SHA-256 of its serialized state (the check's child process
    compares one tokenizer in memory at a time)."""
    from tokenizers import Tokenizer

    try:
        sha = file_sha256(copy)
        twin = Tokenizer.from_file(copy)
        twin.no_truncation()
        twin.no_padding()
        if isinstance(lite, str):
            return sha, hashlib.sha256(twin.to_str().encode("utf-8")).hexdigest() == lite
        return sha, twin.to_str() == lite.backend.to_str()
    except Exception:  # noqa: BLE001 - unreadable or removed: not identical
        return None, False


def write_copy_finding(tokenizer_fp: str, copy: str, sha: str | None, identical: bool) -> bool | None:
    """Record whether ``copy`` (SHA-256 ``sha``) is identical to tokenizer.json's tokenizer; a copy that is not is
    removed.  None: nothing could be recorded."""
    path = _verdict_path(tokenizer_fp, copy)
    if path is None:
        return None
    if not identical:
        discard(copy, copy + ".sha256")  # the fast engine must not load it either
    try:
        write_verdict(path, {"same": identical, "identical": identical, "copy_sha256": sha, **_versions()})
    except OSError:
        return None
    return identical


def copy_removed_note(tokenizer_fp: str) -> str | None:
    """A note for the run's summary where this tokenizer's compact copy was found not identical to tokenizer.json
    and removed (:func:`write_copy_finding`): the reference and the fast engine then load tokenizer.json itself,
    slower, on this run and every later one, which a user would otherwise find nowhere.  None on the normal path
    (the copy found identical, or never checked)."""
    found = _whole_verdict(_verdict_path(tokenizer_fp, "compact"))
    if found is None or found.get("identical") is not False:
        return None
    return (
        "the tokenizer's compact copy of tokenizer.json (the fast-loading one packtools keeps in its cache) did not "
        "load as tokenizer.json's own tokenizer when it was checked, so it was removed: the tokenizer loads from "
        "tokenizer.json itself, slower (tokenizer_load_s in the timings). Please report it, with the tokenizer"
    )


def record_copy(tokenizer_fp: str, lite: LiteReference, copy: str) -> bool | None:
    """Whether ``copy`` loads as the very tokenizer ``lite`` loaded from tokenizer.json (their serialized states
    equal), recorded with the copy's SHA-256; a copy that is not is removed.  None: nothing could be recorded."""
    if _verdict_path(tokenizer_fp, copy) is None:
        return None
    sha, identical = copy_identical(lite, copy)
    return write_copy_finding(tokenizer_fp, copy, sha, identical)
