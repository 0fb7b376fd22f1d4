"""The fast engine's verdict on the built-in adversarial set, recorded so that later runs skip that fixed set.

The adversarial proof (:func:`packtools.pipeline.tokenizer.proof.choose_engine`) gives the same answer for the
same texts, tokenizer, libraries and code, so a *passing* verdict is written (atomically) to
``$PACKTOOLS_CACHE_DIR/engine-proof/``, keyed by everything the answer depends on (:func:`verdict_path`; the list
and why each is there: ``docs/tokenize.md``, *The adversarial proof's verdict is recorded*).  Anything else runs
the proof; a failing verdict is not recorded: it is computed again, and says why each time.  A recorded verdict
does not skip the per-part proof on the data (:class:`~packtools.pipeline.tokenizer.proof.Proof`).

>>> import os
>>> saved = os.environ.get("PACKTOOLS_CACHE_DIR")
>>> os.environ["PACKTOOLS_CACHE_DIR"] = ""
>>> verdict_path("0" * 64, "text", "transformers", ["a"]) is None   # the cache is off
True
>>> _ = os.environ.pop("PACKTOOLS_CACHE_DIR") if saved is None else os.environ.update(PACKTOOLS_CACHE_DIR=saved)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from ...io.fingerprint import cache_key
from . import fast as fast_engine
from .reference import _versions, cache_dir, read_verdict, write_verdict

PROOF_CACHE_FORMAT = 1


def verdict_path(
    tokenizer_fp: str,
    kind: str,
    reference_engine: str,
    texts: Sequence[str],
    *,
    source: str = "tokenizer.json",
) -> str | None:
    """Where the verdict for these inputs is kept (None: the cache is off); ``source``: what the fast engine was
    loaded from (:class:`packtools.pipeline.tokenizer.load.FastLoad`)."""
    root = cache_dir()
    if root is None:
        return None
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    key = cache_key(
        "engine-proof",
        PROOF_CACHE_FORMAT,
        tokenizer=tokenizer_fp,
        data=kind,
        reference=reference_engine,
        texts=h.hexdigest(),
        source=source,
        engine=fast_engine.engine_key("auto"),
        versions=_versions(),
        code=code_hash(),
    )[:32]
    return os.path.join(root, "engine-proof", key + ".json")


_PROOF_MODULES = (  # every module that decides ids, labels or a verdict (F6)
    "adversarial.py",
    "char_drops.py",
    "chat/local.py",
    "reference.py",
    "proof.py",
    "fast.py",
    "chat/labels.py",
    "chat/tokens.py",
    "chat/render.py",
    "batch.py",
    "proof_cache.py",
    "load.py",
)


@functools.cache
def code_hash(modules: tuple[str, ...] = _PROOF_MODULES) -> str:
    """A hash of the sources of ``modules`` (files of this package) that a recorded answer depends on: a
    development checkout changes them without a new version number.  Read once per process (the code that runs
    is the code loaded)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in modules:
        with open(os.path.join(here, name), "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def load(path: str | None) -> dict[str, int] | None:
    """The ``checked`` counts of a recorded passing verdict at ``path``, or None (no verdict: run the proof)."""
    verdict = read_verdict(path)
    checked = verdict.get("checked") if verdict is not None else None
    if not isinstance(checked, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in checked.items()):
        return None
    return checked


def record(path: str | None, checked: dict[str, Any]) -> None:
    """Record a passing verdict (best effort: an unwritable cache only means the proof runs again next time)."""
    if path is not None:
        with contextlib.suppress(OSError):
            write_verdict(path, {"same": True, "checked": checked, **_versions()})
