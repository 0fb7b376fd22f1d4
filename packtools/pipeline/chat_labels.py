"""Token ids and assistant-only labels of chat conversations, by transformers or by the fast engine.

Two marking rules, both transformers': with ``{% generation %}`` markers in the template, a token is an
assistant token when it overlaps a marked span (``return_assistant_tokens_mask``); without them, assistant turn
``i`` spans the characters between the rendering of messages ``[:i]`` with the generation prompt and the
rendering of messages ``[:i + 1]``, and a token is an assistant token when it overlaps such a span too (the same
rule as with markers, so a plain template and a copy with markers around the same text give the same labels: a
token that starts in the assistant header and runs into the turn, e.g. ``"\n\n"``, is the turn's).  The
fast path computes token byte offsets from the ids (each byte-level token spells its bytes) instead of asking
transformers for offsets.  With an NFC normalizer it does so for batches whose rendered text is already NFC;
other batches go to transformers.

>>> bool(GENERATION_TAG.search("{% generation %}{{ m['content'] }}{% endgeneration %}"))
True
"""

from __future__ import annotations

import re
import time
import unicodedata
from typing import Any

import numpy as np

from ..constants import IGNORE_INDEX
from ..core import ragged
from ..core.ragged import Ragged
from ..errors import PackingError

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
Conversations = list[list[dict[str, Any]]]


def render(tok: Any, tokenizer_dir: str, conv: list[dict[str, Any]], generation_prompt: bool) -> str:
    if not tok.chat_template:
        raise PackingError(
            f"conversational data needs a chat template, and the tokenizer in {tokenizer_dir!r} has "
            f"none; add one (tokenizer.chat_template = ...; save_pretrained) or pass plain strings."
        )
    return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)


def incremental_spans(
    bt: Any, convs: Conversations, where: Any
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Rendered conversations and the character span of every assistant turn (incremental rendering);
    ``where(i)`` names conversation ``i`` in errors."""
    texts, spans = [], []
    for i, conv in enumerate(convs):
        full = render(bt.tok, bt.tokenizer_dir, conv, False)
        row_spans = []
        for turn, message in enumerate(conv):
            if message.get("role") != "assistant":
                continue
            start = render(bt.tok, bt.tokenizer_dir, conv[:turn], True)
            end = render(bt.tok, bt.tokenizer_dir, conv[: turn + 1], False)
            if not (end.startswith(start) and full.startswith(end)):
                raise PackingError(
                    f"{where(i)}: column 'messages' turn {turn}: the chat template does not render "
                    f"conversations incrementally (a prefix renders differently from the start of the whole), "
                    f"so assistant tokens cannot be located; use a template with {{% generation %}} markers."
                )
            row_spans.append((len(start), len(end)))
        texts.append(full)
        spans.append(row_spans)
    return texts, spans


def labels_transformers(bt: Any, convs: Conversations, where: Any) -> tuple[Ragged, Ragged]:
    """Ids and labels as transformers gives them."""
    if bt.has_generation_tags:
        out = bt.tok.apply_chat_template(
            convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = ragged.from_lists(out["input_ids"])
        mask = ragged.from_lists(out["assistant_masks"], np.int8)
        return ids, Ragged(ids.offsets, np.where(mask.values != 0, ids.values, IGNORE_INDEX).astype(np.int32))
    texts, spans = incremental_spans(bt, convs, where)
    enc = bt.tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids = ragged.from_lists(enc["input_ids"])
    n = ids.values.shape[0]
    starts = np.fromiter((s for offsets in enc["offset_mapping"] for s, _ in offsets), np.int64, count=n)
    ends = np.fromiter((e for offsets in enc["offset_mapping"] for _, e in offsets), np.int64, count=n)
    labels = np.full(n, IGNORE_INDEX, np.int32)
    for i, row_spans in enumerate(spans):
        lo, hi = int(ids.offsets[i]), int(ids.offsets[i + 1])
        row_starts, row_ends = starts[lo:hi], ends[lo:hi]
        for a, b in row_spans:
            sel = (row_starts < b) & (row_ends > a)  # overlaps the turn
            labels[lo:hi][sel] = ids.values[lo:hi][sel]
    return ids, Ragged(ids.offsets, labels)


def labels_fast(bt: Any, convs: Conversations, where: Any) -> tuple[Ragged, Ragged] | None:
    """Render, encode with the fast engine, and mark assistant tokens from byte offsets computed from the ids;
    None when the tokens do not spell the rendered text byte for byte (then offsets must come from transformers)."""
    assert bt.fast is not None
    t0 = time.perf_counter()
    if bt.has_generation_tags:
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=convs,
            chat_template=bt.tok.get_chat_template(),
            return_assistant_tokens_mask=True,
            **bt.tok.special_tokens_map,
        )
    else:
        texts, spans = incremental_spans(bt, convs, where)
    if bt.fast.nfc and not all(unicodedata.is_normalized("NFC", t) for t in texts):
        return None  # NFC would move characters: offsets from the ids would not follow this text
    t1 = time.perf_counter()
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
    lo_a, hi_a = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if lo_a.size:
        j = np.searchsorted(hi_a, starts, side="right")  # the first span that ends after the token starts
        inside = j < lo_a.size
        jj = np.minimum(j, lo_a.size - 1)
        inside &= ends > lo_a[jj]  # overlaps the span (both rules; see the module docstring)
    else:
        inside = np.zeros(starts.shape[0], bool)
    out = ids, Ragged(ids.offsets, np.where(inside, ids.values, IGNORE_INDEX).astype(np.int32))
    seconds = bt.chat_seconds  # where chat time goes (benchmarks/bench_tokenize.py prints it)
    seconds["render"] += t1 - t0
    seconds["encode"] += t2 - t1
    seconds["masks"] += time.perf_counter() - t2
    return out
