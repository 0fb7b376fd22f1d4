"""Token ids and assistant-only labels of chat conversations, by transformers or by the fast engine.

The marking rules are transformers' (``docs/pipeline.md``, *Labels*): a token is an assistant token when it
overlaps a ``{% generation %}`` span or, without markers, an assistant turn's span by the incremental rule
(:func:`incremental_spans`), so a plain template and a copy with markers around the same text give the same
labels.  The fast path computes token byte offsets from the ids (each byte-level token spells its bytes) instead
of asking a tokenizer for offsets (:func:`labels_fast`); with an NFC normalizer it does so for batches whose
rendered text is already NFC, other batches take the reference: the reference tokenizer's character offsets
(:func:`labels_from_offsets`, what transformers computes the mask from), or transformers itself
(:func:`labels_transformers`) when the renderer is transformers'.  The first two mark tokens with
:func:`overlap_mask`.

>>> bool(GENERATION_TAG.search("{% generation %}{{ m['content'] }}{% endgeneration %}"))
True
"""

from __future__ import annotations

import re
import time
import unicodedata
from typing import Any

import numpy as np

from ....constants import IGNORE_INDEX
from ....core import ragged
from ....core.ragged import Ragged
from ....errors import PackingError

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
Conversations = list[list[dict[str, Any]]]


def incremental_cuts(conv: list[dict[str, Any]]) -> list[tuple[int, bool]]:
    """The renders the incremental rule needs, as ``(k, generation_prompt)`` of ``conv[:k]``: the whole
    conversation first, then per assistant turn the prefix before it (with the prompt) and, but for the last
    message, the prefix through it (the whole conversation's rendering serves the last)."""
    last = len(conv) - 1
    cuts = [(len(conv), False)]
    for turn, message in enumerate(conv):
        if message.get("role") == "assistant":
            cuts.append((turn, True))
            if turn != last:
                cuts.append((turn + 1, False))
    return cuts


