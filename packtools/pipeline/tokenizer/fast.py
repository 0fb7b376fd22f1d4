"""An exact fast tokenizer for byte-level BPE, proven against transformers before use (extra ``packtools[fast]``).

The engine is `fastokens <https://pypi.org/project/fastokens/>`_, a Rust reimplementation of the
``tokenizers`` pipeline that reads the same ``tokenizer.json`` and returns a batch as two flat buffers, which
become a :class:`Ragged` without a Python int per token (why this engine: ``docs/tokenize.md``, *How the engine
was picked*).  Nothing is taken on trust: :func:`refusal` keeps every tokenizer but the kind the engine is used
for here on transformers, and :class:`FastEncoder` must give transformers' ids on the built-in adversarial set
(:mod:`packtools.pipeline.tokenizer.proof`), then on the first rows of the data and a sample of every later batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.ragged import Ragged
from ...errors import PackingError, check_choice

ENGINES = ("auto", "fast", "transformers")
ENGINE_MODULE = "fastokens"
#: rows at the start of each part, per column, compared with transformers before the engine is trusted
PROOF_ROWS = 256
AUDIT_RATE = 0.001  # after that, each row is compared with this probability (seeded random sample)
_NORMALIZERS = (None, "NFC")


def check_engine(engine: str) -> str:
    return check_choice("tokenizer_engine", engine, ENGINES)


def engine_version() -> str | None:
    """The installed engine's version, or None when ``packtools[fast]`` is not installed."""
    try:
        from importlib.metadata import version

        import fastokens  # noqa: F401
    except ImportError:
        return None
    return version(ENGINE_MODULE)


def engine_key(requested: str) -> str:
    """What of the engine choice goes into cache keys and fingerprints: the requested engine and, unless it is
    ``transformers``, the installed fast engine's version (``'auto fastokens 0.3.5'``, ``'transformers'``)."""
    if requested == "transformers":
        return requested
    return f"{requested} {ENGINE_MODULE} {engine_version() or 'absent'}"


def check_audit_rate(rate: float) -> float:
    """``rate`` if it is a probability in [0, 1], else an error naming the option."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise PackingError(
            f"tokenizer_audit={rate!r} must be a number in [0, 1] (the share of rows after the proof that are "
            f"compared with transformers; default {AUDIT_RATE}).",
            param="tokenizer_audit",
        )
    return float(rate)


def read_spec(tokenizer_dir: str) -> dict[str, Any]:
    """The parsed ``tokenizer.json`` of a tokenizer folder."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _types(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The components of a tokenizer.json node, with ``Sequence`` nodes flattened."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [c for child in node.get(key, []) for c in _types(child, key)]
    return [node]


def refusal(spec: dict[str, Any]) -> str | None:
    """Why the fast engine is not used for the tokenizer described by ``spec`` (a parsed tokenizer.json), or None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not a byte-level BPE"
    if model.get("dropout") not in (None, 0, 0.0):
        return "its BPE has dropout (ids are random)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE uses a subword prefix or an end-of-word suffix"
    pre = _types(spec.get("pre_tokenizer"), "pretokenizers")
    if not any(p.get("type") == "ByteLevel" for p in pre):
        return "its pre-tokenizer is not byte-level"
    other = sorted({p["type"] for p in pre} - {"ByteLevel", "Split"})
    if other:
        return f"its pre-tokenizer uses {', '.join(other)}"
    norms = [n.get("type") for n in _types(spec.get("normalizer"), "normalizers")]
    if any(n not in _NORMALIZERS for n in norms):
        return f"its normalizer ({', '.join(map(str, norms))}) is not NFC"
    return None


def offsets_refusal(spec: dict[str, Any]) -> str | None:
    """Why assistant masks cannot come from byte offsets computed from the ids (chat data), or None.  An NFC
    normalizer is fine: only batches whose rendered text is already NFC take the fast path (:mod:`.chat.labels`)."""
    norms = [n.get("type") for n in _types(spec.get("normalizer"), "normalizers")]
    if any(n != "NFC" for n in norms):
        return "it has a normalizer other than NFC, so token offsets do not follow the text byte for byte"
    post = _types(spec.get("post_processor"), "processors")
    if any(p.get("type") == "ByteLevel" and p.get("trim_offsets") for p in post):
        return "its post-processor trims token offsets"
    return None


def has_nfc(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer normalizes text to NFC."""
    return any(n.get("type") == "NFC" for n in _types(spec.get("normalizer"), "normalizers"))


