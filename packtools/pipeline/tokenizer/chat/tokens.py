"""The chat formats of :class:`~packtools.pipeline.tokenizer.batch.BatchTokenizer`: ``messages`` rows and
conversational ``prompt_completion`` / ``preference`` rows, rendered, tokenized and labelled.

:class:`ChatTokens` picks the renderer once per tokenizer: :class:`~packtools.pipeline.tokenizer.chat.render.ChatRenderer`
(jinja2 alone) where it renders the built-in adversarial conversations exactly as transformers'
``apply_chat_template`` does (the verdict recorded in :mod:`packtools.pipeline.tokenizer.proof_cache`);
transformers itself otherwise, with the reason in the part's report (``chat_render``), and always under
``tokenizer_engine='transformers'`` (``docs/tokenize.md``, *Chat templates without importing transformers*).
``BatchTokenizer.chat_seconds`` splits chat time into rendering, encoding and masks
(``benchmarks/bench_tokenize.py`` prints it).  What a conversation cell becomes before the template sees it is
:mod:`packtools.pipeline.tokenizer.chat.values`.

>>> r = ChatRenderer("{{ messages[0]['content'] }}", {})
>>> render_difference(r, ChatRenderer("{{ messages[0]['content'] | upper }}", {}), [[{"role": "user", "content": "hi"}]], False)
"messages[:1] of [{'role': 'user', 'content': 'hi'}] with add_generation_prompt=False, tools=None: 'hi' != 'HI'"
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ....core import ragged
from ....core.ragged import Ragged
from ....errors import PackingError
from ....io.json_cells import cells
from ...formats import Row
from ...formats import at as _at
from ...formats import shift as _shift
from .. import adversarial, proof_cache
from .. import fast as fast_engine
from ..proof import engine_error
from ..spec import library_versions
from . import labels as chat_labels
from .render import ChatRenderer, read_settings
from .values import TYPED_CONVERSATIONS, TYPED_TOOLS, clean_messages, plain_value, render_difference


class TransformersRenderer:
    """transformers' own rendering (``apply_chat_template``), behind the interface of :class:`ChatRenderer`."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.template = tok.get_chat_template()
        self.tools: Any = None  # the tool schemas passed as ``tools=`` (set per group of rows)

    def render(self, conv: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            conv, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def render_prefixes(self, conv: list[dict[str, Any]], cuts: list[tuple[int, bool]]) -> Iterator[str]:
        return (self.render(conv[:k], prompt) for k, prompt in cuts)

    def render_spans(self, conv: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=[conv],
            tools=self.tools,
            chat_template=self.template,
            return_assistant_tokens_mask=True,
            **self.tok.special_tokens_map,
        )
        return texts[0], [tuple(s) for s in spans[0]]


class ChatTokens:
    """Chat rendering, tokenizing and labelling for one :class:`BatchTokenizer` ``bt``."""

    def __init__(self, bt: Any, requested: str) -> None:
        self.bt = bt
        self.requested = requested
        self._renderer: Any = None
        # role -> how the template renders a content list of that role (:meth:`_parts_verdict`)
        self._parts_verdicts: dict[str, str | None] = {}
        self.render_engine = ""  # which renderer runs, and why (the part report's ``chat_render``)

    # -- the renderer ------------------------------------------------------------------------------
    @property
    def renderer(self) -> Any:
        if self._renderer is None:
            self._renderer = self._choose_renderer()
        return self._renderer

    def _transformers(self, why: str) -> TransformersRenderer:
        tok = self.bt.tok
        if not tok.chat_template:
            raise PackingError(
                f"conversational data needs a chat template, and the tokenizer in {self.bt.tokenizer_dir!r} has "
                f"none; add one (tokenizer.chat_template = ...; save_pretrained) or pass plain strings."
            )
        self.render_engine = f"transformers ({why})"
        return TransformersRenderer(tok)

    def _choose_renderer(self) -> Any:
        bt = self.bt
        if self.requested == "transformers":
            return self._transformers("tokenizer_engine='transformers'")
        template, specials = read_settings(bt.tokenizer_dir)
        if template is None:
            return self._transformers("no chat template in the folder's files")
        try:
            mine = ChatRenderer(template, specials)
        except Exception as exc:  # noqa: BLE001 - jinja2 missing or a template it does not compile
            return self._transformers(f"jinja2 cannot compile it here: {type(exc).__name__}: {exc}")
        tags = bool(chat_labels.GENERATION_TAG.search(template))
        texts = adversarial.adversarial_texts(list(specials.values()))
        convs = adversarial.adversarial_conversations(texts) + TYPED_CONVERSATIONS
        versions = dict(library_versions())
        reference = f"transformers {versions['transformers']}; jinja2 {versions['jinja2']}"
        typed = repr((TYPED_CONVERSATIONS, TYPED_TOOLS))
        path = proof_cache.verdict_path(bt.fingerprint, "chat-render", reference, [template, *texts, typed])
        checked = proof_cache.load(path)
        if checked is None:
            tok = bt.tok
            why = None
            if mine.template != tok.get_chat_template():
                why = "transformers reads another chat template from the folder"
            elif specials != tok.special_tokens_map:
                why = f"transformers passes other special tokens ({tok.special_tokens_map})"
            else:
                theirs = TransformersRenderer(tok)
                why = render_difference(mine, theirs, convs, tags) or render_difference(
                    mine, theirs, convs[:3] + TYPED_CONVERSATIONS, tags, TYPED_TOOLS
                )
            if why is not None:
                return self._transformers(f"jinja2 alone rendered differently: {why}")
            checked = {"adversarial_conversations": len(convs)}
            proof_cache.record(path, checked)
        self.render_engine = (
            f"jinja2 {versions['jinja2']} (the same renderings as transformers' apply_chat_template on "
            f"{checked.get('adversarial_conversations', 0)} adversarial conversations, every prefix)"
        )
        if not tags:  # one render per conversation where the template allows it

            def prefix_spans(conv: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
                (text,), (spans,) = chat_labels.incremental_spans(mine, [conv], str)
                return text, spans

            why_not = mine.enable_local(convs, prefix_spans)
            self.render_engine += (
                "; one render per conversation (its loop body reads its message, its position and the first "
                "message only; the same spans as prefix renders on the adversarial conversations)"
                if why_not is None
                else f"; prefixes rendered ({why_not})"
            )
        return mine

    def refuse_printed_parts(self, convs: list[list[dict[str, Any]]], where: Any, column: str) -> None:
        """Refuse a content list (of text parts: other parts are refused before, by ``clean_messages``) where
        the chat template writes such a list as text, Python's repr and all (``{{ message['content'] }}``, as
        many text-only templates do), or drops it (Qwen 3's ``{% if content is string %}...{% else %}''``)
        rather than reading its parts: the model would train on ``[{'type': 'text', 'text': ...}]``, or on
        nothing where the text was.  transformers renders it the same, without a word.  ``where(i)`` names
        conversation ``i``.  The template is probed once per role that holds a list (:meth:`_parts_verdict`)."""
        for i, conv in enumerate(convs):
            for turn, m in enumerate(conv):
                if not isinstance(m.get("content"), list):
                    continue
                role = m.get("role")
                if not isinstance(role, str):  # no role the template knows (refused where it renders it)
                    continue
                verdict = self._parts_verdicts.get(role, "")
                if verdict == "":
                    verdict = self._parts_verdicts[role] = self._parts_verdict(role)
                if verdict is None:
                    continue
                what = (
                    "writes such a list as text (\"[{'type': 'text', 'text': ...}]\", Python's repr) instead of "
                    "reading its parts, so the model would train on that repr"
                    if verdict == "prints"
                    else "drops such a list (it renders a string content only), so the model would not see "
                    "its text"
                )
                raise PackingError(
                    f"{where(i)}: column {column!r} turn {turn}: its content is a list of parts, and the chat "
                    f"template {what} (a {role!r} message). Give each content as a string (join its text parts), "
                    f"or use a chat template that reads content parts."
                )

    def _parts_verdict(self, role: str) -> str | None:
        """How the chat template renders a ``role`` message whose content is a list of one text part:
        ``"prints"`` (its repr in the text), ``"drops"`` (its text is missing where a string content shows), or
        None (its text is read; or the probe cannot tell: the template refuses it)."""
        text = "packtools probe"

        def conv(content: Any) -> list[dict[str, Any]]:
            if role == "user":
                return [{"role": "user", "content": content}]
            if role == "system":
                return [{"role": "system", "content": content}, {"role": "user", "content": "question"}]
            return [{"role": "user", "content": "question"}, {"role": role, "content": content}]

        try:
            shown = self.renderer.render(conv([{"type": "text", "text": text}]), False)
        except Exception:  # noqa: BLE001 - a template that refuses lists raises on the rows themselves
            return None
        # the part itself in the text (not the tools' schemas a template may print beside it)
        if f"'text': '{text}'" in shown or f'"text": "{text}"' in shown:
            return "prints"
        if text in shown:
            return None
        try:  # dropped: only where a string content of that role shows (a template may drop a role wholly)
            plain = self.renderer.render(conv(text), False)
        except Exception:  # noqa: BLE001
            return None
        return "drops" if text in plain else None

    def set_tools(self, tools: Any) -> None:
        """The tool schemas the renderings that follow pass to the template (None: none)."""
        if tools is not None or self._renderer is not None:  # None needs no renderer built for it
            self.renderer.tools = plain_value(tools)

    @property
    def has_generation_tags(self) -> bool:
        """Whether the chat template marks assistant text with ``{% generation %}``."""
        return bool(chat_labels.GENERATION_TAG.search(self.renderer.template or ""))

    # -- prompt + completions --------------------------------------------------------------------
    def split_rendering(self, prompt: list, completion: list, row: Row) -> tuple[str, str]:
        head = self.renderer.render(prompt, True)
        full = self.renderer.render(prompt + completion, False)
        if not full.startswith(head):
            raise PackingError(
                f"{_at(row)}: the chat template renders the prompt differently alone and followed by the "
                f"completion, so the completion cannot be cut out; use a template that renders prefixes stably."
            )
        return head, full[len(head) :]

    def prompt_and_completions(
        self, table: pa.Table, prompts: list, names: Sequence[str], first_row: Row
    ) -> list[Ragged]:
        """Tokenized prompt (first) and completions (the others) of conversational rows (``prompts``: the
        table's ``prompt`` column as Python lists of messages)."""
        columns = {n: cells(table, n) for n in names}
        heads: list[str] = []
        tails: dict[str, list[str]] = {n: [] for n in names}
        for i, prompt in enumerate(prompts):
            p = clean_messages(prompt, "prompt", _shift(first_row, i))
            self.refuse_printed_parts([p], lambda _, i=i: _at(_shift(first_row, i)), "prompt")
            for n in names:
                completion = clean_messages(columns[n][i], n, _shift(first_row, i))
                self.refuse_printed_parts([completion], lambda _, i=i: _at(_shift(first_row, i)), n)
                if not completion:  # not the template's fault: there is nothing to render after the prompt
                    raise PackingError(
                        f"{_at(_shift(first_row, i))}: column {n!r} is an empty conversation ([]); every "
                        f"completion needs at least one message (drop the row, or give it the assistant's reply)."
                    )
                head, tail = self.split_rendering(p, completion, _shift(first_row, i))
                tails[n].append(tail)
            heads.append(head)
        bt = self.bt
        return [bt.encode(heads, False, first_row, "prompt")] + [
            bt.encode(tails[n], False, first_row, n) for n in names
        ]

    # -- messages ----------------------------------------------------------------------------------
    def rendered(
        self, convs: list[list[dict[str, Any]]], where: Any
    ) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """Rendered conversations and the character spans of their assistant text (markers or incremental)."""
        t0 = time.perf_counter()
        renderer = self.renderer
        if self.has_generation_tags:
            pairs = [renderer.render_spans(c) for c in convs]
            out = [p[0] for p in pairs], [p[1] for p in pairs]
        else:
            out = chat_labels.incremental_spans(renderer, convs, where)
        self.bt.chat_seconds["render"] += time.perf_counter() - t0
        return out

    def renderable(self, convs: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
        """The conversations of ``convs`` the chat template renders: a template may refuse some with its own
        ``raise_exception`` (Gemma's refuses a system turn), and a data row it refuses fails on either path."""
        from jinja2 import TemplateError

        kept = []
        for conv in convs:
            try:
                self.rendered([conv], str)
            except TemplateError:
                continue
            kept.append(conv)
        return kept

    def reference(
        self, convs: list[list[dict[str, Any]]], where: Any, rendered: tuple[list[str], list] | None = None
    ) -> tuple[Ragged, Ragged]:
        """transformers' ids and labels: from transformers itself, or from the proven renderer (its renderings
        ``rendered`` when given) and the reference tokenizer's offsets (what transformers computes them from)."""
        if isinstance(self.renderer, TransformersRenderer):
            return chat_labels.labels_transformers(self.bt, convs, where)
        texts, spans = rendered if rendered is not None else self.rendered(convs, where)
        return chat_labels.labels_from_offsets(self.bt.backend, texts, spans)

    def render_ahead(
        self, convs: list[list[dict[str, Any]]], first_row: Row
    ) -> tuple[list[str], list] | None:
        """The renderings :meth:`assistant_labels` will take for ``convs`` (rendering is most of chat's Python
        work and needs no tokenizer, so it can run while the fast engine loads); None where that renderer is
        transformers' (it renders in :func:`chat_labels.labels_transformers`)."""
        if isinstance(self.renderer, TransformersRenderer):
            return None
        return self.rendered(convs, lambda i: _at(first_row, i))

    def assistant_labels(
        self,
        convs: list[list[dict[str, Any]]],
        first_row: Row,
        rendered: tuple[list[str], list] | None = None,
    ) -> tuple[Ragged, Ragged]:
        """Token ids and labels (assistant tokens only) of conversations, from the fast engine when it is in use;
        ``rendered``: their :meth:`render_ahead`, when it was taken before."""
        bt = self.bt
        where = lambda i: _at(first_row, i)  # noqa: E731
        if bt.drops is not None:
            contents = [m.get("content") for c in convs for m in c]
            rows = [i for i, c in enumerate(convs) for _ in c]
            bt.drops.scan([c if isinstance(c, str) else "" for c in contents], lambda k: where(rows[k]))
        if bt.pending is not None:
            bt.take_pending()  # the reference labels the first batch while the engine loads
        if bt.fast is None:
            return self.reference(convs, where, rendered)
        if rendered is None:
            rendered = self.rendered(convs, where)
        if bt.fast.nfc:  # NFC would move characters of a text that is not NFC: those rows take the reference
            nfc = np.fromiter((unicodedata.is_normalized("NFC", t) for t in rendered[0]), bool, len(convs))
            if not nfc.all():
                return self._split_nfc(convs, rendered, nfc, first_row)
        return self._fast_labels(convs, rendered, first_row)

    def _split_nfc(
        self, convs: list, rendered: tuple[list[str], list], nfc: np.ndarray, first_row: Row
    ) -> tuple[Ragged, Ragged]:
        """The NFC rows on the fast path, the others through the reference, in their order."""
        fast_rows, slow_rows = np.flatnonzero(nfc), np.flatnonzero(~nfc)
        self.bt.proof.to_transformers(
            f"{_at(first_row, int(slow_rows[0]))}: {len(slow_rows)} of {len(convs)} rendered conversations of a batch "
            f"are not NFC, so token offsets cannot come from the ids: the reference tokenized those rows"
        )
        parts = []
        for rows in (fast_rows, slow_rows):
            sub = [convs[i] for i in rows], ([rendered[0][i] for i in rows], [rendered[1][i] for i in rows])
            named = lambda i=0, rows=rows: _at(first_row, int(rows[i]))  # noqa: E731 - rows of the batch
            if rows is fast_rows:
                parts.append(self._fast_labels(sub[0], sub[1], named) if len(rows) else None)
            else:
                parts.append(self.reference(sub[0], named, sub[1]))
        if parts[0] is None:
            return parts[1]
        position = np.argsort(np.concatenate([fast_rows, slow_rows]))  # each row's place in the parts
        ids, labels = (ragged.select(ragged.stack_rows([parts[0][k], parts[1][k]]), position) for k in (0, 1))
        return ids, labels

    def _fast_labels(
        self, convs: list, rendered: tuple[list[str], list], first_row: Row
    ) -> tuple[Ragged, Ragged]:
        bt = self.bt
        where = lambda i: _at(first_row, i)  # noqa: E731
        try:
            got = chat_labels.labels_fast(bt, *rendered)
        except PackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine error: transformers tokenizes this batch
            engine_error(bt, exc, [], False, first_row)  # counted there, with its reason
            return self.reference(convs, where, rendered)
        if got is None:  # the tokens do not spell the text byte for byte
            bt.proof.to_transformers(
                f"{_at(first_row)}: the tokens of the rendered text do not spell it byte for byte, so token "
                f"offsets cannot come from the ids"
            )
            return self.reference(convs, where, rendered)
        rows_, proof = bt.proof.sample("messages", len(convs))
        mismatch = self.compare_labels(convs, rows_, first_row, got, rendered)
        if mismatch is None:
            bt.proof.count("messages", len(rows_), proof)
            bt.proof.batches_fast += 1
            return got
        bt._disagree(mismatch[1], mismatch[0] < proof, first_row)
        return self.reference(convs, where, rendered)

    def compare_labels(  # noqa: PLR0913 - the last two are optional precomputed results
        self,
        convs: list[list[dict[str, Any]]],
        rows: Sequence[int],
        first_row: Row,
        got: tuple[Ragged, Ragged] | None = None,
        rendered: tuple[list[str], list] | None = None,
    ) -> tuple[int, str] | None:
        """Where (index into ``rows``) and how the fast path's ids or labels first differ from the reference on
        ``rows`` of ``convs`` (None: identical)."""
        if not len(rows):
            return None
        where = lambda i: _at(first_row, i)  # noqa: E731
        if rendered is None:
            rendered = self.rendered(convs, where)
        if got is None:
            got = chat_labels.labels_fast(self.bt, *rendered)
            if got is None:
                return 0, "its tokens do not spell the rendered text byte for byte"
        index = np.asarray(rows, np.int64)
        picked = ([rendered[0][i] for i in rows], [rendered[1][i] for i in rows])
        ref = self.reference([convs[i] for i in rows], where, picked)
        for name, mine, theirs in zip(("ids", "labels"), got, ref):
            bad = fast_engine.first_difference(ragged.select(mine, index), ragged.to_lists(theirs))
            if bad is not None:
                return (
                    bad,
                    f"{name} of the conversation at {_at(first_row, int(rows[bad]))}: {convs[rows[bad]]!r:.200}",
                )
        return None
