"""The *head* of each conversation: the tokens of its leading system message(s), as the chat template renders
them (BOS included), which a turn-aware split (:mod:`packtools.pipeline.turn_split`) carries, unlabeled, before
every piece but the first.

The head is the rendering of ``messages[:k]`` (``k`` leading ``system`` messages, no generation prompt),
tokenized like the whole conversation; it is 0 (the pieces then carry nothing) without a leading system message
or where those ids are not the first of the whole conversation's (a template that renders a system turn alone
differently or refuses it, a tokenization that merges across the boundary).

>>> class R:
...     def render(self, conv, prompt): return "".join(f"<{m['role']}>{m['content']}" for m in conv)
>>> from packtools.core.ragged import from_lists
>>> encode = lambda texts: from_lists([[ord(c) for c in t] for t in texts])
>>> convs = [[{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], [{"role": "user", "content": "u"}]]
>>> ids = encode([R().render(c, False) for c in convs])
>>> head_lengths(R(), encode, convs, ids).tolist()
[9, 0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ....core.ragged import Ragged

#: the token table's column with each row's head; the stage records it in the sidecar and does not stage it
HEAD_COLUMN = "head_length"
#: the token table's schema metadata key holding :func:`closing_ids` (comma-separated ids), for the sidecar
CLOSING_KEY = b"packtools.turn_closing"
#: the token table's schema metadata key holding :func:`tool_opener_ids` (comma-separated ids)
TOOL_OPENER_KEY = b"packtools.tool_opener"

_PROBE = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
]


def leading_system(conv: list[dict[str, Any]]) -> int:
    """How many messages at the start of ``conv`` are system messages."""
    k = 0
    while k < len(conv) and conv[k].get("role") == "system":
        k += 1
    return k


def head_lengths(
    renderer: Any, encode: Callable[[list[str]], Ragged], convs: list[list[dict[str, Any]]], ids: Ragged
) -> np.ndarray:
    """Per conversation, the length of its head in ``ids`` (the conversations' token ids), 0 where it has none
    or where the head's own ids are not the first ids of the conversation."""
    heads = np.zeros(len(convs), np.int64)
    rows: dict[str, list[int]] = {}  # conversations sharing a system prompt share its rendering
    firsts: dict[str, list[dict[str, Any]]] = {}
    for i, conv in enumerate(convs):
        k = leading_system(conv)
        if k == 0 or k == len(conv):  # no head, or nothing after it to split
            continue
        key = repr(conv[:k])
        rows.setdefault(key, []).append(i)
        firsts.setdefault(key, conv[:k])
    keys, texts = [], []
    for key, first in firsts.items():
        try:
            texts.append(renderer.render(first, False))
        except Exception:  # noqa: BLE001, S112 - a template that refuses a system turn alone: no head
            continue
        keys.append(key)
    if not keys:
        return heads
    got = encode(texts)
    for j, key in enumerate(keys):
        head = got.values[got.offsets[j] : got.offsets[j + 1]]
        n = head.shape[0]
        for i in rows[key]:
            lo, hi = int(ids.offsets[i]), int(ids.offsets[i + 1])
            if 0 < n < hi - lo and np.array_equal(ids.values[lo : lo + n], head):
                heads[i] = n
    return heads


def closing_ids(renderer: Any, encode: Callable[[list[str]], Ragged]) -> np.ndarray:
    """The ids of what a template with ``{% generation %}`` markers writes after an assistant turn's marked span
    and before the next message (ChatML's ``\\n`` after ``<|im_end|>``): an assistant span then ends before the
    next message starts, and a split must start its piece after these tokens.  Empty for templates without
    markers (the incremental rule's spans end where the next message starts) or when the probe conversation
    does not show it plainly."""
    try:
        text, spans = renderer.render_spans(_PROBE)
        upto = renderer.render(_PROBE[:2], False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no closing text known
        return np.zeros(0, np.int64)
    if len(spans) != 1 or not text.startswith(upto) or not spans[0][1] <= len(upto):
        return np.zeros(0, np.int64)
    closing = upto[spans[0][1] :]
    if not closing:
        return np.zeros(0, np.int64)
    got = encode([closing])
    return np.asarray(got.values[got.offsets[0] : got.offsets[1]], np.int64)


#: the content of the message that follows the probe's assistant message: a marker found in the rendering
_TOOL_MARK = "zqxj"


def _opener(renderer: Any, role: str) -> str | None:
    """What the template writes before a ``role`` message's content that follows an assistant message."""
    conv = [*_PROBE[:2], {"role": role, "content": _TOOL_MARK}]
    upto = renderer.render(conv[:2], False)
    text = renderer.render(conv, False)
    if not text.startswith(upto) or text.count(_TOOL_MARK) != 1:
        return None
    return text[len(upto) : text.index(_TOOL_MARK)]


def tool_opener_ids(renderer: Any, encode: Callable[[list[str]], Ragged]) -> np.ndarray:
    """The ids a template writes at the start of a tool message after an assistant message (ChatML's
    ``<|im_start|>tool\\n``; Qwen 3's ``<|im_start|>user\\n<tool_response>\\n``), by which a turn-aware split
    keeps a tool result with the call before it (:mod:`packtools.pipeline.turn_split`).  Empty when the
    template refuses the probe, writes nothing before the content, or writes a tool message's start exactly as
    a user message's (then a tool result cannot be told from a question).

    >>> class R:
    ...     def render(self, conv, prompt): return "".join(f"<{m['role']}>{m['content']}" for m in conv)
    >>> from packtools.core.ragged import from_lists
    >>> encode = lambda texts: from_lists([[ord(c) for c in t] for t in texts])
    >>> "".join(map(chr, tool_opener_ids(R(), encode)))
    '<tool>'
    """
    try:
        tool, user = _opener(renderer, "tool"), _opener(renderer, "user")
    except Exception:  # noqa: BLE001 - a template that refuses the probe (no tool role): no opener known
        return np.zeros(0, np.int64)
    if not tool or tool == user:
        return np.zeros(0, np.int64)
    got = encode([tool])
    return np.asarray(got.values[got.offsets[0] : got.offsets[1]], np.int64)
