"""What a run needs from ``tokenizer.json`` before its data, loaded as cheaply as it can be.

Two fixed costs of a run come from the size of a real vocabulary (its ``tokenizer.json`` runs to tens of MB; the
figures: benchmarks/HISTORY-tokenize.md):

- **Python's parse of tokenizer.json**, only to learn a few facts: whether the fast engine reproduces
  the tokenizer (:func:`~packtools.pipeline.tokenizer.fast.refusal`, and for chat
  :func:`~packtools.pipeline.tokenizer.fast.offsets_refusal`), whether it normalizes to NFC, which bytes its
  vocabulary lacks (:mod:`packtools.pipeline.tokenizer.char_drops`), its added-token strings (for the adversarial set) and
  the UTF-8 length of every token (assistant masks).  :class:`TokenizerFacts` holds exactly these; the first run
  computes them from the parsed file and records them (``$PACKTOOLS_CACHE_DIR/tokenizer-facts/``, atomically),
  keyed by the tokenizer's fingerprint (its files' contents), the packtools version and the code that computes
  them; later runs read the small record instead of parsing the file.  No cache (``PACKTOOLS_CACHE_DIR=''``) or
  an unreadable record means the file is parsed again.  The facts decide nothing about ids: every id still comes
  from the engines, and the proofs (:mod:`packtools.pipeline.tokenizer.proof`) are unchanged.
- **The fast engine's load** (its Rust side builds the merge table), which releases the GIL:
  :class:`FastLoad` runs it in a background thread while the main thread loads the reference tokenizer (the
  ``tokenizers`` library, which holds the GIL) or transformers, so the two loads overlap where a core is free.
  It also loads faster from a copy of tokenizer.json whose merges are written as ``"a b"`` strings (the older
  spelling both libraries read) instead of ``["a", "b"]`` pairs: the same merges, in the same order, so the same
  tokenizer; the copy is written (next to the facts, ``fast-engine/``) only when no merge piece contains a space,
  which is what makes the two spellings mean the same.  The adversarial proof's recorded verdict names the form
  the engine was loaded from, and the per-part proof runs as always.
"""

from __future__ import annotations

import io
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import _gc
from ..._atomic import atomic_path, discard
from ...constants import __version__
from ...io.fingerprint import cache_key
from . import fast as fast_engine
from .char_drops import missing_bytes
from .folder import file_sha256
from .proof_cache import code_hash
from .reference import cache_dir

FACTS_FORMAT = 1
_FACT_MODULES = ("fast.py", "char_drops.py", "load.py")
#: tokenizer.json sizes from which the first batches may go to the reference while the fast engine loads
OVERLAP_MIN_BYTES = 4 << 20
#: Raw input up to this size (file bytes) is tokenized by the reference alone under ``auto`` when the vocabulary
#: is one of :data:`OVERLAP_MIN_BYTES` or more: the reference is done with it before the fast engine would have
#: loaded (1.5-4 s for a 128k-250k vocabulary), and a run that starts no load neither competes with it for the
#: cores nor waits for it at exit.
SMALL_INPUT_BYTES = 4 << 20


@dataclass
class TokenizerFacts:
    """The facts of a ``tokenizer.json`` a run uses (see the module docstring); ``recorded``: read from the cache."""

    refusal: str | None
    chat_refusal: str | None
    nfc: bool
    missing: list[int]
    specials: list[str]
    byte_lengths: np.ndarray = field(repr=False)
    recorded: bool = False

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> TokenizerFacts:
        """The facts of a parsed tokenizer.json.

        >>> TokenizerFacts.from_spec({"model": {"type": "WordPiece", "vocab": {}}}).refusal
        'its model is WordPiece, not a byte-level BPE'
        """
        refusal = fast_engine.refusal(spec)
        model = spec.get("model") or {}
        lengths = (
            fast_engine.byte_lengths_of(spec)
            if refusal is None and isinstance(model.get("vocab"), dict)
            else np.zeros(0, np.int64)
        )
        return cls(
            refusal=refusal,
            chat_refusal=fast_engine.offsets_refusal(spec),
            nfc=fast_engine.has_nfc(spec),
            missing=missing_bytes(spec),
            specials=[a.get("content", "") for a in spec.get("added_tokens", [])],
            byte_lengths=lengths,
        )

    def _meta(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("refusal", "chat_refusal", "nfc", "missing", "specials")}


