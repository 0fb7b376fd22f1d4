"""Chat templates rendered with jinja2 alone, configured as transformers configures it (no transformers import).

Importing transformers and loading its tokenizer costs seconds a run, and ``apply_chat_template`` adds Python
work per call.  :func:`read_settings` reads the template and the named special tokens straight from the
tokenizer folder; :class:`ChatRenderer` compiles the template once in jinja2's immutable sandbox with the
environment transformers documents for chat templates (what it holds and what the template sees:
``docs/tokenize.md``, *Chat templates without importing transformers*).

Equal rendering is not assumed: :mod:`packtools.pipeline.tokenizer.chat.tokens` compares it with transformers'
on the built-in adversarial conversations before using it, and falls back to transformers with the reason
otherwise.

>>> r = ChatRenderer("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
...                  "{% endfor %}", {"bos_token": "<s>"})
>>> r.render_spans([{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "yo"}])
('<s>hiyo', [(3, 5), (5, 7)])
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from ..folder import SPECIAL_NAMES

#: A message's reasoning may come under these names; templates read the first (transformers fills it and
#: ``thinking`` from the others).
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def _load_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _template_of(value: Any) -> str | None:
    """A ``chat_template`` value: a string, or a list / dict of named templates (the ``default`` one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        found = value.get("default")
        return found if isinstance(found, str) else None
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_settings(tokenizer_dir: str) -> tuple[str | None, dict[str, str]]:
    """The chat template (None: the folder has none) and the named special tokens of a tokenizer folder, read
    the way ``save_pretrained`` writes them (``chat_template.jinja`` first)."""
    config = _load_json(os.path.join(tokenizer_dir, "tokenizer_config.json"))
    template = None
    jinja = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    if template is None:
        template = _template_of(
            _load_json(os.path.join(tokenizer_dir, "chat_template.json")).get("chat_template")
        )
    if template is None:
        template = _template_of(config.get("chat_template"))
    mapped = _load_json(os.path.join(tokenizer_dir, "special_tokens_map.json"))
    specials = {}
    for name in SPECIAL_NAMES:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(mapped.get(name))
        if text is not None:
            specials[name] = text
    return template, specials


def template_messages(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: reasoning filled in under ``reasoning_content`` and
    ``thinking`` when a message gives it under any of :data:`REASONING_NAMES` (as transformers does); the
    messages themselves (not copies) otherwise."""
    out = list(conv)
    for i, m in enumerate(out):
        if m.keys().isdisjoint(REASONING_NAMES):  # the common case: no reasoning under any name
            continue
        reasoning = next((m[k] for k in REASONING_NAMES if m.get(k) is not None), None)
        if reasoning is not None:
            out[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return out


class _Track:
    """The blocks a render has put out so far (None: not tracking), and where its markers fell among them:
    ``spans``, each ``{% generation %}`` block as (the number of blocks before it, its length); ``at``, where
    each iteration of :mod:`.local`'s instrumented template starts and where its loop ends (it writes this
    object there, which puts out nothing).  jinja2 yields each output expression as it comes, so the blocks
    before a marker have all been taken."""

    __slots__ = ("parts", "at", "spans")

    def __init__(self) -> None:
        self.parts: list[str] | None = None
        self.at: list[int] = []
        self.spans: list[tuple[int, int]] = []

    def __str__(self) -> str:
        if self.parts is not None:
            self.at.append(len(self.parts))
        return ""


#: Exact built-in types whose attributes' sandbox verdicts are remembered per (type, name) (see ``_environment``).
PLAIN_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None)})
BUILTIN_METHOD = type("".strip)  # builtin_function_or_method: no attributes, so never marked unsafe


def _environment(track: _Track) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and records its character span."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            if track.parts is not None:  # the span starts after every block the render has put out so far
                track.spans.append((len(track.parts), len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        """jinja's ``namespace`` without underscore-prefixed attributes (no way into Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: Any, value: Any) -> None:
            Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {key!r} on a namespace")

    class Dicts:
        """``dict(...)`` and ``dict.fromkeys(...)`` inside a template, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Sandbox(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox with its two checks remembered where they cannot change: for an attribute
        of an object of a plain built-in type (a message's ``dict``, a ``str``, a ``list``) the verdict depends on
        the type and the attribute's name alone (a leading underscore, jinja2's internal attributes, the
        mutating methods of known mutable types), and a built-in function or method has no attribute that could
        mark it unsafe to call.  Anything else is checked by jinja2 every time."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._attribute_verdicts: dict[tuple[type, str], bool] = {}

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            kind = type(obj)
            if kind not in PLAIN_TYPES:
                return super().is_safe_attribute(obj, attr, value)
            verdict = self._attribute_verdicts.get((kind, attr))
            if verdict is None:
                verdict = super().is_safe_attribute(obj, attr, value)
                self._attribute_verdicts[kind, attr] = verdict
            return verdict

        def is_safe_callable(self, obj: Any) -> bool:
            return type(obj) is BUILTIN_METHOD or super().is_safe_callable(obj)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=Dicts(),
        namespace=Namespace,
    )
    return env


class ChatRenderer:
    """One compiled chat template with its special tokens; renders one conversation at a time.

    A render runs what jinja2's ``Template.render`` runs, with the template's globals flattened once instead of
    per call: the same context, so the same output and errors (why, and how it is tested: ``docs/tokenize.md``)."""

    def __init__(self, template: str, specials: dict[str, str]) -> None:
        self.template = template
        self._track = _Track()
        compiled = _environment(self._track).from_string(template)
        self._compiled = compiled
        self._env = compiled.environment
        self._globals = dict(compiled.globals)  # what jinja2's new_context flattens from a ChainMap per call
        self._variables = {**specials, "tools": None, "documents": None}
        #: one render per conversation for the incremental rule (:mod:`.local`), once :meth:`enable_local`
        #: has found the shape and checked it: ((instrumented template, its globals), (the tail without and with
        #: the generation prompt))
        self.local: tuple[tuple[Any, dict[str, Any]], tuple[str, str]] | None = None

    @property
    def tools(self) -> Any:
        """The tool schemas the template sees as ``tools`` (None: none), set per group of rows."""
        return self._variables["tools"]

    @tools.setter
    def tools(self, value: Any) -> None:
        self._variables["tools"] = value

    def _context(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        compiled: Any = None,
        globals_: Any = None,
    ) -> Any:
        """The context ``Template.new_context`` makes for these variables (same keys, values and order)."""
        compiled = self._compiled if compiled is None else compiled
        globals_ = self._globals if globals_ is None else globals_
        parent = dict(globals_, messages=messages, add_generation_prompt=generation_prompt, **self._variables)
        return self._env.context_class(self._env, parent, compiled.name, compiled.blocks, globals=globals_)

    def render(self, conv: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The conversation rendered (``generation_prompt``: with the assistant header that opens a reply);
        an empty one is refused, as transformers refuses it."""
        if not conv:
            raise ValueError("an empty conversation has no chat rendering")
        return self.render_messages(template_messages(conv), generation_prompt)

    def render_messages(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """``messages`` (already :func:`template_messages`, not empty) rendered."""
        ctx = self._context(messages, generation_prompt)
        try:
            return self._env.concat(self._compiled.root_render_func(ctx))  # type: ignore[attr-defined]
        except Exception:
            self._env.handle_exception()  # re-raises, as Template.render does
            raise  # not reached

    def render_prefixes(self, conv: list[dict[str, Any]], cuts: list[tuple[int, bool]]) -> Iterator[str]:
        """``render(conv[:k], prompt)`` for every ``(k, prompt)`` of ``cuts``, lazily and in order (the messages
        prepared once for all of them)."""
        messages = template_messages(conv)
        for k, prompt in cuts:
            if k <= 0:
                raise ValueError("an empty conversation has no chat rendering")
            yield self.render_messages(messages[:k], prompt)

    def render_spans(self, conv: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation rendered, and the character span of every ``{% generation %}`` block in it."""
        if not conv:
            raise ValueError("an empty conversation has no chat rendering")
        text, ends = self._render_tracked(template_messages(conv), False)
        return text, [(ends[k], ends[k] + n) for k, n in self._track.spans]

    # -- one render for the incremental rule (packtools.pipeline.tokenizer.chat.local) ---------------------------------
    def enable_local(self, convs: list[list[dict[str, Any]]], prefix_spans: Any) -> str | None:
        """Render conversations once each for the incremental rule when the template has the local shape and
        :meth:`local_spans` equals ``prefix_spans(conv)`` (the rule by prefix renders: ``(text, spans)``, or an
        exception) on every conversation of ``convs``; returns why not (None: enabled)."""
        from . import local as chat_local

        tree = chat_local.local_shape(self.template, self._env)
        if tree is None:
            return "the template's loop body reads more than its message, its position and the first message"
        self.local = None
        wants = []
        for conv in convs:  # the rule by prefix renders, before the one-render path is on
            with contextlib.suppress(Exception):  # a conversation the rule refuses: the fallback raises it
                wants.append((conv, prefix_spans(conv)))
        try:
            compiled = self._env.from_string(tree, globals={chat_local.MARK: self._track})
            instrumented = (compiled, dict(compiled.globals))
            tails = []
            for prompt in (False, True):
                text, ends = self._render_tracked([{"role": "user", "content": ""}], prompt, *instrumented)
                tails.append(text[ends[self._track.at[-1]] :])
        except Exception as exc:  # noqa: BLE001 - then prefixes are rendered, as before
            return f"the instrumented template failed: {type(exc).__name__}: {exc}"
        self.local = (instrumented, (tails[0], tails[1]))
        for conv, want in wants:
            if self.local_spans(conv) != want:
                self.local = None
                return f"one render gave other spans than prefix renders for {conv!r:.120}"
        return None

    def _render_tracked(
        self, messages: list[dict[str, Any]], prompt: bool, compiled: Any = None, globals_: Any = None
    ) -> tuple[str, list[int]]:
        """The rendering by ``compiled`` (default: the template) with its globals, :attr:`_track` noting its
        markers, and where each block starts in it, then its end."""
        compiled = self._compiled if compiled is None else compiled
        parts: list[str] = []
        track = self._track
        track.parts, track.at, track.spans = parts, [], []
        ctx = self._context(messages, prompt, compiled, globals_)
        append = parts.append
        try:
            for block in compiled.root_render_func(ctx):
                append(block)
        except Exception:
            self._env.handle_exception()  # re-raises, as Template.generate does
            raise  # not reached
        finally:
            track.parts = None
        return "".join(parts), list(itertools.accumulate(map(len, parts), initial=0))

    def local_spans(self, conv: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]] | None:
        """The incremental rule's ``(rendering, assistant spans)`` of ``conv`` from one render (see
        :mod:`.local`); None when a prefix would not be the start of the next one (the caller renders the
        prefixes, which raises the rule's error) or the template did not run its loop once per message."""
        if not conv:
            raise ValueError("an empty conversation has no chat rendering")
        assert self.local is not None
        instrumented, (tail, prompt_tail) = self.local
        text, ends = self._render_tracked(template_messages(conv), False, *instrumented)
        marks = [ends[k] for k in self._track.at]
        if len(marks) != len(conv) + 1 or text[marks[-1] :] != tail:
            return None
        spans = []
        for turn, message in enumerate(conv):
            if message.get("role") != "assistant":
                continue
            if turn == 0:
                raise ValueError("an empty conversation has no chat rendering")
            a, b = marks[turn], marks[turn + 1]
            # messages[:turn] + prompt is text[:a] + prompt_tail; messages[:turn + 1] is text[:b] + tail
            if not ((text[a:b] + tail).startswith(prompt_tail) and text.startswith(tail, b)):
                return None
            spans.append((a + len(prompt_tail), b + len(tail)))
        return text, spans
