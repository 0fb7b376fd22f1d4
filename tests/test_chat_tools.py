"""A ``tools`` column (TRL's conversational format) reaches the chat template as ``tools=``, row by row, as TRL
passes it to ``apply_chat_template`` (adversarial-2026-12b U7): never left out."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import build_tokenizer, load

from packtools import PackingError
from packtools.core import unpack
from packtools.pipeline.config import PipelineConfig
from packtools.pipeline.run import run_pipeline

datasets = pytest.importorskip("datasets")

TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools: ' }}{{ tools | tojson }}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tool(name, **props):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


WEATHER = [_tool("get_weather", city={"type": "string"})]
BOOK = [_tool("book", guests={"type": "integer"}), _tool("cancel")]
CONV = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick brown fox"}]
ROWS = [
    (CONV, WEATHER),
    (CONV, BOOK),
    (CONV, None),
    (CONV[:1] + [{"role": "assistant", "content": "four"}], WEATHER),
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tools") / "tok"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tagged_dir(tmp_path_factory):
    """The same template with the assistant turns in {% generation %} markers."""
    template = TOOLS_TEMPLATE.replace(
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}",
        "{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}"
        "{% endif %}{{ '\n' }}",
    )
    assert "generation" in template
    return build_tokenizer(str(tmp_path_factory.mktemp("tools") / "tagged"), template)


def _pack(tmp_path, rows, tok_dir, engine="auto"):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    config = PipelineConfig(max_length=512, tokenizer=tok_dir, strategy="bfd_split", tokenizer_engine=engine)
    res = run_pipeline([str(src)], out, config)
    seqs = unpack(datasets.load_from_disk(out).data.table)
    return res, seqs


@pytest.mark.parametrize("engine", ["auto", "transformers"])
@pytest.mark.parametrize("tags", [False, True])
def test_messages_with_tools_render_as_trl_passes_them(tmp_path, tok_dir, tagged_dir, engine, tags):
    tok_dir = tagged_dir if tags else tok_dir
    res, seqs = _pack(tmp_path, [{"messages": c, "tools": t} for c, t in ROWS], tok_dir, engine)
    assert res.stats["columns_left_out"] == []
    tok = load(tok_dir)
    want = sorted(tok.apply_chat_template(c, tools=t, tokenize=True, return_dict=False) for c, t in ROWS)
    assert sorted(seqs["input_ids"].to_pylist()) == want
    text = "".join(tok.decode(ids) for ids in seqs["input_ids"].to_pylist())
    assert text.count('"get_weather"') == 2 and text.count('"cancel"') == 1
    # the labels are the assistant turns only, with or without tools before them
    for ids, labels in zip(seqs["input_ids"].to_pylist(), seqs["labels"].to_pylist()):
        labelled = tok.decode([i for i, lab in zip(ids, labels) if lab != -100])
        assert "tools" not in labelled and ("fox" in labelled or "four" in labelled)


def test_conversational_prompt_completion_with_tools(tmp_path, tok_dir):
    rows = [{"prompt": c[:1], "completion": c[1:], "tools": t} for c, t in ROWS]
    _, seqs = _pack(tmp_path, rows, tok_dir)
    tok = load(tok_dir)
    want = sorted(tok.apply_chat_template(c, tools=t, tokenize=True, return_dict=False) for c, t in ROWS)
    assert sorted(seqs["input_ids"].to_pylist()) == want


def test_tools_with_a_plain_text_prompt_are_refused(tmp_path, tok_dir):
    rows = [{"prompt": "hello", "completion": " world", "tools": WEATHER}]
    with pytest.raises(PackingError, match="'tools' but a plain-text prompt"):
        _pack(tmp_path, rows, tok_dir)


def test_tools_that_are_not_schemas_are_refused(tmp_path, tok_dir):
    with pytest.raises(PackingError, match="column 'tools' is str"):
        _pack(tmp_path, [{"messages": CONV, "tools": "get_weather"}], tok_dir)


PROMPT, REPLY = CONV[:1], CONV[1:]
KWARGS_ROWS = {
    "messages": {"messages": CONV},
    "prompt_completion": {"prompt": PROMPT, "completion": REPLY},
    "preference": {"prompt": PROMPT, "chosen": REPLY, "rejected": [{"role": "assistant", "content": "no"}]},
}


@pytest.mark.parametrize("fmt", list(KWARGS_ROWS))
def test_chat_template_kwargs_are_refused_not_left_out(tmp_path, tok_dir, fmt):
    """TRL renders a row with its `chat_template_kwargs` (Qwen 3's enable_thinking=False moves the empty think
    block into the untrained prompt); packtools does not pass them, and left out they trained other tokens."""
    rows = [dict(KWARGS_ROWS[fmt], chat_template_kwargs={"enable_thinking": False}), KWARGS_ROWS[fmt]]
    with pytest.raises(PackingError, match="'chat_template_kwargs' column: TRL passes each row's"):
        _pack(tmp_path, rows, tok_dir)


def test_empty_chat_template_kwargs_change_nothing(tmp_path, tok_dir):
    rows = [{"messages": CONV, "chat_template_kwargs": {}}, {"messages": CONV, "chat_template_kwargs": None}]
    res, seqs = _pack(tmp_path, rows, tok_dir)
    assert seqs.num_rows == 2
    assert res.stats["columns_left_out"] == ["chat_template_kwargs"]


def test_template_kwargs_of_null_values_refused_in_parquet_as_in_jsonl(tmp_path, tok_dir):
    """{"enable_thinking": null} on every row: TRL passes enable_thinking=None to the template (a template may
    test `is defined`), and a JSON file of such rows is refused; the same rows in Parquet were left out without
    a word (its footer counts a null field of a set struct as a null)."""
    kwargs = pa.array([{"enable_thinking": None}] * 2, pa.struct([("enable_thinking", pa.bool_())]))
    pq.write_table(
        pa.table({"messages": [CONV] * 2, "chat_template_kwargs": kwargs}), tmp_path / "rows.parquet"
    )
    config = PipelineConfig(max_length=512, tokenizer=tok_dir, strategy="bfd_split")
    with pytest.raises(PackingError, match="'chat_template_kwargs' column: TRL passes each row's"):
        run_pipeline([str(tmp_path / "rows.parquet")], str(tmp_path / "out"), config)
