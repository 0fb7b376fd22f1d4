"""Chat cells reach the template as the input wrote them (adversarial-2026-12b S8, U8; review F12): nested
``messages`` / ``prompt`` / ``completion`` values of JSON input keep their own keys and types (Arrow's JSON
inference would unify them across rows), values are made plain as transformers makes them, and the packed ids
equal ``apply_chat_template`` on the same rows as Python objects."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pyarrow as pa
import pytest
from _pipeline_data import build_tokenizer, load

from packtools.core import unpack
from packtools.io.json import iter_json_array, iter_json_lines
from packtools.io.json_cells import cells
from packtools.pipeline.config import PipelineConfig
from packtools.pipeline.run import run_pipeline
from packtools.pipeline.tokenizer.chat.tokens import clean_messages, plain_value

datasets = pytest.importorskip("datasets")

# Renders tool calls with tojson, content parts by `'code' in p`, and any other message value as it is.  (The part
# with its own key was an image part; a text tokenizer refuses those now: the images would be lost.  Any key
# that one part has and the others lack shows Arrow's unification the same way.)
TYPED_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}"
    "{% if 'code' in p %}<code>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "{% if m['when'] is defined %} at {{ m['when'] | tojson }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _call(name, arguments):
    return {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


# Rows whose nested values differ in keys and types from row to row (S8's reproduction, and more).
ROWS = [
    [{"role": "user", "content": "weather?"}, _call("get_weather", {"city": "Paris"})],
    [{"role": "user", "content": "book two"}, _call("book", {"guests": 2, "price": 10})],
    [{"role": "user", "content": "book three"}, _call("book", {"guests": 3, "price": 12.5})],
    [{"role": "user", "content": "my order"}, _call("order", {"order_id": 12345678901234567890})],
    [
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red, green, blue"}]},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "code": "cat = 1"}, {"type": "text", "text": "what is it?"}],
        },
        {"role": "assistant", "content": "a cat"},
    ],
    [
        {"role": "user", "content": "when?", "when": "2024-01-02 10:00:00"},
        {"role": "assistant", "content": "then"},
    ],
]
TOOL_CALLS = ROWS[:4]
PARTS = [  # content as parts in every row, so Arrow reads the file (and unifies the parts)
    ROWS[4],
    [
        {
            "role": "user",
            "content": [{"type": "text", "code": "cat = 1"}, {"type": "text", "text": "what is it?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
    ],
]
DATES = [  # date-like strings in every row: Arrow would read them as timestamps
    [
        {"role": "user", "content": "when?", "when": "2024-01-02 10:00:00"},
        {"role": "assistant", "content": "then"},
    ],
    [
        {"role": "user", "content": "and?", "when": "2025-03-04 05:06:07"},
        {"role": "assistant", "content": "now"},
    ],
]
GROUPS = {"mixed": ROWS, "tool_calls": TOOL_CALLS, "parts": PARTS, "dates": DATES}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("typed") / "tok"), TYPED_TEMPLATE)


def _expected(tok_dir, convs):
    tok = load(tok_dir)
    return sorted(tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in convs)


def _packed(tmp_path, src, tok_dir):
    out = str(tmp_path / "out")
    run_pipeline([str(src)], out, PipelineConfig(max_length=512, tokenizer=tok_dir, strategy="bfd_split"))
    seqs = unpack(datasets.load_from_disk(out).data.table)
    return sorted(seqs["input_ids"].to_pylist())


@pytest.mark.parametrize("layout", ["jsonl", "json"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_typed_chat_rows_render_as_apply_chat_template(tmp_path, tok_dir, layout, group):
    rows = GROUPS[group]
    src = tmp_path / f"rows.{layout}"
    objs = [{"messages": c} for c in rows]
    if layout == "jsonl":
        src.write_text("".join(json.dumps(o) + "\n" for o in objs))
    else:
        src.write_text(json.dumps(objs))
    got = _packed(tmp_path, src, tok_dir)
    assert got == _expected(tok_dir, rows)
    text = "".join(load(tok_dir).decode(ids) for ids in got)
    pieces = {
        "tool_calls": ['{"city": "Paris"}', '"price": 10}', "12345678901234567890"],
        "parts": ["what is it?", "Name three colours.", "red, green, blue"],
        "dates": ['"2024-01-02 10:00:00"'],
    }
    for piece in pieces.get(group, []):
        assert piece in text
    assert "null" not in text and "10.0" not in text


@pytest.mark.parametrize("group", ["tool_calls", "parts", "dates"])
def test_json_lines_keep_each_rows_own_values(tmp_path, group):
    rows = GROUPS[group]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(rows)))
    ((_, table),) = list(iter_json_lines(str(src)))
    assert cells(table, "messages") == rows  # keys, ints, 20-digit ints and strings as written
    assert table.column("id").to_pylist() == list(range(len(rows)))  # other columns: Arrow's, untouched
    # the negative control: Arrow's own reading of the same lines changes them
    import pyarrow.json as pj

    assert pj.read_json(str(src)).column("messages").to_pylist() != rows


def test_json_array_keeps_each_rows_own_values(tmp_path):
    src = tmp_path / "a.json"
    src.write_text(json.dumps([{"prompt": c[:1], "completion": c[1:]} for c in ROWS]))
    ((_, table),) = list(iter_json_array(str(src)))
    assert cells(table, "prompt") == [c[:1] for c in ROWS]
    assert cells(table, "completion") == [c[1:] for c in ROWS]


def test_plain_strings_stay_strings(tmp_path):
    """A plain-text column is not taken for JSON: a prompt that reads like JSON stays the string it is."""
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"prompt": '{"a": 1}', "completion": "[1]"}) + "\n")
    ((_, table),) = list(iter_json_lines(str(src)))
    assert cells(table, "prompt") == ['{"a": 1}'] and cells(table, "completion") == ["[1]"]
    assert pa.types.is_string(table.schema.field("prompt").type)


def test_message_values_are_made_plain_as_transformers_does():
    from transformers.utils.chat_template_utils import _plain_template_data

    values = [
        datetime.datetime(2024, 1, 2, 10),
        np.float32(0.5),
        np.int64(7),
        np.bool_(False),
        {"a": (1, np.int8(2))},
        [b"raw"],
        True,
        "s",
    ]
    for v in values:
        assert plain_value(v) == _plain_template_data(v)
    conv = [{"role": "user", "content": "hi", "when": datetime.date(2024, 1, 2), "n": np.int64(3), "x": None}]
    assert clean_messages(conv, "messages", 0) == [
        {"role": "user", "content": "hi", "when": "<date>", "n": 3}
    ]


def test_timestamp_cells_render_as_transformers_renders_them(tok_dir):
    """A message value Arrow holds as a timestamp (parquet input) renders as transformers renders it (its
    placeholder), not as Python's str of a datetime."""
    from packtools.pipeline.tokenizer.batch import BatchTokenizer

    conv = [
        {"role": "user", "content": "when?", "when": datetime.datetime(2024, 1, 2, 10)},
        {"role": "assistant", "content": "then", "when": datetime.datetime(2024, 1, 3)},
    ]
    table = pa.table({"messages": [conv]})
    assert pa.types.is_timestamp(table.schema.field("messages").type.value_type.field("when").type)
    got = BatchTokenizer(tok_dir, "messages")(table).column("input_ids").to_pylist()
    assert got == [load(tok_dir).apply_chat_template(conv, tokenize=True, return_dict=False)]


