"""Batched tokenization of raw rows into aligned Arrow token columns (extra ``packtools[hf]``); what each format
becomes is in :mod:`packtools.pipeline.formats`.  ``report`` says which engine ran and why: the exact engine of
:mod:`packtools.pipeline.tokenizer.fast` once :mod:`~.proof` has proven it, else transformers (the engines and
their proof: ``docs/tokenize.md``); characters the tokenizer cannot encode are counted
(:mod:`packtools.pipeline.tokenizer.char_drops`).

>>> BatchTokenizer("tok", "tokenized")
Traceback (most recent call last):
packtools.errors.PackingError: format='tokenized' cannot be tokenized; use one of text, prompt_completion, messages, preference.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ...constants import IGNORE_INDEX
from ...core import ragged
from ...core.ragged import Ragged
from ...errors import PackingError
from ...io.json_cells import cells
from ...io.pages import give_back_freed_memory
from ..formats import FORMATS, Row, at, input_columns, shift
from . import adversarial, reference, reference_check
from . import fast as fast_engine
from .char_drops import DropCounter, check_on_unencodable
from .chat import head as chat_head
from .chat import tokens as chat
from .chat.values import by_tools
from .folder import added_tokens_outside, load_tokenizer, tokenizer_fingerprint
from .load import FastLoad, compact_file, load_facts, reference_suffices, start_fast_load
from .proof import EngineDivergence, Proof, adopt, choose_engine, engine_error
from .reference_check import ReferenceCheck

#: the reference of a first run's driver while its check runs (:meth:`BatchTokenizer.settle_reference`)
PROVISIONAL_REFERENCE = "tokenizers (provisional: checked against transformers before the install)"
#: the reference where a recorded (or settled) check says the tokenizers library gives transformers' ids
CHECKED_REFERENCE = "tokenizers (checked equal to transformers)"


def _strings(table: pa.Table, name: str, first_row: Row, values: list | None = None) -> list[str]:
    values = cells(table, name) if values is None else values
    for i, v in enumerate(values):
        if v is None:  # Arrow reads a key a row leaves out as null, like an explicit null
            raise PackingError(
                f"{at(first_row, i)}: column {name!r} is missing or null; every row needs a string there: fix or "
                f"filter that row."
            )
        if not isinstance(v, str):
            raise PackingError(
                f"{at(first_row, i)}: column {name!r} is {type(v).__name__}, not a string; fix or filter that row."
            )
    return values


class BatchTokenizer:
    """Turns a table of raw rows into token columns (what each format becomes: :mod:`packtools.pipeline.formats`).

    Built from the tokenizer *directory*; worker processes build their own from the same arguments, with
    ``proven`` the driver's engine choice (:meth:`EngineReport.to_dict`), which they take without choosing again.
    ``on_unencodable``: ``report`` counts characters the tokenizer cannot encode (:mod:`~.char_drops`), ``error``
    stops at the first one.  ``wait_for_engine``: see :meth:`take_pending` (the pipeline passes False).  ``input_bytes``: the run's raw input size when
    known; with ``wait_for_engine=False`` a small input of a large vocabulary is tokenized by the reference
    alone (:func:`packtools.pipeline.tokenizer.load.reference_suffices`).

    The tokenizer owns its engine's state (``fast``, ``report``, ``pending``: read-only); only its transitions
    change it: chosen or adopted at load, a part's verdict taken (:meth:`start_part`), the pending load taken
    (:meth:`take_pending`), a fallback after a proof row differed.
    """

    def __init__(
        self,
        tokenizer_dir: str,
        fmt: str,
        add_eos: bool = True,
        engine: str = "auto",
        *,
        audit_rate: float = fast_engine.AUDIT_RATE,
        on_unencodable: str = "report",
        proven: dict[str, Any] | None = None,
        wait_for_engine: bool = True,
        input_bytes: int | None = None,
        check_later: bool = False,
    ) -> None:
        if fmt not in FORMATS or fmt == "tokenized":
            raise PackingError(
                f"format={fmt!r} cannot be tokenized; use one of {', '.join(FORMATS[:-1])}.", param="format"
            )
        self.tokenizer_dir = tokenizer_dir
        self.fmt = fmt
        self.add_eos = add_eos
        started = time.perf_counter()
        check_on_unencodable(on_unencodable)
        requested = fast_engine.check_engine(engine)
        #: why the tokenizers library cannot be the reference (:func:`~.reference.library_gap`: its Tokenizer
        #: lacks a method packtools calls), so that transformers is; None where it can (or is not asked to)
        self.reference_why: str | None = None
        self._tok: Any = None
        self.fingerprint = fp = tokenizer_fingerprint(tokenizer_dir)
        #: a small input the reference tokenizes alone (choose_engine); no fast engine is loaded
        self.small_input = (
            input_bytes
            if proven is None
            and not wait_for_engine
            and reference_suffices(tokenizer_dir, requested, input_bytes)
            else None
        )
        #: the first run's check of a provisional lite reference, started now (its child process imports
        #: transformers while the facts are read) and running while the data is staged (see
        #: :meth:`settle_reference`); None once settled, and where the reference is not provisional
        self._check: ReferenceCheck | None = (
            ReferenceCheck(tokenizer_dir, fp)
            if check_later and self._checks_later(requested, proven)
            else None
        )
        try:  # the started child waits for its texts: a load failing before they are handed over stops it
            self._facts = facts = load_facts(tokenizer_dir, fp)
            #: tokens transformers adds that tokenizer.json lacks (:func:`.folder.added_tokens_outside`): then
            #: transformers itself tokenizes (choose_engine says why)
            self.added_outside = (
                added_tokens_outside(tokenizer_dir, facts.specials) if facts is not None else []
            )
            adopted = proven.get("engine") if proven is not None else None
            skip = adopted == "transformers" or self.small_input is not None or bool(self.added_outside)
            self._fast_load = start_fast_load(
                tokenizer_dir, fp, facts, fmt, "transformers" if skip else requested
            )
            # asked once the fast engine's load has started: the library imported before that load starts made
            # it ~0.3 s slower beside the reference's load (warm runs, Llama 3, measured)
            self.reference_why = reference.library_gap() if requested != "transformers" else None
            copy = compact_file(fp)
            # transformers' ids from the tokenizers library alone where a recorded check says they are the same
            # (reference.load_verified): never when transformers is asked for or adds tokens tokenizer.json lacks
            lite = (
                reference.load_verified(tokenizer_dir, fp, copy)
                if requested != "transformers" and not self.added_outside and self.reference_why is None
                else None
            )
            if self._check is not None:
                lite = self._provisional(copy)
        except BaseException:
            if self._check is not None:
                self._check.cancel()
            raise
        #: what the reference was loaded from: tokenizer.json, its copy recorded identical, or transformers
        self.reference_source = lite.source if lite is not None else "transformers"
        if lite is not None:  # (always so while a check runs: _provisional stops the check without one)
            backend, self.eos_id = lite.backend, lite.eos_id
            self.reference_engine = PROVISIONAL_REFERENCE if self._check is not None else CHECKED_REFERENCE
        else:
            backend, self.eos_id = self.tok.backend_tokenizer, self.tok.eos_token_id
            self.reference_engine = "transformers"
        self.backend = backend  # the reference tokenizer (offsets of chat tokens: packtools.pipeline.tokenizer.chat.tokens)
        self._encode_batch = reference.batch_encoder(backend)
        self.wait_for_engine = wait_for_engine
        # the engine's state: assigned only by its transitions (class docstring)
        self._fast: fast_engine.FastEncoder | None = None
        self._pending: FastLoad | None = None  # the fast engine still loading (take_pending)
        self._reference_batch_done = False  # the one batch the reference tokenizes while the engine loads
        self.proof_recorded = False  # the adversarial set's verdict was a recorded one (proof_cache)
        self.fast_source: str | None = None  # what the fast engine loads: "compact" copy or "tokenizer.json"
        self.proof = Proof(audit_rate)
        self.chat_seconds = {"render": 0.0, "encode": 0.0, "masks": 0.0}  # the fast chat path's time, by step
        self.drops = (
            DropCounter(facts.missing, facts.specials, on_unencodable)
            if facts is not None and facts.missing
            else None
        )
        if lite is None and facts is not None and not self.added_outside and self.reference_why is None:
            reference.record(tokenizer_dir, fp, self.tok, adversarial.adversarial_texts(facts.specials), copy)
        self.chat = chat.ChatTokens(self, requested)  # the chat formats (renderer chosen on first use)
        loaded = time.perf_counter()
        self._choose(requested, facts, proven)
        #: seconds spent loading the reference (or transformers) and tokenizer facts; choosing/proving the engine
        self.seconds = {"load_s": loaded - started, "proof_s": time.perf_counter() - loaded}

    def _checks_later(self, requested: str, proven: dict[str, Any] | None) -> bool:
        """Whether this (driver's) tokenizer may stage on a provisional reference while it is checked: plain
        text, an engine other than transformers asked for, no engine handed down, an input large enough for the
        fast engine (a small one the reference alone tokenizes), no verdict recorded for this tokenizer and these
        versions, and transformers not imported here yet (:func:`~.reference_check.child_pays`).
        (:meth:`_provisional` gives the check up where tokenizer.json's facts rule it out, or the library cannot
        be the reference: :attr:`reference_why`.)"""
        return (
            self.fmt == "text"
            and requested != "transformers"
            and proven is None
            and self.small_input is None
            and reference.unchecked(self.fingerprint)
            and reference_check.child_pays()
        )

    def _provisional(self, copy: str | None) -> reference.LiteReference | None:
        """The lite reference of the folder's own tokenizer.json, handed to the started check
        (:class:`~packtools.pipeline.tokenizer.reference_check.ReferenceCheck`); None, with the check stopped, where
        the facts rule the fast path out (transformers then loads here, as without a check: no facts, or tokens
        transformers adds that tokenizer.json lacks) or the library cannot load it (:attr:`reference_why`, or
        its load fails)."""
        check = self._check
        assert check is not None
        lite = None
        if self._facts is not None and not self.added_outside and self.reference_why is None:
            try:
                lite = reference.LiteReference(self.tokenizer_dir)
            except Exception:  # noqa: BLE001 - transformers says why, or tokenizes
                lite = None
        if lite is None:
            check.cancel()
            self._check = None
            return None
        # tokenizer.json's parse for its facts and the compact copy is freed by now: handed back before the
        # child's transformers load and the stage, which it would otherwise sit beside (~150 MB, Llama 3)
        give_back_freed_memory()
        check.start(lite, adversarial.adversarial_texts(self._facts.specials), copy)
        return lite

    @property
    def reference_check(self) -> ReferenceCheck | None:
        """The check of a provisional reference still to be settled (:meth:`settle_reference`), or None."""
        return self._check

    def settle_reference(self, on_difference: Callable[[str], None]) -> str | None:
        """Wait for the check of a provisional reference (:meth:`reference_check`; None: nothing to settle).
        Where the lite reference gave transformers' ids it is recorded so (with the adversarial verdicts that
        rested on it, :attr:`ReferenceCheck.on_pass`) and stays the reference; returns None.  Where it differs,
        transformers becomes the reference and no engine other than transformers tokenizes from here on;
        ``on_difference(why)`` is called (the driver drops what was staged on it) before the difference is
        recorded; returns ``why``.  A failed load of transformers raises here, and nothing is recorded."""
        check = self._check
        if check is None:
            return None
        difference = check.result()
        self._check = None
        if difference is None:
            check.record_finding()
            for write in check.on_pass:
                write()
            self.reference_engine = CHECKED_REFERENCE
            return None
        why = (
            f"the tokenizers library differed from transformers on the built-in adversarial set ({difference}): "
            f"transformers is the reference, and tokenizes every part"
        )
        self._tok = check.transformers()  # where the driver checked by itself; else loaded by self.tok
        self.backend = self.tok.backend_tokenizer
        self._encode_batch = reference.batch_encoder(self.backend)
        self.eos_id = self.tok.eos_token_id
        self.reference_engine = self.reference_source = "transformers"
        self._fast = self._pending = self._fast_load = None
        self._report = fast_engine.EngineReport("transformers", f"fallback: {why}", self._report.requested)
        self._loaded = (self._report, None)
        on_difference(why)
        check.record_finding()
        return why

    @property
    def tok(self) -> Any:
        """The transformers tokenizer, loaded on first use (chat templates need it; plain text may not)."""
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_dir)
            # One call through transformers puts the Rust backend in the state its __call__ uses (no truncation,
            # no padding, special-token handling); plain encodings then go to the backend directly, which skips
            # transformers' per-row Python conversion (the ids are the same).
            self._tok(["x"], add_special_tokens=True)
        return self._tok

    # -- the engine: its state and every change of it ------------------------------------------------
    @property
    def fast(self) -> fast_engine.FastEncoder | None:
        """The fast engine tokenizing this part's batches, or None (transformers' ids: the reference)."""
        return self._fast

    @property
    def report(self) -> fast_engine.EngineReport:
        """Which engine tokenizes, and why (:meth:`part_report` adds what this part compared)."""
        return self._report

    @property
    def pending(self) -> FastLoad | None:
        """The fast engine's background load, to be taken at a batch once it has finished (:meth:`take_pending`)."""
        return self._pending

    @property
    def background_load(self) -> FastLoad | None:
        """The fast engine's load started with this tokenizer and not taken yet (:meth:`load_fast` takes it)."""
        return self._fast_load

    def _choose(self, requested: str, facts: Any, proven: dict[str, Any] | None) -> None:
        """At load: the driver's choice ``proven`` taken as it is (a worker), else the engine chosen on the
        adversarial set (:func:`~packtools.pipeline.tokenizer.proof.choose_engine`); each part without a verdict
        starts from it."""
        choice = adopt(self, proven) if proven is not None else choose_engine(self, requested, facts)
        self._report, self._fast, self._pending = choice.report, choice.fast, choice.pending
        self.proof_recorded = choice.recorded
        if choice.source is not None:
            self.fast_source = choice.source
        self._fast_load = None
        self._loaded = (self._report, self._fast)  # each part without a verdict starts from this engine

    def load_fast(self) -> fast_engine.FastEncoder:
        """The fast engine, loaded now: from the background load started with this tokenizer (taken once: the
        encoder holds it from here on), else from its tokenizer.json.  It does not tokenize until a transition
        makes it the engine."""
        load, self._fast_load = self._fast_load, None
        native = load.result() if load is not None else None
        self.fast_source = load.source if load is not None else "tokenizer.json"
        return fast_engine.FastEncoder(self.tokenizer_dir, facts=self._facts, native=native)

    @contextlib.contextmanager
    def trying(self, fast: fast_engine.FastEncoder) -> Iterator[None]:
        """The engine is ``fast`` inside the block only (the adversarial conversations are compared on it)."""
        before, self._fast = self._fast, fast
        try:
            yield
        finally:
            self._fast = before

    def take_pending(self) -> None:
        """At a batch, while the fast engine's load that :func:`~packtools.pipeline.tokenizer.proof.choose_engine`
        left running (``wait_for_engine=False``) is pending: the engine becomes the fast one once its load has
        finished, and the per-part proof then compares the first rows *it* tokenizes.  The first batch, if the
        load is still running, goes to the reference (counted in ``batches_on_transformers``, with the reason);
        a later batch waits for the load.  A failed load falls back to transformers for the run, saying why."""
        load = self._pending
        if load is None:
            return
        if not load.done() and not self._reference_batch_done:
            # the first batch only: the reference is several times slower than the engine and, on a busy
            # machine, slows the load it waits for; later batches wait for the load (a one-batch run never does)
            self._reference_batch_done = True
            self.proof.to_transformers(
                "the fast engine was still loading its vocabulary (the reference tokenized it)"
            )
            return
        self._pending = None
        try:
            fast = fast_engine.FastEncoder(self.tokenizer_dir, facts=self._facts, native=load.result())
        except (OSError, ValueError, RuntimeError) as exc:
            self._report = fast_engine.EngineReport(
                "transformers", f"fallback: the fast engine cannot load its tokenizer.json ({exc})", "auto"
            )
            self._loaded = (self._report, None)
            return
        self._fast = fast
        self._loaded = (self._report, fast)

    def wait_for_fast(self) -> None:
        """Take the fast engine now if it is still loading (the driver's proof compares its ids, not the
        reference's)."""
        if self._pending is not None:
            self._reference_batch_done = True  # take_pending then waits for the load
            self.take_pending()

    # -- per part ----------------------------------------------------------------------------------
    def start_part(self, seed: str, verdict: dict[str, Any] | None = None) -> None:
        """A new part (a unit of work with its own report, its audit seeded by ``seed``).  ``verdict``: the
        run's engine, decided once by the driver (:mod:`packtools.pipeline.tokenizer.verdict`, an
        :meth:`EngineReport.to_dict`): the part is tokenized with exactly that engine, audited, and has no proof
        rows of its own.  None (a :class:`BatchTokenizer` used directly): the part starts from the engine chosen
        at load and proves it on its first rows of each column (a difference there falls back, ``auto``)."""
        if verdict is None:
            self._report, self._fast = self._loaded
        else:
            report = fast_engine.EngineReport.from_dict(verdict)
            if report.engine == "transformers":
                self._pending, self._fast = None, None  # a load still running is never taken
            elif self._pending is None:
                fast = self._loaded[1] or self._fast
                self._fast = fast if fast is not None else self.load_fast()
            self._report = report
        self.proof.start_part(seed, proves=verdict is None)
        if self.drops is not None:
            self.drops.take()

    def part_report(self) -> dict[str, Any]:
        """The engine report of the part since :meth:`start_part`: engine, reason, rows compared, characters left out."""
        out = self.report.to_dict()
        out["checked"] = {**out["checked"], **self.proof.checked()}
        why = self.proof.why_transformers
        if why is not None:
            out["batches_on_transformers_why"] = why
            if not self.proof.batches_fast and out["engine"] != "transformers":
                # not a batch of this part reached the fast engine: the part is transformers' (its ids were)
                out.update(engine="transformers", reason=f"every batch of this part: {why}")
        dropped = self.drops.take() if self.drops is not None else None
        if dropped is not None:
            out["unencodable"] = dropped
        if self.chat.render_engine:  # which renderer ran the chat template, and why
            out["chat_render"] = self.chat.render_engine
        return out

    def reference_ids(self, texts: list[str], special: bool) -> list[list[int]]:
        """transformers' ids of ``texts`` (its Rust backend, as ``tokenizer(texts)`` gives them)."""
        return [e.ids for e in self._encode_batch(texts, add_special_tokens=special)]

    def _disagree(self, what: str, initial: bool, first_row: Row) -> None:
        """The fast engine gave other tokens than transformers: fall back (a proof row, auto) or stop; an
        audited row raises :class:`~packtools.pipeline.tokenizer.proof.EngineDivergence`, on which the pipeline's
        driver restages the run's fast-engine parts (auto)."""
        if initial and self.report.requested == "auto":  # transformers tokenizes the rest of the part
            self._fast = None
            self._report = fast_engine.EngineReport(
                "transformers",
                f"fallback: the fast engine differed from transformers on the data ({what})",
                "auto",
                dict(self._report.checked),
            )
            return
        message = (
            f"{at(first_row)}: the fast tokenizer engine gave other tokens than transformers ({what}); "
            f"no output was written from it. Rerun with tokenizer_engine='transformers'."
        )
        if initial:
            raise PackingError(message, param="tokenizer_engine")
        raise EngineDivergence(message, f"{at(first_row)}: {what}")

    # -- building blocks -------------------------------------------------------------------------
    def encode(self, texts: list[str], special: bool, first_row: Row = 0, column: str = "text") -> Ragged:
        if self._pending is not None:
            self.take_pending()  # the reference tokenizes until the fast engine has loaded
        if self.drops is not None:
            self.drops.scan(texts, lambda i: at(first_row, i) + f" (column {column!r})")
        if self.fast is not None:
            try:
                got = self.fast.encode(texts, special)
            except Exception as exc:  # noqa: BLE001 - e.g. a regex limit on a pathological row
                engine_error(self, exc, texts, special, first_row)
                return ragged.from_lists(self.reference_ids(texts, special))
            rows, proof = self.proof.sample(column, len(texts))
            ref = self.reference_ids([texts[i] for i in rows], special)
            bad = fast_engine.first_difference(ragged.select(got, rows), ref)
            if bad is None:
                self.proof.count(column, len(rows), proof)
                self.proof.batches_fast += 1
                return got
            i = int(rows[bad])
            self._disagree(
                fast_engine.describe_difference(
                    texts, i, got.values[got.offsets[i] : got.offsets[i + 1]].tolist(), ref[bad]
                ),
                bad < proof,
                shift(first_row, i),
            )
        return ragged.from_lists(self.reference_ids(texts, special))

    def _eos_id(self) -> int:
        if self.eos_id is None:
            raise PackingError(
                f"the tokenizer in {self.tokenizer_dir!r} has no eos_token, so none can end each sequence; "
                f"set eos_token in its tokenizer_config.json or pass add_eos=False.",
                param="tokenizer",
            )
        return int(self.eos_id)

    def _with_eos(self, r: Ragged) -> Ragged:
        """Append EOS to every row that does not already end with it."""
        if not self.add_eos:
            return r
        eos = self._eos_id()
        ends = r.values[np.maximum(r.offsets[1:] - 1, 0)] if r.values.size else np.zeros(r.num_rows, np.int64)
        return ragged.append_to_rows(r, eos, (r.lengths == 0) | (ends != eos))

    def _prompt_and_completions(self, table: pa.Table, names: Sequence[str], first_row: Row) -> list[Ragged]:
        """Tokenized prompt (first) and completions (the others) of prompt-completion or preference rows."""
        prompts = cells(table, "prompt")
        if prompts and isinstance(prompts[0], list):
            return self.chat.prompt_and_completions(table, prompts, names, first_row)
        parts = [self.encode(_strings(table, "prompt", first_row, prompts), True, first_row, "prompt")]
        for name in names:
            done = self.encode(_strings(table, name, first_row), False, first_row, name)
            parts.append(self._with_eos(done))  # as TRL's add_eos: not after a completion that ends with it
        return parts

    # -- entry point -----------------------------------------------------------------------------
    def __call__(self, table: pa.Table, first_row: Row = 0) -> pa.Table:
        """Tokenize one batch; ``first_row`` (the batch's first row number, or a callable naming row ``i`` as
        :class:`packtools.io.files.Where` does) locates bad rows in errors.  An exception raised by the
        tokenizer or its chat template is turned into a :class:`PackingError` naming the first row that raises it."""
        try:
            if "tools" in table.column_names:
                return by_tools(self, table, first_row)
            return self.tokenize_rows(table, first_row)
        except PackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error: find the row that raises it
            raise self._row_error(self, table, first_row, exc) from exc

    @staticmethod
    def _row_error(fn: Any, table: pa.Table, first_row: Row, exc: Exception) -> PackingError:
        """The error of the first row of ``table`` on which ``fn(row, first_row)`` raises (raised from that
        call), else the batch's own: ``exc``, said to come from the tokenizer or its chat template."""
        if table.num_rows > 1:
            for i in range(table.num_rows):
                fn(table.slice(i, 1), shift(first_row, i))
        return PackingError(
            f"{at(first_row)}: tokenizing failed in the tokenizer or its chat template "
            f"({type(exc).__name__}: {exc}); fix that row or the template."
        )

    # -- rendering ahead (chat) ---------------------------------------------------------------------
    def engine_loading(self) -> bool:
        """Whether the fast engine is still loading in the background (the pipeline's first batches)."""
        return self._pending is not None and not self._pending.done()

    def prepare(self, table: pa.Table, first_row: Row = 0) -> tuple[Any, ...]:
        """The Python half of a batch, done now so that :meth:`finish` needs only the tokenizer: ``text`` rows
        as Python strings (the pipeline's reader thread does this while the engine encodes the batch before),
        ``messages`` conversations read, checked and rendered (the pipeline renders batches while the fast
        engine loads).  Other formats are left whole to :meth:`finish`; a bad row or a template error is
        raised here, naming the row, as a call raises it."""
        if self.fmt == "text" and "text" in table.column_names:
            return table, first_row, ("text", _strings(table, "text", first_row))
        if self.fmt != "messages" or "messages" not in table.column_names or "tools" in table.column_names:
            return table, first_row, None
        try:
            convs = self._conversations(table, first_row)
            return table, first_row, ("messages", convs, self.chat.render_ahead(convs, first_row))
        except PackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error: find the row that raises it
            raise self._row_error(self.prepare, table, first_row, exc) from exc

    def finish(self, prepared: tuple[Any, ...]) -> pa.Table:
        """The token table of a :meth:`prepare`-d batch: the same as calling this tokenizer on it."""
        table, first_row, ready = prepared
        if ready is None:
            return self(table, first_row)
        try:
            if ready[0] == "text":
                return self._text_table(ready[1], first_row)
            return self._messages_table(ready[1], first_row, ready[2])
        except PackingError:
            raise
        except Exception:  # noqa: BLE001 - the call finds the row that raises
            return self(table, first_row)

    def _text_table(self, texts: list[str], first_row: Row) -> pa.Table:
        """The ``input_ids`` of ``text`` rows: the tokenizer's special tokens, then EOS unless already there."""
        ids = self._with_eos(self.encode(texts, special=True, first_row=first_row))
        return pa.table({"input_ids": ragged.to_arrow(ids)})

    def _messages_table(
        self,
        convs: list[list[dict[str, Any]]],
        first_row: Row,
        rendered: tuple[list[str], list] | None = None,
    ) -> pa.Table:
        """The ``input_ids`` and assistant-only ``labels`` of conversations (``rendered``: taken ahead), and each
        one's head (:mod:`packtools.pipeline.tokenizer.chat.head`; the stage keeps it in its sidecar)."""
        ids, labels = self.chat.assistant_labels(convs, first_row, rendered)
        heads = chat_head.head_lengths(self.chat.renderer, self._encode_plain, convs, ids)
        table = pa.table(
            {
                "input_ids": ragged.to_arrow(ids),
                "labels": ragged.to_arrow(labels),
                chat_head.HEAD_COLUMN: pa.array(heads),
            }
        )
        meta = {}
        if self.chat.has_generation_tags:  # spans end before the closing text: the stage records it
            if getattr(self, "_closing", None) is None:
                self._closing = chat_head.closing_ids(self.chat.renderer, self._encode_plain)
            meta[chat_head.CLOSING_KEY] = ",".join(map(str, self._closing)).encode()
        # a tool result stays with its call: the stage records it
        if getattr(self, "_tool_opener", None) is None:
            self._tool_opener = chat_head.tool_opener_ids(self.chat.renderer, self._encode_plain)
        meta[chat_head.TOOL_OPENER_KEY] = ",".join(map(str, self._tool_opener)).encode()
        return table.replace_schema_metadata(meta)

    def _encode_plain(self, texts: list[str]) -> Ragged:
        """``texts`` encoded as a rendered conversation is, without the proof's bookkeeping (chat.head keeps an
        encoding only where it starts the conversation's proven ids)."""
        if self.fast is not None:
            with contextlib.suppress(Exception):  # an engine error: the reference encodes them
                return self.fast.encode(texts, False)
        return ragged.from_lists(self.reference_ids(texts, False))

    def _conversations(self, table: pa.Table, first_row: Row) -> list[list[dict[str, Any]]]:
        convs = [
            chat.clean_messages(c, "messages", shift(first_row, i))
            for i, c in enumerate(cells(table, "messages"))
        ]
        self.chat.refuse_printed_parts(convs, lambda i: at(first_row, i), "messages")
        return convs

    def tokenize_rows(self, table: pa.Table, first_row: Row) -> pa.Table:
        """The token table of a batch without a ``tools`` column (:func:`by_tools` splits by it)."""
        missing = [c for c in input_columns(self.fmt) if c not in table.column_names]
        if missing:
            raise PackingError(
                f"format={self.fmt} needs columns {input_columns(self.fmt)}; the input lacks {missing} "
                f"(it has {table.column_names}).",
                param="format",
            )
        if self.fmt == "text":
            return self._text_table(_strings(table, "text", first_row), first_row)
        if self.fmt == "messages":
            return self._messages_table(self._conversations(table, first_row), first_row)
        if self.fmt == "prompt_completion":
            prompt, completion = self._prompt_and_completions(table, ["completion"], first_row)
            ids = ragged.join_rows([prompt, completion])
            labels = ragged.join_rows([ragged.full_like(prompt, IGNORE_INDEX), completion])
            return pa.table({"input_ids": ragged.to_arrow(ids), "labels": ragged.to_arrow(labels)})
        prompt, chosen, rejected = self._prompt_and_completions(table, ["chosen", "rejected"], first_row)
        return pa.table(
            {
                "prompt_input_ids": ragged.to_arrow(prompt),
                "chosen_input_ids": ragged.to_arrow(chosen),
                "rejected_input_ids": ragged.to_arrow(rejected),
            }
        )