def facts_path(tokenizer_fp: str) -> str | None:
    """Where the facts of the tokenizer with fingerprint ``tokenizer_fp`` are recorded (None: the cache is off)."""
    root = cache_dir()
    if root is None:
        return None
    key = cache_key("tokenizer-facts", FACTS_FORMAT, tokenizer=tokenizer_fp, packtools=__version__,
                    code=code_hash(_FACT_MODULES))[:32]  # fmt: skip
    return os.path.join(root, "tokenizer-facts", key + ".npz")


def _read(path: str) -> TokenizerFacts | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode("utf-8"))
            lengths = np.ascontiguousarray(z["byte_lengths"], dtype=np.int64)
        facts = TokenizerFacts(byte_lengths=lengths, recorded=True, **meta)
    except Exception:  # noqa: BLE001 - a cut or damaged record (BadZipFile, EOFError, ...): parsed again
        return None
    return facts


def _write(path: str, facts: TokenizerFacts) -> None:
    buf = io.BytesIO()
    meta = np.frombuffer(json.dumps(facts._meta()).encode("utf-8"), np.uint8)
    np.savez(buf, meta=meta, byte_lengths=facts.byte_lengths)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            fh.write(buf.getvalue())
    except OSError:  # best effort: an unwritable cache only means the file is parsed again next time
        return


def load_facts(tokenizer_dir: str, tokenizer_fp: str) -> TokenizerFacts | None:
    """The facts of the folder's tokenizer.json: recorded ones when this fingerprint and code have them, else
    parsed from the file (and recorded).  None when tokenizer.json is missing or unreadable."""
    path = facts_path(tokenizer_fp)
    if path is not None and os.path.isfile(path):
        facts = _read(path)
        if facts is not None:
            return facts
    with _gc.paused():  # hundreds of thousands of lists and dicts, no cycle among them (packtools._gc)
        try:
            spec = fast_engine.read_spec(tokenizer_dir)
        except (OSError, ValueError):
            return None
        facts = TokenizerFacts.from_spec(spec)
        if path is not None:
            _write(path, facts)
            if facts.refusal is None:
                write_compact(compact_path(tokenizer_fp), spec)
        del spec
    return facts  # the parsed file is large; only the facts are kept


def compact_path(tokenizer_fp: str) -> str | None:
    """Where the fast engine's copy of tokenizer.json with ``"a b"`` merges is kept (None: the cache is off)."""
    root = cache_dir()
    if root is None:
        return None
    key = cache_key("fast-engine-json", FACTS_FORMAT, tokenizer=tokenizer_fp, engine=fast_engine.engine_key("auto"),
                    code=code_hash(_FACT_MODULES))[:32]  # fmt: skip
    return os.path.join(root, "fast-engine", key + ".json")


def compact_file(tokenizer_fp: str) -> str | None:
    """The recorded copy of tokenizer.json with ``"a b"`` merges, if there is one."""
    path = compact_path(tokenizer_fp)
    return path if path is not None and os.path.isfile(path) else None


def write_compact(path: str | None, spec: dict[str, Any]) -> bool:
    """Write ``spec`` with its merges as ``"a b"`` strings to ``path``; only when every merge is a pair of
    pieces without a space (else the spellings could differ in meaning) and not already so spelled."""
    merges = (spec.get("model") or {}).get("merges")
    if path is None or not merges:
        return False
    for m in merges:
        if not (isinstance(m, list) and len(m) == 2 and " " not in m[0] and " " not in m[1]):
            return False
    model = dict(spec["model"], merges=[f"{a} {b}" for a, b in merges])
    # one string from the C encoder, one write: json.dump's many small writes through its Python encoder took
    # twice as long (a first run's fast-engine load starts only once this copy is written)
    text = json.dumps(dict(spec, model=model), ensure_ascii=False)
    try:
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        with atomic_path(path + ".sha256") as tmp, open(tmp, "w", encoding="ascii") as fh:
            fh.write(file_sha256(path))  # checked before every load (compact_intact)
    except OSError:
        return False
    return True


