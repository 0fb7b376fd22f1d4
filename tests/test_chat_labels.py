"""The assistant-token mask (packtools.pipeline.tokenizer.chat.labels.overlap_mask) equals transformers' rule written out
plainly: a token is marked when it overlaps one of the sorted, disjoint spans; and the incremental rule gives it
only such spans (a template whose turns' spans overlap is refused, whichever engine tokenizes)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packtools.errors import PackingError
from packtools.pipeline.tokenizer.batch import BatchTokenizer
from packtools.pipeline.tokenizer.chat.labels import incremental_spans, overlap_mask
from packtools.pipeline.tokenizer.chat.render import ChatRenderer
from packtools.testing import tiny_tokenizer

# renders nothing for a prompt after more than two messages: the prefix before the second assistant turn
# (with the generation prompt) is empty, so that turn's span would start at 0 and hold every earlier message
OVERLAPPING = (
    "{% if add_generation_prompt and messages|length > 2 %}{% else %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% endif %}"
)
CONV = [
    {"role": "user", "content": "aaaaa"},
    {"role": "assistant", "content": "bbbbb"},
    {"role": "user", "content": "cc"},
    {"role": "assistant", "content": "ddd"},
]


def plain_mask(starts, ends, lo, hi):
    return np.array([any(s < b and e > a for a, b in zip(lo, hi)) for s, e in zip(starts, ends)], bool)


def test_overlap_mask_equals_the_plain_rule():
    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(0, 40))
        lengths = rng.integers(0, 4, n)  # empty tokens too (a special token's zero-width offsets)
        starts = (
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
        )
        ends = starts + lengths
        if trial % 4 == 3 and n > 1:  # tokens out of order (offsets as a reference might give them)
            order = rng.permutation(n)
            starts, ends = starts[order], ends[order]
        room = int(lengths.sum()) + 3
        spans = min(int(rng.integers(0, 5)), room // 2)
        cuts = np.sort(rng.choice(np.arange(room), size=2 * spans, replace=False))
        lo, hi = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
        got = overlap_mask(starts, ends, lo, hi)
        assert got.dtype == bool and got.tolist() == plain_mask(starts, ends, lo, hi).tolist(), (
            starts,
            ends,
            lo,
            hi,
        )


def test_a_template_whose_turns_spans_overlap_is_refused():
    renderer = ChatRenderer(OVERLAPPING, {})
    with pytest.raises(PackingError, match="row 0: column 'messages' turn 3: .* render shorter"):
        incremental_spans(renderer, [CONV], lambda i: f"row {i}")
    # control: each prefix is the start of the whole, so only the order of the spans is wrong
    full = renderer.render(CONV, False)
    assert all(full.startswith(renderer.render(CONV[:k], p)) for k in (1, 2, 3) for p in (False, True))
    assert incremental_spans(renderer, [CONV[:2]], str)[1] == [[(5, 10)]]  # one turn: its span, as before


@pytest.mark.parametrize("engine", ["auto", "transformers"])
def test_overlapping_turns_train_no_user_text_on_either_engine(tmp_path, engine):
    """The span of turn 3 would hold the user's messages (every engine labelled 'cc', and transformers' path
    'aaaaa' too): refused instead, naming the row and the turn."""
    bt = BatchTokenizer(tiny_tokenizer(str(tmp_path), OVERLAPPING), "messages", engine=engine)
    with pytest.raises(PackingError, match="row 0: column 'messages' turn 3"):
        bt(pa.table({"messages": [CONV]}))


PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a namespace set in the loop: not the one-render shape, every prefix rendered
NOT_LOCAL = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}<|im_start|>{{ m['role'] }}"
    "\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("engine", ["auto", "transformers"])
@pytest.mark.parametrize("template", [PLAIN_CHATML, NOT_LOCAL], ids=["one-render", "prefixes"])
def test_a_conversation_opening_with_an_assistant_turn_names_the_cause(tmp_path, template, engine):
    """adv46: without {% generation %} markers, a conversation whose first message is the assistant's was
    refused as 'an empty conversation has no chat rendering', which it is not: the error now says that the
    first turn has no messages before it and what to do."""
    bt = BatchTokenizer(tiny_tokenizer(str(tmp_path), template), "messages", engine=engine)
    first = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    with pytest.raises(
        PackingError, match=r"row 1: column 'messages' turn 0: .*opens with an assistant turn"
    ):
        bt(pa.table({"messages": [CONV, first]}))
    assert "generation" in str(incremental_spans_error(template, first))
    # control: the same turns after a system message are labelled
    out = bt(pa.table({"messages": [[{"role": "system", "content": "s"}, *first]]}))
    assert any(x != -100 for x in out.column("labels")[0].as_py())


def incremental_spans_error(template, conv):
    with pytest.raises(ValueError) as err:
        incremental_spans(ChatRenderer(template, {}), [conv], lambda i: f"row {i}")
    return err.value