@dataclass
class EngineReport:
    """Which engine tokenized the data and why (goes into the summary and the manifest)."""

    engine: str
    reason: str
    requested: str = "auto"
    checked: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "requested": self.requested,
            "reason": self.reason,
            "checked": self.checked,
        }

    @classmethod
    def from_dict(cls, report: dict[str, Any]) -> EngineReport:
        """The report :meth:`to_dict` gave (the driver's choice or verdict, handed to a worker or a part)."""
        requested, checked = report.get("requested", "auto"), dict(report.get("checked", {}))
        return cls(report["engine"], report["reason"], requested, checked)


def engine_summary(reports: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One report for a run from its parts' (None for tokenized parts): the engine and reason of the first part
    (of the first that fell back, if any did), the parts per engine, the rows compared in all parts (each part's
    report counts its own rows; the driver's proof rows, ``data_proof_rows``, once), and the characters left out (:func:`packtools.pipeline.tokenizer.char_drops.merge_reports`).

    >>> r = {"engine": "x 1", "requested": "auto", "reason": "ok", "checked": {"rows_checked": 2}}
    >>> engine_summary([r, None, r])["checked"], engine_summary([r])["parts_by_engine"]
    ({'rows_checked': 4}, {'x 1': 1})
    """
    from .char_drops import merge_reports

    done = [r for r in reports if r]
    if not done:
        return None
    by_engine: dict[str, int] = {}
    checked: dict[str, int] = {}
    for r in done:
        by_engine[r["engine"]] = by_engine.get(r["engine"], 0) + 1
        for k, v in r.get("checked", {}).items():
            checked[k] = checked.get(k, 0) + v if k in _PER_PART else max(checked.get(k, 0), v)
    # the driver's proof (packtools.pipeline.tokenizer.verdict) compared the run's first rows once, for every part
    driver = checked.pop("data_proof_rows", 0)
    if driver:
        checked["proof_rows"] = checked.get("proof_rows", 0) + driver
        checked["rows_checked"] = checked.get("rows_checked", 0) + driver
    fallback = next((r for r in done if r["engine"] == "transformers"), None)
    first = fallback if fallback is not None and len(by_engine) > 1 else done[0]
    out = {k: v for k, v in first.items() if k not in ("unencodable", "batches_on_transformers_why")}
    out.update(checked=checked, parts_by_engine=by_engine)
    why = next((r["batches_on_transformers_why"] for r in done if r.get("batches_on_transformers_why")), None)
    if why is not None:
        out["batches_on_transformers_why"] = why
    dropped = merge_reports([r.get("unencodable") for r in done])
    if dropped is not None:
        out["unencodable"] = dropped
    return out


_PER_PART = frozenset({"rows_checked", "proof_rows", "batches_on_transformers"})


class FastEncoder:
    """Batch encoding of strings to a :class:`Ragged` with the fast engine, from a tokenizer folder (or the
    engine's ``native`` tokenizer, loaded already)."""

    def __init__(self, tokenizer_dir: str, *, facts: Any = None, native: Any = None) -> None:
        if native is None:
            try:
                import fastokens
            except ImportError as exc:
                raise ImportError(
                    "the fast tokenizer engine needs the optional dependency 'fastokens'. Install it with: "
                    "pip install 'packtools[fast]'"
                ) from exc
            set_engine_threads(None)
            native = fastokens.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        self._tok = native
        # transformers' __call__ ignores the file's truncation and padding blocks (save_pretrained writes them
        # after a single tokenizer(..., truncation=True) call): so does this engine.
        self._tok.no_truncation()
        self._tok.no_padding()
        if facts is None:  # the parsed tokenizer.json itself is not kept (memory)
            spec = read_spec(tokenizer_dir)
            self._byte_lengths, self.nfc = byte_lengths_of(spec), has_nfc(spec)
        else:  # a packtools.pipeline.tokenizer.load.TokenizerFacts
            self._byte_lengths, self.nfc = facts.byte_lengths, facts.nfc

    def encode(self, texts: list[str], special: bool) -> Ragged:
        """Token ids of ``texts``; ``special`` adds the tokenizer's special tokens (e.g. BOS), like transformers."""
        if not texts:
            return Ragged(np.zeros(1, np.int64), np.zeros(0, np.int32))
        ids, offsets = self._tok.encode_batch_flat(texts, add_special_tokens=special)
        values = np.frombuffer(ids, np.uint32).view(np.int32)
        return Ragged(np.frombuffer(offsets, np.uint64).view(np.int64), values)

    def token_spans(self, texts: list[str], ids: Ragged) -> tuple[np.ndarray, np.ndarray] | None:
        """Byte range of every token in the concatenation of ``texts`` (flat ``(starts, ends)``), or None when
        the tokens do not spell the texts byte for byte (e.g. a normalizer changed them)."""
        lengths = self._byte_lengths  # the UTF-8 length of every token id's text
        if ids.values.size and int(ids.values.max()) >= lengths.shape[0]:
            return None
        tok_bytes = lengths[ids.values]
        ends = np.zeros(tok_bytes.shape[0] + 1, np.int64)
        np.cumsum(tok_bytes, out=ends[1:])
        row_bytes = ends[ids.offsets[1:]] - ends[ids.offsets[:-1]]
        if not np.array_equal(row_bytes, np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64)):
            return None
        return ends[:-1], ends[1:]


def set_engine_threads(threads: int | None) -> None:
    """The engine's worker threads, set before it loads (None: its own choice, all cores; one thread where
    ``TOKENIZERS_PARALLELISM=false``, which the pipeline sets in its worker processes)."""
    if threads is None and os.environ.get("TOKENIZERS_PARALLELISM", "").lower() == "false":
        threads = 1
    if threads is not None:
        os.environ.setdefault("FASTOKENS_BPE_THREADS", str(threads))


def byte_lengths_of(spec: dict[str, Any]) -> np.ndarray:
    """UTF-8 length of every token id's text, from a parsed tokenizer.json (byte-level BPE)."""
    vocab = spec["model"]["vocab"]
    added = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    lengths = np.zeros(max([*vocab.values(), *added.keys()]) + 1, np.int64)
    for token, i in vocab.items():
        lengths[i] = len(token)
    for i, content in added.items():
        lengths[i] = len(content.encode("utf-8"))
    return lengths


def first_difference(fast: Ragged, reference: Sequence[Sequence[int]]) -> int | None:
    """Index of the first row where ``fast`` and the reference token lists differ, or None."""
    if fast.num_rows != len(reference):
        return min(fast.num_rows, len(reference))
    for i, row in enumerate(reference):
        if fast.values[fast.offsets[i] : fast.offsets[i + 1]].tolist() != list(row):
            return i
    return None


def describe_difference(texts: Sequence[str], row: int, fast: Sequence[int], reference: Sequence[int]) -> str:
    """The text and where the two id lists part: the first differing position, the ids from there, the lengths.

    >>> describe_difference(["ab"], 0, [1, 2, 3], [1, 2])
    "text 'ab': ids differ from position 2 of 3 (fast) / 2 (transformers): fast [3], transformers []"
    """
    text = texts[row] if row < len(texts) else "?"
    shown = text if len(text) <= 80 else text[:77] + "..."
    fast, reference = list(fast), list(reference)
    at = next((i for i, (a, b) in enumerate(zip(fast, reference)) if a != b), min(len(fast), len(reference)))
    return (
        f"text {shown!r}: ids differ from position {at} of {len(fast)} (fast) / {len(reference)} (transformers): "
        f"fast {fast[at : at + 8]}, transformers {reference[at : at + 8]}"
    )