def compact_intact(path: str) -> bool:
    """Whether the copy at ``path`` is the file :func:`write_compact` wrote (its recorded SHA-256); a damaged
    or unrecorded copy is removed (the engine then loads tokenizer.json, and the next run writes it again)."""
    try:
        with open(path + ".sha256", encoding="ascii") as fh:
            if fh.read().strip() == file_sha256(path):
                return True
    except OSError:
        pass
    discard(path, path + ".sha256")
    return False


class FastLoad:
    """The fast engine's native tokenizer of a folder, loaded in a background thread from construction on.

    :meth:`result` waits for it and returns it, or raises what loading raised.  The engine's thread count is
    fixed when it is loaded (``TOKENIZERS_PARALLELISM=false``, as in pipeline workers, means one thread).
    """

    def __init__(self, tokenizer_dir: str, tokenizer_fp: str, threads: int | None = None) -> None:
        self._path = os.path.join(tokenizer_dir, "tokenizer.json")
        self._compact = compact_file(tokenizer_fp)
        #: what the engine was loaded from: ``tokenizer.json``, or ``compact`` (its copy with "a b" merges)
        self.source = "compact" if self._compact is not None else "tokenizer.json"
        try:
            self.size = os.path.getsize(self._compact or self._path)
        except OSError:  # the load will say why
            self.size = 0
        self._native: Any = None
        self._error: BaseException | None = None
        fast_engine.set_engine_threads(threads)  # before the load: the engine reads it when it starts
        # not a daemon: the interpreter joins it before finalizing (a daemon thread still inside the native load
        # when the process exits aborts it: "FATAL: exception not rethrown", exit status 134)
        self._thread = threading.Thread(target=self._load, name="packtools-fast-engine-load", daemon=False)
        self._thread.start()

    def _load(self) -> None:
        try:
            import fastokens

            if self._compact is not None and not compact_intact(self._compact):
                self._compact, self.source = None, "tokenizer.json"
            if self._compact is not None:
                try:
                    self._native = fastokens.Tokenizer.from_file(self._compact)
                    return
                except Exception:  # noqa: BLE001 - e.g. removed meanwhile: the original file
                    self.source = "tokenizer.json"
            self._native = fastokens.Tokenizer.from_file(self._path)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result()
            self._error = exc

    def done(self) -> bool:
        """Whether the load has finished (or failed)."""
        return not self._thread.is_alive()

    def overlaps(self) -> bool:
        """Whether the load is still running and is one worth overlapping with the first batches: a vocabulary
        file of :data:`OVERLAP_MIN_BYTES` or more (a small one loads in milliseconds)."""
        return not self.done() and self.size >= OVERLAP_MIN_BYTES

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._native


def reference_suffices(tokenizer_dir: str, requested: str, input_bytes: int | None) -> bool:
    """Whether a run of ``input_bytes`` (None: unknown) is tokenized by the reference alone: ``auto``, at most
    :data:`SMALL_INPUT_BYTES` of input, a vocabulary of :data:`OVERLAP_MIN_BYTES` or more."""
    if requested != "auto" or input_bytes is None or input_bytes > SMALL_INPUT_BYTES:
        return False
    try:
        return os.path.getsize(os.path.join(tokenizer_dir, "tokenizer.json")) >= OVERLAP_MIN_BYTES
    except OSError:
        return False


def start_fast_load(
    tokenizer_dir: str, tokenizer_fp: str, facts: TokenizerFacts | None, fmt: str, engine: str
) -> FastLoad | None:
    """A background load of the fast engine when it may be used: installed, requested or ``auto``, and the
    tokenizer one it reproduces (for chat also by offsets); None otherwise."""
    if engine == "transformers" or facts is None or facts.refusal is not None or facts.missing:
        return None
    if fmt == "messages" and facts.chat_refusal is not None:
        return None
    if fast_engine.engine_version() is None:
        return None
    return FastLoad(tokenizer_dir, tokenizer_fp)
