"""What a chat cell becomes before the template sees it, as transformers' ``apply_chat_template`` makes it.

:func:`clean_messages` checks a conversation cell and drops ``None`` values at the top of each message (Arrow
gives a struct's missing key as ``None``; transformers drops them too) and makes its values plain
(:func:`plain_value`).  :data:`TYPED_CONVERSATIONS` and :data:`TYPED_TOOLS` join the adversarial conversations in
the proof that jinja2 renders as transformers does (:func:`render_difference`); :func:`by_tools` renders the rows
of a ``tools`` column with their own tools.

>>> clean_messages([{"role": "user", "content": "hi", "tool_calls": None}], "messages", 0)
[{'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ....errors import PackingError
from ....io.json_cells import cells
from ...formats import Row, at, non_text_error, non_text_part


def plain_value(value: Any) -> Any:
    """``value`` as the plain JSON types a chat template sees through transformers (its
    ``_plain_template_data``): subclasses of str/int/float (enums, numpy floats) as the base type, numpy scalars
    as Python ones, mappings, lists and tuples rebuilt, anything else (a ``datetime``, a ``Decimal``, bytes) as
    the placeholder ``<TypeName>``."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_value(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_value(v) for v in value)
    if isinstance(value, np.generic):
        return plain_value(value.item())
    return f"<{kind.__name__}>"


def clean_messages(conv: Any, name: str, row: Row) -> list[dict[str, Any]]:
    """A conversation cell as a list of message dicts without None values, its values made plain as
    transformers makes them (:func:`plain_value`), or an error naming the row; a content part other than text
    (:func:`~packtools.pipeline.formats.non_text_part`: an image, ``image_url``, audio, a file) is refused by
    row, turn and part, since the text template would lose it."""
    if conv is None:  # a JSON row without the key (Arrow fills it with null), or a null cell
        raise PackingError(
            f"{at(row)}: column {name!r} is null (the row has no {name!r}); every row of this data needs a list "
            f"of messages there: fill or filter that row (rows of another format, such as 'text', go in a "
            f"separate run)."
        )
    if not isinstance(conv, list) or not all(isinstance(m, dict) and m.get("role") is not None for m in conv):
        raise PackingError(  # Arrow gives a message's missing "role" as None: that is a missing role too
            f"{at(row)}: column {name!r} is not a list of messages ({{'role': ..., 'content': ...}}, every "
            f"message with a role); fix that row."
        )
    part = non_text_part(conv)  # JSON input was read for these before any work (schema._refuse_images)
    if part is not None:
        raise PackingError(non_text_error(at(row), name, *part))
    # a message of string values only is kept as it is (the cell's rows are fresh dicts): the common case
    return [
        m
        if all(type(v) is str for v in m.values())
        else {k: plain_value(v) for k, v in m.items() if v is not None}
        for m in conv
    ]


#: Conversations with typed values, tool calls and content lists, proven with the adversarial ones: the template
#: must render them as transformers does (raise or not, and what) before jinja2 alone renders the data.
TYPED_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [
        {"role": "system", "content": "tools ready"},
        {"role": "user", "content": "weather in Paris, two guests?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {
                            "city": "Paris",
                            "guests": 2,
                            "price": 12.5,
                            "id": 12345678901234567890,
                            "flags": [True, False],
                            "when": "2024-01-02 10:00:00",
                            "nested": {"a": [1]},
                        },
                    },
                }
            ],
        },
        {"role": "tool", "name": "get_weather", "content": '{"temperature": 21.5}'},
        {"role": "assistant", "content": "21.5 degrees"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what is it?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
    ],
    [
        {"role": "user", "content": "count", "name": "x", "score": 10, "weight": 0.25, "ok": True},
        {"role": "assistant", "content": "1 2 3", "reasoning_content": "count up"},
    ],
]


#: Tool schemas (TRL's ``tools`` column) the proof renders conversations with, as transformers passes them.
TYPED_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "guests": {"type": "integer", "minimum": 1}},
                "required": ["city"],
            },
        },
    }
]


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a template that raises must raise the same on both sides
        return ("raised", type(exc).__name__, str(exc))


def render_difference(
    mine: Any, theirs: Any, convs: Sequence[list[dict[str, Any]]], tags: bool, tools: Any = None
) -> str | None:
    """Where renderer ``mine`` first renders ``convs`` (given ``tools``) differently from ``theirs`` (None:
    nowhere)."""
    mine.tools = theirs.tools = tools
    try:
        for conv in convs:
            for k in range(1, len(conv) + 1):  # both refuse an empty conversation
                for prompt in (False, True):
                    a, b = _outcome(mine.render, conv[:k], prompt), _outcome(theirs.render, conv[:k], prompt)
                    if a != b:
                        return (
                            f"messages[:{k}] of {conv!r:.120} with add_generation_prompt={prompt}, tools="
                            f"{tools!r:.40}: {a!r:.80} != {b!r:.80}"
                        )
            if tags and _outcome(mine.render_spans, conv) != _outcome(theirs.render_spans, conv):
                return f"the {{% generation %}} spans of {conv!r:.120}"
        return None
    finally:
        mine.tools = theirs.tools = None


def by_tools(bt: Any, table: pa.Table, first_row: Row) -> pa.Table:
    """The token table of batch ``table`` (with a ``tools`` column) by tokenizer ``bt``: rows tokenized in groups
    of equal tools, the template seeing that group's ``tools`` (as TRL passes each row's to
    ``apply_chat_template``), then put back in their order."""
    tools = cells(table, "tools")
    table = table.drop_columns(["tools"])
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tools):
        if t is not None and not (isinstance(t, list) and all(isinstance(x, dict) for x in t)):
            raise PackingError(
                f"{at(first_row, i)}: column 'tools' is {type(t).__name__}, not a list of tool schemas "
                f"({{'type': 'function', 'function': {{...}}}}) or null; fix that row."
            )
        groups.setdefault(json.dumps(t, sort_keys=True), []).append(i)
    if bt.fmt != "messages":
        prompts = cells(table, "prompt")
        plain = next((i for i, t in enumerate(tools) if t is not None and isinstance(prompts[i], str)), None)
        if plain is not None:
            raise PackingError(
                f"{at(first_row, plain)}: the row has 'tools' but a plain-text prompt, and only a chat template "
                f"can show tools to the model; give the prompt as messages, or drop the 'tools' column."
            )
    parts, order = [], []
    try:
        for rows in groups.values():
            bt.chat.set_tools(tools[rows[0]])
            if len(groups) == 1:
                return bt.tokenize_rows(table, first_row)
            named = lambda j=0, rows=rows: at(first_row, rows[j])  # noqa: E731 - the group's row j
            parts.append(bt.tokenize_rows(table.take(rows), named))
            order += rows
    finally:
        bt.chat.set_tools(None)
    back = np.argsort(np.asarray(order, np.int64))  # each row's place among the groups' rows
    return pa.concat_tables(parts).take(back).combine_chunks()
