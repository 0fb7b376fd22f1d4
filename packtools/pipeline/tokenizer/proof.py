"""Choosing the tokenizer engine, and the proof that keeps the fast one honest on the data.

:func:`choose_engine` picks the fast engine of :mod:`packtools.pipeline.tokenizer.fast` for a tokenizer it
reproduces once it gave transformers' ids (and assistant masks) on the built-in adversarial set; otherwise
transformers (``auto``) or a clear error (``fast``); :func:`adopt` takes the driver's choice (``proven``) in a
worker process, which does not choose again.  Both return a :class:`Choice`, which the tokenizer takes: it alone
changes its engine's state.

:class:`Proof` then decides which rows of the data are compared with transformers (the first rows of each column
of a run's first part, or of every part without runs, then a sample of every part's rows at the audit rate,
seeded by the part: ``docs/tokenize.md``, *Engines*) and counts them per part, for the manifest.

>>> p = Proof(audit_rate=0.5)
>>> p.start_part("part-0")
>>> rows, proof = p.sample("text", 300)
>>> proof, rows[:proof].tolist() == list(range(256)), 10 < len(rows) - proof < 40
(256, True, True)
>>> p.count("text", 256, 256)
>>> rows, proof = p.sample("text", 1000)
>>> proof, 400 < len(rows) < 600, p.checked()
(0, True, {'rows_checked': 256, 'proof_rows': 256})
"""

from __future__ import annotations

import functools
import random
import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import PackingError
from ..formats import at
from . import adversarial, proof_cache
from . import fast as fast_engine
from .char_drops import describe_bytes
from .load import SMALL_INPUT_BYTES


class EngineDivergence(PackingError):
    """The fast engine gave other ids than transformers on a row the audit compared, in a part staged under the
    driver's verdict (:mod:`packtools.pipeline.tokenizer.verdict`): the driver restages every fast-engine part of the run
    with transformers (``auto``) or stops with this error (``fast``).  ``what`` describes the difference."""

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(message, param="tokenizer_engine")
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (pool, Ray) with its ``what``
        return (EngineDivergence, (str(self), self.what))


