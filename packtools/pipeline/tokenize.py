"""Batched tokenization of raw rows into aligned Arrow token columns (extra ``packtools[hf]``).

Formats, and what each row becomes:

- ``text`` (column ``text``): ``input_ids`` = the tokenizer's encoding with its own special tokens (e.g. BOS),
  then ``eos_token`` appended unless the encoding already ends with it (``add_eos=False`` turns this off).
- ``prompt_completion`` (``prompt``, ``completion``): ``input_ids`` = prompt (with special tokens) + completion
  (without) + EOS; ``labels`` = ``-100`` on the prompt, the token ids on completion and EOS.  The two parts are
  tokenized separately, so the boundary is always a token boundary.  Conversational rows (lists of messages)
  go through the chat template: prompt rendered with ``add_generation_prompt=True``, completion = the rest of
  the full rendering; no EOS is added (the template closes the turn).
- ``messages`` (column ``messages``): the chat template renders the conversation; ``labels`` are the token ids
  on assistant turns only, ``-100`` elsewhere.  When the template marks assistant text with
  ``{% generation %}``, transformers' ``return_assistant_tokens_mask`` gives the mask.  Otherwise the mask comes
  from incremental rendering: assistant turn ``i`` covers the characters between the rendering of messages
  ``[:i]`` with the generation prompt and the rendering of messages ``[:i + 1]``; a token is an assistant token
  when it overlaps such a span (as with markers).  A template that does not render prefixes as prefixes of the whole (e.g. one
  that rewrites earlier turns) is refused with an error naming the row.
- ``preference`` (``prompt``, ``chosen``, ``rejected``): ``prompt_input_ids``, ``chosen_input_ids``,
  ``rejected_input_ids``, tokenized like prompt-completion (EOS after string completions); not packed.

Tokenization uses the fast tokenizer's batch API (Rust, multi-threaded); the pipeline can also spread batches
over processes (``--num-proc``).  With ``engine="auto"`` (the default) a byte-level BPE tokenizer is run by the
faster exact engine of :mod:`packtools.pipeline.fast_tokenize` once it has given the same ids (and assistant
masks) as transformers on a built-in adversarial set; :mod:`packtools.pipeline.engine_proof` compares it on the
first rows of each column of every part and on a random sample of the rest.  ``report`` says which engine ran
and why; characters the tokenizer cannot encode are counted (:mod:`packtools.pipeline.char_drops`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import require
from ..constants import IGNORE_INDEX, INPUT_FORMATS
from ..core import ragged
from ..core.ragged import Ragged
from ..errors import PackingError
from . import chat, engine_proof, reference
from . import fast_tokenize as fast_engine
from .char_drops import DropCounter, check_on_unencodable
from .engine_proof import Proof

FORMATS = INPUT_FORMATS


Row = Any  # a row number, or a callable naming row i of a block (packtools.io.files.Where)


def shift(first_row: Row, i: int) -> Row:
    """Row ``i`` of a block that starts at ``first_row``."""
    if callable(first_row):
        return lambda j=0: first_row(i + j)
    return first_row + i


def at(first_row: Row, i: int = 0) -> str:
    """Where row ``i`` of a block is, for error messages: ``input 'f.jsonl' line 7`` or ``row 7``."""
    return first_row(i) if callable(first_row) else f"row {first_row + i}"


def detect_format(columns: Sequence[str]) -> str:
    """Guess the format from column names.

    >>> detect_format(["prompt", "chosen", "rejected"]), detect_format(["text", "id"])
    ('preference', 'text')
    """
    names = set(columns)
    if {"prompt", "chosen", "rejected"} <= names:
        return "preference"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "messages" in names:
        return "messages"
    if "input_ids" in names:
        return "tokenized"
    if "text" in names:
        return "text"
    raise PackingError(
        f"cannot tell the data format from the columns {sorted(names)}; expected 'text', 'prompt'+'completion', "
        f"'messages', 'prompt'+'chosen'+'rejected' or 'input_ids'. Pass format={{{','.join(FORMATS)}}}.",
        param="format",
    )


def output_columns(fmt: str) -> list[str]:
    """The token columns that tokenizing ``fmt`` produces."""
    if fmt == "text":
        return ["input_ids"]
    if fmt == "preference":
        return ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    return ["input_ids", "labels"]


def input_columns(fmt: str) -> list[str]:
    return {
        "text": ["text"],
        "prompt_completion": ["prompt", "completion"],
        "messages": ["messages"],
        "preference": ["prompt", "chosen", "rejected"],
    }[fmt]


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
#: Tokenizer files larger than this are fingerprinted by size and mtime instead of content.
HASH_LIMIT = 1 << 26


def tokenizer_files(path: str) -> list[str]:
    """The tokenizer files in folder ``path`` (see :data:`TOKENIZER_FILES`), sorted."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        names += sorted(os.path.join("additional_chat_templates", n) for n in os.listdir(extra))
    return sorted(names)


