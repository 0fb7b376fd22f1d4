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
  when it starts in such a span.  A template that does not render prefixes as prefixes of the whole (e.g. one
  that rewrites earlier turns) is refused with an error naming the row.
- ``preference`` (``prompt``, ``chosen``, ``rejected``): ``prompt_input_ids``, ``chosen_input_ids``,
  ``rejected_input_ids``, tokenized like prompt-completion (EOS after string completions); not packed.

Tokenization uses the fast tokenizer's batch API (Rust, multi-threaded); the pipeline can also spread batches
over processes (``--num-proc``).  With ``engine="auto"`` (the default) a byte-level BPE tokenizer is run by the
faster exact engine of :mod:`packtools.pipeline.fast_tokenize` once it has given the same ids (and assistant
masks) as transformers on a built-in adversarial set and on the first rows of the data; a sample of every later
batch is compared too.  ``report`` says which engine ran and why.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .._optional import require
from ..constants import IGNORE_INDEX, INPUT_FORMATS
from ..core import ragged
from ..core.ragged import Ragged
from ..errors import PackingError
from . import fast_tokenize as fast_engine

FORMATS = INPUT_FORMATS
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


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


def _strings(table: pa.Table, name: str, first_row: Row) -> list[str]:
    values = table.column(name).to_pylist()
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise PackingError(
                f"{at(first_row, i)}: column {name!r} is {type(v).__name__}, not a string; fix or filter that row."
            )
    return values


def _clean_messages(conv: Any, name: str, row: Row) -> list[dict[str, Any]]:
    if not isinstance(conv, list) or not all(isinstance(m, dict) and m.get("role") is not None for m in conv):
        raise PackingError(  # Arrow gives a message's missing "role" as None: that is a missing role too
            f"{at(row)}: column {name!r} is not a list of messages ({{'role': ..., 'content': ...}}, every "
            f"message with a role); fix that row."
        )
    return [{k: v for k, v in m.items() if v is not None} for m in conv]