class Proof:
    """Per run: the proof budget per column; per part: the seeded audit sample and the counts of compared rows."""

    def __init__(self, audit_rate: float = fast_engine.AUDIT_RATE) -> None:
        self.audit_rate = fast_engine.check_audit_rate(audit_rate)
        self.start_part("")

    def start_part(self, seed: str, proves: bool = True) -> None:
        """A new part, its audit sample seeded by ``seed``; ``proves``: its first rows of every column are the
        proof (the first part of a run), else it has none."""
        self._budget: dict[str, int] = {}
        self._proves = proves
        self._rng = np.random.default_rng(random.Random(seed).getrandbits(64))
        self.rows_checked = 0
        self.proof_rows = 0
        self.batches_on_transformers = 0
        self.batches_fast = 0  # batches the fast engine tokenized (chat: labelled) and the proof passed
        self.why_transformers: str | None = None  # why the first such batch went to transformers

    def sample(self, column: str, n: int) -> tuple[np.ndarray, int]:
        """Rows of a batch of ``n`` rows of ``column`` to compare, and how many of them (the first ones) are
        the column's proof; the rest of the batch is sampled at the audit rate."""
        budget = self._budget.setdefault(column, fast_engine.PROOF_ROWS) if self._proves else 0
        proof = min(n, max(budget, 0))
        rest = n - proof
        if rest and self.audit_rate > 0.0:
            audit = proof + np.flatnonzero(self._rng.random(rest) < self.audit_rate).astype(np.int64)
        else:
            audit = np.zeros(0, np.int64)
        return np.concatenate([np.arange(proof, dtype=np.int64), audit]), proof

    def count(self, column: str, rows: int, proof: int) -> None:
        """``rows`` rows of ``column`` were compared, the first ``proof`` of them as its proof."""
        self._budget[column] = self._budget.get(column, fast_engine.PROOF_ROWS) - proof
        self.proof_rows += proof
        self.rows_checked += rows

    def to_transformers(self, why: str) -> None:
        """A batch is tokenized by transformers instead (an engine error, text the fast path does not take)."""
        self.batches_on_transformers += 1
        if self.why_transformers is None:
            self.why_transformers = why

    def checked(self) -> dict[str, int]:
        out = {"rows_checked": self.rows_checked, "proof_rows": self.proof_rows}
        if self.batches_on_transformers:
            out["batches_on_transformers"] = self.batches_on_transformers
        return out


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_engine` or :func:`adopt` decided, for the tokenizer to take
    (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer._choose`): the engine's report, the fast engine when it
    tokenizes (``fast``), or its background load still running to be taken at a later batch (``pending``);
    ``recorded``: the adversarial verdict was a recorded one; ``source``: the file the fast engine loads."""

    report: fast_engine.EngineReport
    fast: fast_engine.FastEncoder | None = None
    pending: Any = None  # a packtools.pipeline.tokenizer.load.FastLoad
    recorded: bool = False
    source: str | None = None


def choose_engine(bt: Any, requested: str, facts: Any) -> Choice:
    """The engine for :class:`~packtools.pipeline.tokenizer.batch.BatchTokenizer` ``bt`` (the fast one, from
    ``bt.load_fast``, in :attr:`Choice.fast` when it is chosen); ``facts``: the
    :class:`~packtools.pipeline.tokenizer.load.TokenizerFacts` of its tokenizer.json (None when unreadable)."""
    source: str | None = None
    recorded: dict[str, int] | None = None

    def refuse(why: str) -> Choice:
        if requested == "fast":
            raise PackingError(
                f"tokenizer_engine='fast' cannot tokenize with {bt.tokenizer_dir!r}: {why}; use "
                f"tokenizer_engine='auto' (falls back to transformers) or 'transformers'.",
                param="tokenizer_engine",
            )
        return Choice(
            fast_engine.EngineReport("transformers", why, requested),
            recorded=recorded is not None,
            source=source,
        )

    if requested == "transformers":
        return Choice(
            fast_engine.EngineReport("transformers", "requested (tokenizer_engine='transformers')", requested)
        )
    version = fast_engine.engine_version()
    if version is None:
        return refuse("the fast engine is not installed (pip install 'packtools[fast]')")
    if facts is None:
        return refuse("its tokenizer.json cannot be read")
    why = facts.refusal
    if why is None and bt.fmt == "messages":
        why = facts.chat_refusal
    if why is not None:
        return refuse(f"the tokenizer is not one the fast engine reproduces here: {why}")
    outside = getattr(bt, "added_outside", [])
    if outside:
        shown = ", ".join(repr(t) for t in outside[:3]) + (
            f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        )
        return refuse(
            f"transformers adds tokens its tokenizer.json lacks ({shown}, from added_tokens.json, "
            f"tokenizer_config.json or special_tokens_map.json), which the fast engine does not know"
        )
    missing = facts.missing
    if missing:
        return refuse(
            f"its byte-level vocabulary ({bt.tokenizer_dir}/tokenizer.json) has no token for "
            f"{describe_bytes(missing)}: transformers leaves those bytes out of the ids (packtools counts them), "
            f"the fast engine cannot encode them"
        )
    small = getattr(bt, "small_input", None)
    if small is not None:  # no load was started: transformers' ids from the reference, every batch
        return Choice(
            fast_engine.EngineReport(
                "transformers",
                f"the input ({small / 1e6:.2f} MB) is smaller than {SMALL_INPUT_BYTES >> 20} MiB: "
                f"the reference ({bt.reference_engine}) tokenizes it sooner than the fast engine loads this "
                f"vocabulary, so the fast engine is not loaded",
                requested,
            )
        )
    load = bt.background_load
    texts = adversarial.adversarial_texts(facts.specials)
    # a passing verdict on this fixed set recorded by an earlier run (proof_cache) is taken as it is
    kind = "messages" if bt.fmt == "messages" else "text"
    source = load.source if load is not None else "tokenizer.json"
    verdict = proof_cache.verdict_path(bt.fingerprint, kind, bt.reference_engine, texts, source=source)
    recorded = proof_cache.load(verdict)
    if recorded is None and bt.reference_engine != "transformers":
        # a verdict against transformers itself, recorded by the first run (before the tokenizers library was
        # checked equal to it, which that run does too), proves as much: the second run takes it
        recorded = proof_cache.load(
            proof_cache.verdict_path(bt.fingerprint, kind, "transformers", texts, source=source)
        )
    reason = (
        f"byte-level BPE; identical ids to transformers on the built-in adversarial set; in every run the first "
        f"{fast_engine.PROOF_ROWS} rows of each column and a random {bt.proof.audit_rate:.4g} of the rows after "
        f"them are compared as they are tokenized"
    )
    report = fast_engine.EngineReport(
        f"{fast_engine.ENGINE_MODULE} {version}", reason, requested, recorded or {}
    )
    overlap = not bt.wait_for_engine and requested == "auto"
    if recorded is not None and load is not None and overlap and load.overlaps():
        # still loading: the reference tokenizes the first batches meanwhile (BatchTokenizer.encode takes the
        # engine at the first batch after the load finished)
        return Choice(report, pending=load, recorded=True, source=source)
    try:
        fast = bt.load_fast()
    except (OSError, ValueError, RuntimeError) as exc:
        return refuse(f"the fast engine cannot load its tokenizer.json ({exc})")
    source = bt.fast_source
    if recorded is not None:
        return Choice(report, fast=fast, recorded=True, source=source)
    for special in (True, False):
        try:
            got = fast.encode(texts, special)
        except Exception as exc:  # noqa: BLE001 - any engine error: transformers tokenizes (auto) or we stop
            return refuse(
                f"the fast engine fails on the built-in adversarial set ({type(exc).__name__}: {exc})"
            )
        ref = bt.reference_ids(texts, special)
        bad = fast_engine.first_difference(got, ref)
        if bad is not None:
            row = got.values[got.offsets[bad] : got.offsets[bad + 1]].tolist()
            return refuse(
                f"the fast engine's ids differ from transformers' on the built-in adversarial set "
                f"({fast_engine.describe_difference(texts, bad, row, ref[bad])})"
            )
    checked = {"adversarial_texts": 2 * len(texts)}
    if bt.fmt == "messages":
        # the fast chat path runs on NFC text only (other batches: transformers), so prove it there
        if fast.nfc:
            texts = [unicodedata.normalize("NFC", t) for t in texts]
        convs = adversarial.adversarial_conversations(texts)
        with bt.trying(fast):  # the conversations are compared on the fast engine
            try:
                convs = bt.chat.renderable(convs)  # those the template refuses fail on either path
                if not convs:
                    raise PackingError("the chat template refuses every one (its raise_exception)")
                found = bt.chat.compare_labels(convs, range(len(convs)), 0)
                mismatch = found[1] if found is not None else None
            except PackingError as exc:  # e.g. a template that is not incremental: data rows will say so
                mismatch = f"the adversarial conversations cannot be tokenized: {exc}"
            except Exception as exc:  # noqa: BLE001 - an engine error on a rendered conversation
                mismatch = f"the fast engine fails on them ({type(exc).__name__}: {exc})"
        if mismatch is not None:
            return refuse(
                f"the fast path's chat tokens or assistant masks differ from transformers' ({mismatch})"
            )
        checked["adversarial_conversations"] = len(convs)
    check = getattr(bt, "reference_check", None)
    if check is None:
        proof_cache.record(verdict, checked)
    else:  # proven against a provisional reference: recorded, as proven against transformers, once it is checked
        as_proven = proof_cache.verdict_path(bt.fingerprint, kind, "transformers", texts, source=source)
        check.on_pass.append(functools.partial(proof_cache.record, as_proven, checked))
    report.checked = checked  # (no recorded verdict: it was empty)
    return Choice(report, fast=fast, source=source)


def adopt(bt: Any, proven: dict[str, Any]) -> Choice:
    """In a worker: the driver's engine choice ``proven`` (an :meth:`EngineReport.to_dict`) taken as it is."""
    report = fast_engine.EngineReport.from_dict(proven)
    if report.engine == "transformers":
        return Choice(report)
    fast = bt.load_fast()
    return Choice(report, fast=fast, source=bt.fast_source)


def engine_error(bt: Any, exc: Exception, texts: list[str], special: bool, first_row: Any) -> None:
    """The fast engine raised on a batch of ``bt``: transformers tokenizes it (auto; counted), or a clear error
    naming the row (fast)."""
    if bt.report.requested != "fast":
        bt.proof.to_transformers(f"{at(first_row)}: the fast engine raised {type(exc).__name__}: {exc}")
        return
    row = 0
    for i, text in enumerate(texts):
        try:
            bt.fast.encode([text], special)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - this is the row
            row = i
            break
    raise PackingError(
        f"{at(first_row, row)}: the fast tokenizer engine cannot encode this text ({type(exc).__name__}: "
        f"{exc}); transformers can: rerun with tokenizer_engine='auto' or 'transformers'.",
        param="tokenizer_engine",
    ) from exc