def check_tokenizer_dir(path: str | os.PathLike[str]) -> str:
    """``path`` as an absolute folder that holds tokenizer files, or an error that says what to pass."""
    path = os.path.abspath(os.fspath(path))
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


def tokenizer_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 over the tokenizer's own files (:func:`tokenizer_files`): names and contents, or for a file over
    :data:`HASH_LIMIT` bytes its size and mtime.  Model weights and other files in the folder are not read."""
    path = os.fspath(path)
    h = hashlib.sha256()
    for name in tokenizer_files(path):
        full = os.path.join(path, name)
        st = os.stat(full)
        h.update(name.encode() + b"\0")
        if st.st_size > HASH_LIMIT:
            h.update(f"size={st.st_size} mtime_ns={st.st_mtime_ns}".encode())
            continue
        with open(full, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _strings(table: pa.Table, name: str, first_row: Row, values: list | None = None) -> list[str]:
    values = table.column(name).to_pylist() if values is None else values
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise PackingError(
                f"{at(first_row, i)}: column {name!r} is {type(v).__name__}, not a string; fix or filter that row."
            )
    return values


class BatchTokenizer:
    """Turns a table of raw rows into token columns (see the module docstring for each format).

    Built from the tokenizer *directory*; worker processes build their own from the same arguments, with
    ``proven`` the driver's engine choice (:meth:`EngineReport.to_dict`), which they take without choosing again.
    ``on_unencodable``: ``report`` counts characters the tokenizer cannot encode (transformers leaves them out of
    the ids; see :mod:`packtools.pipeline.char_drops`), ``error`` stops at the first one.
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
        self._tok: Any = None
        self.fingerprint = fp = tokenizer_fingerprint(tokenizer_dir)
        # transformers' ids from the tokenizers library alone where a recorded check says they are the same
        # (packtools.pipeline.reference): importing transformers costs seconds a run
        lite = reference.load_verified(tokenizer_dir, fp)
        if lite is not None:
            backend, self.eos_id = lite.backend, lite.eos_id
            self.reference_engine = "tokenizers (checked equal to transformers)"
        else:
            backend, self.eos_id = self.tok.backend_tokenizer, self.tok.eos_token_id
            self.reference_engine = "transformers"
        self.backend = backend  # the reference tokenizer (offsets of chat tokens: packtools.pipeline.chat)
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.fast: fast_engine.FastEncoder | None = None
        self.proof_recorded = False  # the adversarial set's verdict was a recorded one (proof_cache)
        self.proof = Proof(audit_rate)
        self.chat_seconds = {"render": 0.0, "encode": 0.0, "masks": 0.0}  # the fast chat path's time, by step
        try:
            spec: dict[str, Any] | None = fast_engine.read_spec(tokenizer_dir)
        except (OSError, ValueError):
            spec = None
        self.drops = DropCounter.from_spec(spec, on_unencodable) if spec is not None else None
        if lite is None and spec is not None:
            specials = [a.get("content", "") for a in spec.get("added_tokens", [])]
            reference.record(tokenizer_dir, fp, self.tok, fast_engine.adversarial_texts(specials))
        requested = fast_engine.check_engine(engine)
        self.chat = chat.ChatTokens(self, requested)  # the chat formats (renderer chosen on first use)
        loaded = time.perf_counter()
        if proven is not None:
            self.report = engine_proof.adopt(self, proven, spec)
        else:
            self.report = engine_proof.choose_engine(self, requested, spec)
        del spec
        self._chosen = (self.report, self.fast)  # each part starts from the engine chosen here
        #: seconds spent loading the tokenizer (transformers, its tokenizer.json, the fast engine) and proving it
        self.seconds = {"load_s": loaded - started, "proof_s": time.perf_counter() - loaded}

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

    @property
    def has_generation_tags(self) -> bool:
        """Whether the chat template marks assistant text with ``{% generation %}`` (:mod:`.chat`)."""
        return self.chat.has_generation_tags

    # -- per part ----------------------------------------------------------------------------------
    def start_part(self, seed: str) -> None:
        """A new part (a unit of work with its own report): the engine chosen at load (a fallback on an earlier
        part's data is that part's), and the proof starts again for every column."""
        self.report, self.fast = self._chosen
        self.proof.start_part(seed)
        if self.drops is not None:
            self.drops.take()

    def part_report(self) -> dict[str, Any]:
        """The engine report of the part since :meth:`start_part`: engine, reason, rows compared, characters left out."""
        out = self.report.to_dict()
        out["checked"] = {**out["checked"], **self.proof.checked()}
        if self.proof.why_transformers is not None:
            out["batches_on_transformers_why"] = self.proof.why_transformers
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
        """The fast engine gave other tokens than transformers: fall back (initial proof, auto) or stop."""
        if initial and self.report.requested == "auto":
            self.fast = None
            self.report = fast_engine.EngineReport(
                "transformers",
                f"fallback: the fast engine differed from transformers on the data ({what})",
                "auto",
                dict(self.report.checked),
            )
            return
        raise PackingError(
            f"{at(first_row)}: the fast tokenizer engine gave other tokens than transformers ({what}); "
            f"no output was written from it. Rerun with tokenizer_engine='transformers'.",
            param="tokenizer_engine",
        )

    def _engine_error(self, exc: Exception, texts: list[str], special: bool, first_row: Row) -> None:
        """The fast engine raised on a batch: transformers tokenizes it (auto), or stop naming the row (fast)."""
        if self.report.requested != "fast":
            self.proof.to_transformers(f"{at(first_row)}: the fast engine raised {type(exc).__name__}: {exc}")
            return
        row = 0
        for i, text in enumerate(texts):
            try:
                self.fast.encode([text], special)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - this is the row
                row = i
                break
        raise PackingError(
            f"{at(first_row, row)}: the fast tokenizer engine cannot encode this text ({type(exc).__name__}: "
            f"{exc}); transformers can: rerun with tokenizer_engine='auto' or 'transformers'.",
            param="tokenizer_engine",
        ) from exc

    # -- building blocks -------------------------------------------------------------------------
    def encode(self, texts: list[str], special: bool, first_row: Row = 0, column: str = "text") -> Ragged:
        if self.drops is not None:
            self.drops.scan(texts, lambda i: at(first_row, i) + f" (column {column!r})")
        if self.fast is not None:
            try:
                got = self.fast.encode(texts, special)
            except Exception as exc:  # noqa: BLE001 - e.g. a regex limit on a pathological row
                self._engine_error(exc, texts, special, first_row)
                return ragged.from_lists(self.reference_ids(texts, special))
            rows, proof = self.proof.sample(column, len(texts))
            ref = self.reference_ids([texts[i] for i in rows], special)
            bad = fast_engine.first_difference(ragged.select(got, rows), ref)
            if bad is None:
                self.proof.count(column, len(rows), proof)
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

    def _eos_rows(self, n: int) -> Ragged:
        if self.eos_id is None:
            raise PackingError(
                f"the tokenizer in {self.tokenizer_dir!r} has no eos_token, so none can end each sequence; "
                f"set eos_token in its tokenizer_config.json or pass add_eos=False.",
                param="tokenizer",
            )
        return ragged.constant_rows(n, self.eos_id)

    def _with_eos(self, r: Ragged) -> Ragged:
        """Append EOS to every row that does not already end with it."""
        if not self.add_eos:
            return r
        eos = self._eos_rows(r.num_rows)
        lengths = r.lengths
        ends = r.values[np.maximum(r.offsets[1:] - 1, 0)] if r.values.size else np.zeros(r.num_rows, np.int64)
        needs = (lengths == 0) | (ends != self.eos_id)
        eos = ragged.from_lengths(needs.astype(np.int64), eos.values[needs])
        return ragged.join_rows([r, eos])

    def _prompt_and_completions(self, table: pa.Table, names: Sequence[str], first_row: Row) -> list[Ragged]:
        """Tokenized prompt (first) and completions (the others) of prompt-completion or preference rows."""
        prompts = table.column("prompt").to_pylist()
        if prompts and isinstance(prompts[0], list):  # conversational rows (packtools.pipeline.chat)
            return self.chat.prompt_and_completions(table, prompts, names, first_row)
        parts = [self.encode(_strings(table, "prompt", first_row, prompts), True, first_row, "prompt")]
        for name in names:
            done = self.encode(_strings(table, name, first_row), False, first_row, name)
            parts.append(ragged.join_rows([done, self._eos_rows(done.num_rows)]) if self.add_eos else done)
        return parts

    def compare_labels(self, convs: list, rows: Sequence[int], first_row: Row) -> tuple[int, str] | None:
        """Where the fast chat path first differs from the reference on ``rows`` of ``convs`` (:mod:`.chat`)."""
        return self.chat.compare_labels(convs, rows, first_row)

    # -- entry point -----------------------------------------------------------------------------
    def __call__(self, table: pa.Table, first_row: Row = 0) -> pa.Table:
        """Tokenize one batch; ``first_row`` (the batch's first row number, or a callable naming row ``i`` as
        :class:`packtools.io.files.Where` does) locates bad rows in errors.  An exception raised by the
        tokenizer or its chat template is turned into a :class:`PackingError` naming the first row that raises it."""
        try:
            return self._tokenize(table, first_row)
        except PackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error: find the row that raises it
            if table.num_rows > 1:
                for i in range(table.num_rows):
                    self(table.slice(i, 1), shift(first_row, i))
            raise PackingError(
                f"{at(first_row)}: tokenizing failed in the tokenizer or its chat template "
                f"({type(exc).__name__}: {exc}); fix that row or the template."
            ) from exc

    def _tokenize(self, table: pa.Table, first_row: Row) -> pa.Table:
        missing = [c for c in input_columns(self.fmt) if c not in table.column_names]
        if missing:
            raise PackingError(
                f"format={self.fmt} needs columns {input_columns(self.fmt)}; the input lacks {missing} "
                f"(it has {table.column_names}).",
                param="format",
            )
        if self.fmt == "text":
            ids = self._with_eos(
                self.encode(_strings(table, "text", first_row), special=True, first_row=first_row)
            )
            return pa.table({"input_ids": ragged.to_arrow(ids)})
        if self.fmt == "messages":
            convs = [
                chat.clean_messages(c, "messages", shift(first_row, i))
                for i, c in enumerate(table.column("messages").to_pylist())
            ]
            ids, labels = self.chat.assistant_labels(convs, first_row)
            return pa.table({"input_ids": ragged.to_arrow(ids), "labels": ragged.to_arrow(labels)})
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