def incremental_spans(
    renderer: Any, convs: Conversations, where: Any
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Rendered conversations and the character span of every assistant turn (incremental rendering) by
    ``renderer`` (``render_prefixes(conv, cuts)``: ``render(conv[:k], prompt)`` per cut, lazily); ``where(i)`` names
    conversation ``i`` in errors.  A renderer with ``local`` set renders each conversation once (``local_spans``,
    :mod:`packtools.pipeline.tokenizer.chat.local`) and prefixes only where that returns None."""
    texts, spans = [], []
    render_prefixes = renderer.render_prefixes
    local = renderer.local_spans if getattr(renderer, "local", None) is not None else None
    for i, conv in enumerate(convs):
        if conv and conv[0].get("role") == "assistant":  # its prefix is empty: no rendering (not 'empty')
            raise PackingError(
                f"{where(i)}: column 'messages' turn 0: the conversation opens with an assistant turn; without "
                f"{{% generation %}} markers in the chat template, an assistant turn's labels come from rendering "
                f"the messages before it with the generation prompt, and none come before the first. Put a "
                f"system or user message first, or use a template with {{% generation %}} markers around the "
                f"assistant text."
            )
        if local is not None:  # one render gives every prefix (packtools.pipeline.tokenizer.chat.local)
            got = local(conv)
            if got is not None:
                texts.append(got[0])
                spans.append(got[1])
                continue
        cuts = incremental_cuts(conv)
        rendered = render_prefixes(conv, cuts)  # lazily, in the order of cuts: errors come in that order
        full = next(rendered)
        row_spans = []
        for turn, message in enumerate(conv):
            if message.get("role") != "assistant":
                continue
            start = next(rendered)
            end = full if turn == len(conv) - 1 else next(rendered)
            if not (end.startswith(start) and full.startswith(end)):
                raise PackingError(
                    f"{where(i)}: column 'messages' turn {turn}: the chat template does not render "
                    f"conversations incrementally (a prefix renders differently from the start of the whole), "
                    f"so assistant tokens cannot be located; use a template with {{% generation %}} markers."
                )
            if row_spans and len(start) < row_spans[-1][1]:  # the spans must follow each other (overlap_mask)
                raise PackingError(
                    f"{where(i)}: column 'messages' turn {turn}: the chat template does not render "
                    f"conversations incrementally (the messages before this turn, with the generation prompt, "
                    f"render shorter than those through the assistant turn before it, so the turns' spans "
                    f"overlap), so assistant tokens cannot be located; use a template with {{% generation %}} "
                    f"markers."
                )
            row_spans.append((len(start), len(end)))
        texts.append(full)
        spans.append(row_spans)
    return texts, spans


def overlap_mask(starts: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Which tokens ``[starts, ends)`` overlap one of the sorted, disjoint spans ``[lo, hi)`` (all flat, in one
    coordinate system): transformers' rule, a token overlapping the first span that ends after it starts.

    >>> overlap_mask(np.array([0, 2, 4]), np.array([2, 4, 6]), np.array([3]), np.array([4])).tolist()
    [False, True, False]
    """
    n = starts.shape[0]
    if not lo.size:
        return np.zeros(n, bool)
    if n > 1 and bool((starts[1:] >= starts[:-1]).all()):
        # tokens in order (as the ids give them): the same j, counted from the first token at or after each
        # span's end (a search per span instead of one per token)
        first = np.searchsorted(starts, hi, side="left")
        j = np.cumsum(np.bincount(first, minlength=n + 1)[:n])
    else:
        j = np.searchsorted(hi, starts, side="right")  # the first span that ends after the token starts
    inside = j < lo.size
    inside &= ends > lo[np.minimum(j, lo.size - 1)]
    return inside


def labels_from_offsets(
    backend: Any, texts: list[str], spans: list[list[tuple[int, int]]]
) -> tuple[Ragged, Ragged]:
    """Ids and labels of rendered ``texts`` from the reference ``tokenizers`` backend (what transformers'
    ``tokenizer(texts, add_special_tokens=False)`` runs), assistant tokens being those whose character offsets
    overlap ``spans``: transformers' own computation, with numpy."""
    enc = backend.encode_batch(texts, add_special_tokens=False)
    ids = ragged.from_lists([e.ids for e in enc])
    n = ids.values.shape[0]
    base = np.zeros(len(texts) + 1, np.int64)
    np.cumsum([len(t) for t in texts], out=base[1:])
    row_of = np.repeat(np.arange(len(texts)), np.diff(ids.offsets))
    flat = np.fromiter((x for e in enc for se in e.offsets for x in se), np.int64, count=2 * n).reshape(n, 2)
    starts, ends = flat[:, 0] + base[row_of], flat[:, 1] + base[row_of]
    lo = np.fromiter((base[i] + a for i, r in enumerate(spans) for a, _ in r), np.int64)
    hi = np.fromiter((base[i] + b for i, r in enumerate(spans) for _, b in r), np.int64)
    inside = overlap_mask(starts, ends, lo, hi)
    return ids, Ragged(ids.offsets, np.where(inside, ids.values, IGNORE_INDEX).astype(np.int32))


def labels_transformers(bt: Any, convs: Conversations, where: Any) -> tuple[Ragged, Ragged]:
    """Ids and labels as transformers gives them: its ``return_assistant_tokens_mask`` with ``{% generation %}``
    markers, else the incremental rule's spans on its renderings and its tokenizer's offsets."""
    if bt.chat.has_generation_tags:
        out = bt.tok.apply_chat_template(
            convs,
            tools=bt.chat.renderer.tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids = ragged.from_lists(out["input_ids"])
        mask = ragged.from_lists(out["assistant_masks"], np.int8)
        return ids, Ragged(ids.offsets, np.where(mask.values != 0, ids.values, IGNORE_INDEX).astype(np.int32))
    texts, spans = incremental_spans(bt.chat.renderer, convs, where)
    return labels_from_offsets(bt.tok.backend_tokenizer, texts, spans)  # (what ``bt.tok(texts)`` runs)


def labels_fast(
    bt: Any, texts: list[str], spans: list[list[tuple[int, int]]]
) -> tuple[Ragged, Ragged] | None:
    """Rendered ``texts`` encoded with the fast engine, assistant tokens marked from byte offsets computed from
    the ids; None when the tokens do not spell the texts byte for byte (then offsets must come from the
    reference tokenizer)."""
    assert bt.fast is not None
    t1 = time.perf_counter()
    if bt.fast.nfc and not all(unicodedata.is_normalized("NFC", t) for t in texts):
        return None  # NFC would move characters: offsets from the ids would not follow this text
    ids = bt.fast.encode(texts, special=False)
    t2 = time.perf_counter()
    token_bytes = bt.fast.token_spans(texts, ids)
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
    inside = overlap_mask(starts, ends, np.asarray(lo, np.int64), np.asarray(hi, np.int64))
    out = ids, Ragged(ids.offsets, np.where(inside, ids.values, IGNORE_INDEX).astype(np.int32))
    seconds = bt.chat_seconds  # where chat time goes (benchmarks/bench_tokenize.py prints it)
    seconds["encode"] += t2 - t1
    seconds["masks"] += time.perf_counter() - t2
    return out