def _floats(value):
    """What Arrow's unification did to numbers: every int a float."""
    if isinstance(value, bool) or not isinstance(value, (int, dict, list)):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    return [_floats(v) for v in value]


class _IntsAsFloats:
    """A renderer that changes typed values on the way to the template (the kind of change S8 was)."""

    def __init__(self, inner):
        self.inner = inner

    def render(self, conv, prompt):
        return self.inner.render(_floats(conv), prompt)


def test_render_proof_covers_typed_values_tool_calls_and_parts(tok_dir):
    """The renderer's proof includes typed values, tool calls and content lists: a renderer that changes them is
    told apart from transformers' there, not on the plain adversarial conversations alone."""
    from packtools.pipeline.tokenizer import adversarial
    from packtools.pipeline.tokenizer.chat.render import ChatRenderer, read_settings
    from packtools.pipeline.tokenizer.chat.tokens import (
        TYPED_CONVERSATIONS,
        TransformersRenderer,
        render_difference,
    )

    template, specials = read_settings(tok_dir)
    mine, theirs = ChatRenderer(template, specials), TransformersRenderer(load(tok_dir))
    plain = adversarial.adversarial_conversations(adversarial.adversarial_texts(list(specials.values())))
    assert render_difference(mine, theirs, plain + TYPED_CONVERSATIONS, False) is None
    wrong = _IntsAsFloats(mine)
    assert render_difference(wrong, theirs, plain, False) is None  # the old proof set cannot see it
    assert render_difference(wrong, theirs, TYPED_CONVERSATIONS, False).startswith("messages[:3] of ")


def test_conversational_preference_rows_keep_their_own_values(tmp_path, tok_dir):
    """prompt / chosen / rejected cells of one JSON line each keep their own keys and types (three columns read
    from the same row's line)."""
    from packtools.pipeline.tokenizer.batch import BatchTokenizer

    rows = [
        {"prompt": c[:1], "chosen": c[1:], "rejected": [{"role": "assistant", "content": "no idea"}]}
        for c in TOOL_CALLS
    ]
    src = tmp_path / "pref.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ((_, table),) = list(iter_json_lines(str(src)))
    out = BatchTokenizer(tok_dir, "preference")(table).to_pydict()
    tok = load(tok_dir)
    for i, r in enumerate(rows):
        for side in ("chosen", "rejected"):
            want = tok.apply_chat_template(r["prompt"] + r[side], tokenize=True, return_dict=False)
            assert out["prompt_input_ids"][i] + out[f"{side}_input_ids"][i] == want


def test_a_row_without_messages_is_named_as_such(tmp_path, tok_dir):
    """A JSON-lines file whose rows mix text and chat (one row {"text": ...}, the next {"messages": [...]}) is
    chat data by its columns; the text row was refused as 'not a list of messages (every message with a
    role)', which reads as a malformed conversation. Now the error says the row has no 'messages'."""
    from packtools import PackingError

    src = tmp_path / "mixed.jsonl"
    src.write_text(
        json.dumps({"text": "plain"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    with pytest.raises(
        PackingError, match=r"line 1: column 'messages' is null \(the row has no 'messages'\)"
    ):
        run_pipeline([str(src)], str(tmp_path / "o"), PipelineConfig(max_length=64, tokenizer=tok_dir))
    with pytest.raises(PackingError, match=r"row 3: column 'messages' is null"):
        clean_messages(None, "messages", 3)