# -- how a stage's batches reach a BatchTokenizer: raw text's Python half (BatchTokenizer.prepare) done in the reading
# thread; chat rendered while the fast engine still loads and finished by it once it has loaded --------------------
#: chat batches rendered while the fast engine loads (:func:`render_while_loading`), at most
AHEAD_BATCHES = 32


def prepared_batches(tok: Any, read: Any) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """``(where, tok.prepare(table, where))`` of every batch ``read`` gives (closing it when closed early)."""
    try:
        for where, table in read:
            yield where, tok.prepare(table, where)
    finally:
        read.close()


def called(tok: Any, batches: Iterator[tuple[Any, pa.Table]]) -> Iterator[tuple[Any, pa.Table]]:
    """``(where, tok(table, where))`` for every batch, in order."""
    for where, table in batches:
        yield where, tok(table, where)


def render_while_loading(tok: Any, batches: Iterator[tuple[Any, pa.Table]]) -> Iterator[tuple[Any, pa.Table]]:
    """``(where, tok(table, where))`` for every batch, in order; while the fast engine still loads, up to
    :data:`AHEAD_BATCHES` batches are rendered (:meth:`BatchTokenizer.prepare`, most of chat's Python work)
    and held, then finished by the engine once it has loaded, instead of the thread waiting for it.

    >>> class Tok:
    ...     loading = [True, True, False]
    ...     def engine_loading(self): return self.loading.pop(0) if self.loading else False
    ...     def prepare(self, table, where): return ("held", table)
    ...     def finish(self, prepared): return prepared[1] * 10
    ...     def __call__(self, table, where): return table * 10
    >>> list(render_while_loading(Tok(), iter([(0, 1), (1, 2), (2, 3), (3, 4)])))
    [(0, 10), (1, 20), (2, 30), (3, 40)]
    """
    held: collections.deque = collections.deque()
    for where, table in batches:
        if tok.engine_loading() and len(held) < AHEAD_BATCHES:
            held.append((where, tok.prepare(table, where)))
            continue
        while held:
            w, prepared = held.popleft()
            yield w, tok.finish(prepared)
        yield where, tok(table, where)
    while held:
        w, prepared = held.popleft()
        yield w, tok.finish(prepared)