class BatchTokenizer:
    """Turns a table of raw rows into token columns (see the module docstring for each format).

    Built from the tokenizer *directory*; worker processes build their own from the same arguments.
    """

    def __init__(self, tokenizer_dir: str, fmt: str, add_eos: bool = True, engine: str = "auto") -> None:
        if fmt not in FORMATS or fmt == "tokenized":
            raise PackingError(
                f"format={fmt!r} cannot be tokenized; use one of {', '.join(FORMATS[:-1])}.", param="format"
            )
        self.tokenizer_dir = tokenizer_dir
        self.fmt = fmt
        self.add_eos = add_eos
        self.tok = load_tokenizer(tokenizer_dir)
        self.eos_id = self.tok.eos_token_id
        # One call through transformers puts the Rust backend in the state its __call__ uses (no truncation,
        # no padding, special-token handling); plain encodings then go to the backend directly, which skips
        # transformers' per-row Python conversion (the ids are the same).
        self.tok(["x"], add_special_tokens=True)
        backend = self.tok.backend_tokenizer
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        template = self.tok.chat_template if isinstance(self.tok.chat_template, str) else None
        self.has_generation_tags = bool(template and _GENERATION_TAG.search(template))
        self.fast: fast_engine.FastEncoder | None = None
        # rows of the data still to compare with transformers before the fast engine is trusted
        self._proof_rows = fast_engine.PROOF_ROWS
        self._audit_phase = 0
        self.report = self._choose_engine(fast_engine.check_engine(engine))

    # -- engine choice and proof -----------------------------------------------------------------
    def _choose_engine(self, requested: str) -> fast_engine.EngineReport:
        """The fast engine when it is installed, applies and passes the adversarial set; else transformers."""

        def refuse(why: str) -> fast_engine.EngineReport:
            if requested == "fast":
                raise PackingError(
                    f"tokenizer_engine='fast' cannot tokenize with {self.tokenizer_dir!r}: {why}; use "
                    f"tokenizer_engine='auto' (falls back to transformers) or 'transformers'.",
                    param="tokenizer_engine",
                )
            return fast_engine.EngineReport("transformers", why, requested)

        if requested == "transformers":
            return fast_engine.EngineReport(
                "transformers", "requested (tokenizer_engine='transformers')", requested
            )
        version = fast_engine.engine_version()
        if version is None:
            return refuse("the fast engine is not installed (pip install 'packtools[fast]')")
        try:
            spec = fast_engine.read_spec(self.tokenizer_dir)
        except (OSError, ValueError) as exc:
            return refuse(f"its tokenizer.json cannot be read ({exc})")
        why = fast_engine.refusal(spec)
        if why is None and self.fmt == "messages":
            why = fast_engine.offsets_refusal(spec)
        if why is not None:
            return refuse(f"the tokenizer is not one the fast engine reproduces here: {why}")
        try:
            fast = fast_engine.FastEncoder(self.tokenizer_dir, spec=spec)
        except (OSError, ValueError, RuntimeError) as exc:
            return refuse(f"the fast engine cannot load its tokenizer.json ({exc})")
        specials = [a["content"] for a in spec.get("added_tokens", [])]
        del spec
        texts = fast_engine.adversarial_texts(specials)
        for special in (True, False):
            got = fast.encode(texts, special)
            ref = [e.ids for e in self._encode_batch(texts, add_special_tokens=special)]
            bad = fast_engine.first_difference(got, ref)
            if bad is not None:
                row = got.values[got.offsets[bad] : got.offsets[bad + 1]].tolist()
                return refuse(
                    f"the fast engine's ids differ from transformers' on the built-in adversarial set "
                    f"({fast_engine.describe_difference(texts, bad, row, ref[bad])})"
                )
        checked = {"adversarial_texts": 2 * len(texts)}
        if self.fmt == "messages":
            convs = fast_engine.adversarial_conversations(texts)
            self.fast = fast
            try:
                mismatch = self._compare_labels(convs, range(len(convs)), 0)
            except PackingError as exc:  # e.g. a template that is not incremental: data rows will say so
                mismatch = f"the adversarial conversations cannot be tokenized: {exc}"
            self.fast = None
            if mismatch is not None:
                return refuse(
                    f"the fast path's chat tokens or assistant masks differ from transformers' ({mismatch})"
                )
            checked["adversarial_conversations"] = len(convs)
        self.fast = fast
        return fast_engine.EngineReport(
            f"{fast_engine.ENGINE_MODULE} {version}",
            f"byte-level BPE; identical ids to transformers on the built-in adversarial set; the first "
            f"{fast_engine.PROOF_ROWS} rows of the data and 1 in {fast_engine.AUDIT_EVERY} rows after them are "
            f"compared as they are tokenized",
            requested,
            checked,
        )

    def _sample(self, n: int) -> tuple[range, bool]:
        """Rows of a batch of ``n`` to compare with transformers, and whether they are part of the initial proof."""
        if self._proof_rows > 0:
            return range(min(n, self._proof_rows)), True
        start = (-self._audit_phase) % fast_engine.AUDIT_EVERY
        self._audit_phase += n
        return range(start, n, fast_engine.AUDIT_EVERY), False

    def _disagree(self, what: str, initial: bool, first_row: Row) -> None:
        """The fast engine gave other tokens than transformers: fall back (initial proof, auto) or stop."""
        if initial and self.report.requested == "auto":
            self.fast = None
            self.report = fast_engine.EngineReport(
                "transformers",
                f"fallback: the fast engine differed from transformers on the data ({what})",
                "auto",
                {**self.report.checked, "rows_checked": self.report.checked.get("rows_checked", 0)},
            )
            return
        raise PackingError(
            f"{at(first_row)}: the fast tokenizer engine gave other tokens than transformers ({what}); "
            f"no output was written from it. Rerun with tokenizer_engine='transformers'.",
            param="tokenizer_engine",
        )

    def _count_checked(self, n: int, initial: bool) -> None:
        if initial:
            self._proof_rows -= n
        self.report.checked["rows_checked"] = self.report.checked.get("rows_checked", 0) + n

    # -- building blocks -------------------------------------------------------------------------
    def encode(self, texts: list[str], special: bool, first_row: Row = 0) -> Ragged:
        if self.fast is not None:
            try:
                got = self.fast.encode(texts, special)
            except Exception:  # noqa: BLE001 - e.g. a regex limit on a pathological row: transformers does it
                self.report.checked["batches_on_transformers"] = (
                    self.report.checked.get("batches_on_transformers", 0) + 1
                )
                return ragged.from_lists(
                    [e.ids for e in self._encode_batch(texts, add_special_tokens=special)]
                )
            rows, initial = self._sample(len(texts))
            sample = [texts[i] for i in rows]
            ref = [e.ids for e in self._encode_batch(sample, add_special_tokens=special)]
            bad = fast_engine.first_difference(ragged.select(got, np.asarray(rows, np.int64)), ref)
            if bad is None:
                self._count_checked(len(sample), initial)
                return got
            i = rows[bad]
            self._disagree(
                fast_engine.describe_difference(
                    texts, i, got.values[got.offsets[i] : got.offsets[i + 1]].tolist(), ref[bad]
                ),
                initial,
                first_row,
            )
        return ragged.from_lists([e.ids for e in self._encode_batch(texts, add_special_tokens=special)])

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

    def _render(self, conv: list[dict[str, Any]], generation_prompt: bool) -> str:
        if not self.tok.chat_template:
            raise PackingError(
                f"conversational data needs a chat template, and the tokenizer in {self.tokenizer_dir!r} has "
                f"none; add one (tokenizer.chat_template = ...; save_pretrained) or pass plain strings."
            )
        return self.tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)

    def _split_rendering(self, prompt: list, completion: list, row: Row) -> tuple[str, str]:
        head = self._render(prompt, True)
        full = self._render(prompt + completion, False)
        if not full.startswith(head):
            raise PackingError(
                f"{at(row)}: the chat template renders the prompt differently alone and followed by the "
                f"completion, so the completion cannot be cut out; use a template that renders prefixes stably."
            )
        return head, full[len(head) :]

    def _prompt_and_completions(self, table: pa.Table, names: Sequence[str], first_row: Row) -> list[Ragged]:
        """Tokenized prompt (first) and completions (the others) of prompt-completion or preference rows."""
        prompts = table.column("prompt").to_pylist()
        conversational = bool(prompts) and isinstance(prompts[0], list)
        if not conversational:
            _strings(table, "prompt", first_row)
            parts = [self.encode(prompts, special=True, first_row=first_row)]
            for name in names:
                done = self.encode(_strings(table, name, first_row), special=False, first_row=first_row)
                parts.append(
                    ragged.join_rows([done, self._eos_rows(done.num_rows)]) if self.add_eos else done
                )
            return parts
        columns = {n: table.column(n).to_pylist() for n in names}
        heads: list[str] = []
        tails: dict[str, list[str]] = {n: [] for n in names}
        for i, prompt in enumerate(prompts):
            p = _clean_messages(prompt, "prompt", shift(first_row, i))
            for n in names:
                head, tail = self._split_rendering(
                    p, _clean_messages(columns[n][i], n, shift(first_row, i)), shift(first_row, i)
                )
                tails[n].append(tail)
            heads.append(head)
        return [self.encode(heads, special=False, first_row=first_row)] + [
            self.encode(tails[n], special=False, first_row=first_row) for n in names
        ]

    def _assistant_labels(self, convs: list[list[dict[str, Any]]], first_row: Row) -> tuple[Ragged, Ragged]:
        """Token ids and labels (assistant tokens only) of conversations, from the fast engine when it is in use."""
        if self.fast is not None:
            try:
                got = self._assistant_labels_fast(convs, first_row)
            except PackingError:
                raise
            except Exception:  # noqa: BLE001 - an engine error: transformers tokenizes this batch
                got = None
            if got is not None:
                rows, initial = self._sample(len(convs))
                mismatch = self._compare_labels(convs, rows, first_row, got)
                if mismatch is None:
                    self._count_checked(len(rows), initial)
                    return got
                self._disagree(mismatch, initial, first_row)
        return self._assistant_labels_transformers(convs, first_row)

    def _compare_labels(
        self,
        convs: list[list[dict[str, Any]]],
        rows: Sequence[int],
        first_row: Row,
        got: tuple[Ragged, Ragged] | None = None,
    ) -> str | None:
        """How the fast path's ids or labels differ from transformers' on ``rows`` of ``convs`` (None: identical)."""
        if not rows:
            return None
        if got is None:
            got = self._assistant_labels_fast(convs, first_row)
            if got is None:
                return "its tokens do not spell the rendered text byte for byte"
        index = np.asarray(rows, np.int64)
        ref = self._assistant_labels_transformers([convs[i] for i in rows], first_row)
        for name, mine, theirs in zip(("ids", "labels"), got, ref):
            bad = fast_engine.first_difference(ragged.select(mine, index), ragged.to_lists(theirs))
            if bad is not None:
                return f"{name} of the conversation at {at(first_row, rows[bad])}: {convs[rows[bad]]!r:.200}"
        return None

    def _assistant_labels_fast(
        self, convs: list[list[dict[str, Any]]], first_row: Row
    ) -> tuple[Ragged, Ragged] | None:
        """Render, encode with the fast engine, and mark assistant tokens from byte offsets computed from the ids.

        The two marking rules are transformers' (a token overlapping a ``{% generation %}`` span) and the
        incremental one (a token starting inside an assistant turn); None when the tokens do not spell the
        rendered text byte for byte (then offsets must come from transformers)."""
        assert self.fast is not None
        if self.has_generation_tags:
            from transformers.utils.chat_template_utils import render_jinja_template

            texts, spans = render_jinja_template(
                conversations=convs,
                chat_template=self.tok.get_chat_template(),
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
            )
        else:
            texts, spans = self._incremental_spans(convs, first_row)
        ids = self.fast.encode(texts, special=False)
        token_bytes = self.fast.token_spans(texts, ids)
        if token_bytes is None:
            return None
        starts, ends = token_bytes
        lo, hi, base = [], [], 0
        for text, row_spans in zip(texts, spans):
            ascii_text = text.isascii()
            for a, b in row_spans:
                lo.append(base + (a if ascii_text else len(text[:a].encode("utf-8"))))
                hi.append(base + (b if ascii_text else len(text[:b].encode("utf-8"))))
            base += len(text) if ascii_text else len(text.encode("utf-8"))
        lo_a, hi_a = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        if lo_a.size:
            j = np.searchsorted(hi_a, starts, side="right")  # the first span that ends after the token starts
            inside = j < lo_a.size
            jj = np.minimum(j, lo_a.size - 1)
            inside &= (ends > lo_a[jj]) if self.has_generation_tags else (starts >= lo_a[jj])
        else:
            inside = np.zeros(starts.shape[0], bool)
        return ids, Ragged(ids.offsets, np.where(inside, ids.values, IGNORE_INDEX).astype(np.int32))

    def _incremental_spans(
        self, convs: list[list[dict[str, Any]]], first_row: Row
    ) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """Rendered conversations and the character span of every assistant turn (incremental rendering)."""
        texts, spans = [], []
        for i, conv in enumerate(convs):
            full = self._render(conv, False)
            row_spans = []
            for turn, message in enumerate(conv):
                if message.get("role") != "assistant":
                    continue
                start = self._render(conv[:turn], True)
                end = self._render(conv[: turn + 1], False)
                if not (end.startswith(start) and full.startswith(end)):
                    raise PackingError(
                        f"{at(first_row, i)}: column 'messages' turn {turn}: the chat template does not render "
                        f"conversations incrementally (a prefix renders differently from the start of the whole), "
                        f"so assistant tokens cannot be located; use a template with {{% generation %}} markers."
                    )
                row_spans.append((len(start), len(end)))
            texts.append(full)
            spans.append(row_spans)
        return texts, spans

    def _assistant_labels_transformers(
        self, convs: list[list[dict[str, Any]]], first_row: Row
    ) -> tuple[Ragged, Ragged]:
        if self.has_generation_tags:
            out = self.tok.apply_chat_template(
                convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = ragged.from_lists(out["input_ids"])
            mask = ragged.from_lists(out["assistant_masks"], np.int8)
            return ids, Ragged(
                ids.offsets, np.where(mask.values != 0, ids.values, IGNORE_INDEX).astype(np.int32)
            )
        texts, spans = self._incremental_spans(convs, first_row)
        enc = self.tok(
            texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False
        )
        ids = ragged.from_lists(enc["input_ids"])
        starts = np.fromiter(
            (s for offsets in enc["offset_mapping"] for s, _ in offsets), np.int64, count=ids.values.shape[0]
        )
        labels = np.full(ids.values.shape[0], IGNORE_INDEX, np.int32)
        for i, row_spans in enumerate(spans):
            lo, hi = int(ids.offsets[i]), int(ids.offsets[i + 1])
            row_starts = starts[lo:hi]
            for a, b in row_spans:
                sel = (row_starts >= a) & (row_starts < b)
                labels[lo:hi][sel] = ids.values[lo:hi][sel]
        return ids, Ragged(ids.offsets, labels)

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
                _clean_messages(c, "messages", shift(first_row, i))
                for i, c in enumerate(table.column("messages").to_pylist())
            ]
            ids, labels = self._assistant_labels(convs, first_row)
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
