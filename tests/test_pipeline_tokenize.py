"""Tokenization formats: EOS, prompt-completion and chat label masks, preference truncation and filtering."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import (
    CHATML_GENERATION,
    CHATML_PLAIN,
    CHATML_UNSTABLE,
    EOS,
    IM_END,
    build_tokenizer,
    load,
)

from packtools import PackingError, unpack
from packtools.core.ragged import from_lists, to_lists
from packtools.pipeline.preference import fit_preference
from packtools.pipeline.run import PipelineConfig, run_pipeline
from packtools.pipeline.tokenize import IGNORE_INDEX, BatchTokenizer, detect_format

datasets = pytest.importorskip("datasets")

CONVS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and hello?"},
        {"role": "assistant", "content": "hello world"},
    ],
    [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps over the lazy dog"},
    ],
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {
        name: build_tokenizer(str(root / name), template)
        for name, template in [
            ("generation", CHATML_GENERATION),
            ("plain", CHATML_PLAIN),
            ("unstable", CHATML_UNSTABLE),
        ]
    }


def labeled_text(tok, ids, labels):
    """The decoded tokens that carry a label, with the unlabeled runs between them as '|'."""
    out, run = [], []
    for i, lab in zip(ids, labels):
        if lab == IGNORE_INDEX:
            if run:
                out.append(tok.decode(run))
                run = []
        else:
            assert lab == i  # labels are the token ids themselves where set
            run.append(i)
    if run:
        out.append(tok.decode(run))
    return "|".join(out)


def test_detect_format():
    assert detect_format(["messages"]) == "messages"
    assert detect_format(["prompt", "completion", "id"]) == "prompt_completion"
    assert detect_format(["input_ids", "text"]) == "tokenized"
    with pytest.raises(PackingError, match="format=") as err:
        detect_format(["body"])
    assert err.value.param == "format"


def test_text_gets_one_eos(toks):
    bt = BatchTokenizer(toks["plain"], "text")
    tok = load(toks["plain"])
    out = bt(pa.table({"text": ["hello world", "hello world" + EOS, ""]}))
    ids = out.column("input_ids").to_pylist()
    assert ids[0] == tok("hello world")["input_ids"] + [tok.eos_token_id]
    assert ids[1] == ids[0]  # already ends with EOS: not doubled
    assert ids[2] == [tok.eos_token_id]
    no_eos = BatchTokenizer(toks["plain"], "text", add_eos=False)(pa.table({"text": ["hello world"]}))
    assert no_eos.column("input_ids").to_pylist() == [tok("hello world")["input_ids"]]


def test_prompt_completion_labels_only_the_completion(toks):
    tok = load(toks["plain"])
    table = pa.table({"prompt": ["what is two plus two?", "hello"], "completion": [" four", " world"]})
    out = BatchTokenizer(toks["plain"], "prompt_completion")(table)
    for row, (p, c) in enumerate(zip(table["prompt"].to_pylist(), table["completion"].to_pylist())):
        ids = out["input_ids"][row].as_py()
        labels = out["labels"][row].as_py()
        n_prompt = len(tok(p)["input_ids"])
        completion = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids == tok(p)["input_ids"] + completion
        assert labels == [IGNORE_INDEX] * n_prompt + completion


def test_conversational_prompt_completion(toks):
    tok = load(toks["plain"])
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "what is two plus two?"}]],
            "completion": [[{"role": "assistant", "content": "four"}]],
        }
    )
    out = BatchTokenizer(toks["plain"], "prompt_completion")(table)
    ids, labels = out["input_ids"][0].as_py(), out["labels"][0].as_py()
    assert tok.decode(ids) == tok.apply_chat_template(
        [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four"}],
        tokenize=False,
    )
    assert labeled_text(tok, ids, labels) == "four" + IM_END + "\n"


@pytest.mark.parametrize("template, tail", [("generation", ""), ("plain", "\n")])
def test_chat_labels_cover_assistant_turns_only(toks, template, tail):
    """With {% generation %} markers (transformers' mask) or by incremental rendering (no markers)."""
    tok = load(toks[template])
    out = BatchTokenizer(toks[template], "messages")(pa.table({"messages": CONVS}))
    for row, conv in enumerate(CONVS):
        ids, labels = out["input_ids"][row].as_py(), out["labels"][row].as_py()
        assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)
        expected = "|".join(m["content"] + IM_END + tail for m in conv if m["role"] == "assistant")
        assert labeled_text(tok, ids, labels) == expected


def test_both_chat_mask_methods_agree_on_content(toks):
    gen = BatchTokenizer(toks["generation"], "messages")(pa.table({"messages": CONVS}))
    plain = BatchTokenizer(toks["plain"], "messages")(pa.table({"messages": CONVS}))
    # same vocabulary and rendering; only the template's generation tags differ
    assert gen["input_ids"].equals(plain["input_ids"])
    g = np.concatenate([np.asarray(x.as_py()) for x in gen["labels"]])
    p = np.concatenate([np.asarray(x.as_py()) for x in plain["labels"]])
    assert np.all((g == IGNORE_INDEX) | (g == p))  # every marked token is also found incrementally


def test_unstable_template_is_refused_with_the_row(toks):
    bt = BatchTokenizer(toks["unstable"], "messages")
    with pytest.raises(PackingError, match=r"row 7: column .messages. turn 2.*generation"):
        bt(pa.table({"messages": [CONVS[0]]}), 7)


def test_chat_end_to_end_packs_labels_alongside(tmp_path, toks):
    src = tmp_path / "chat.jsonl"
    rows = [{"messages": c} for c in CONVS * 5] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    res = run_pipeline([str(src)], out, PipelineConfig(max_length=128, tokenizer=toks["generation"]))
    assert res.stats["format"] == "messages"
    assert res.stats["rows_unlabeled"] == 1  # the conversation without an assistant turn: kept and counted
    assert res.stats["sequences_packed"] == 11
    res = run_pipeline(
        [str(src)], out, PipelineConfig(max_length=128, tokenizer=toks["generation"], drop_unlabeled=True)
    )
    assert res.stats["rows_dropped_unlabeled"] == 1 and res.stats["sequences_packed"] == 10
    table = datasets.load_from_disk(out).data.table
    assert table.column_names == ["input_ids", "labels", "seq_lengths"]
    seqs = unpack(table)
    assert seqs.num_rows == 10
    tok = load(toks["generation"])
    for ids, labels in zip(seqs["input_ids"].to_pylist(), seqs["labels"].to_pylist()):
        assert len(ids) == len(labels)
        assert "four" in labeled_text(tok, ids, labels) or "lazy dog" in labeled_text(tok, ids, labels)
        assert "two plus two" not in labeled_text(tok, ids, labels)


def test_truncation_can_leave_a_chat_without_labels(tmp_path, toks):
    conv = [
        {"role": "user", "content": "the quick brown fox " * 10},
        {"role": "assistant", "content": "four"},
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": CONVS[1]}) + "\n")
    tok = load(toks["plain"])
    lengths = [
        len(tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
        for c in (conv, CONVS[1])
    ]
    assert lengths[0] > 24 >= lengths[1]
    res = run_pipeline(
        [str(src)], str(tmp_path / "o"), PipelineConfig(max_length=24, tokenizer=toks["plain"])
    )
    assert res.stats["rows_truncated"] == 1
    assert res.stats["rows_unlabeled"] == 1  # the first one's answer lies past max_length: kept, counted
    assert res.stats["sequences_packed"] == 2 and res.stats["tokens_kept"] == 24 + lengths[1]
    res = run_pipeline(
        [str(src)],
        str(tmp_path / "o"),
        PipelineConfig(max_length=24, tokenizer=toks["plain"], drop_unlabeled=True),
    )
    assert res.stats["rows_dropped_unlabeled"] == 1
    assert res.stats["sequences_packed"] == 1 and res.stats["tokens_kept"] == lengths[1]


def test_fit_preference_keeps_prompt_end_and_completion_start():
    prompt = from_lists([[1, 2, 3, 4, 5, 6], [1, 2]])
    chosen = from_lists([[10, 11, 12, 13, 14], [10]])
    rejected = from_lists([[20], [20, 21, 22, 23, 24, 25, 26, 27]])
    cols, keep, counts = fit_preference(prompt, chosen, rejected, 8, "truncate", max_prompt_length=4)
    assert [to_lists(c) for c in cols] == [
        [[3, 4, 5, 6], [1, 2]],
        [[10, 11, 12, 13], [10]],
        [[20], [20, 21, 22, 23, 24, 25]],
    ]
    assert counts == {
        "prompts_truncated": 1,
        "chosen_truncated": 1,
        "rejected_truncated": 1,
        "tokens_dropped": 2 + 1 + 2,
    }
    cols, keep, counts = fit_preference(prompt, chosen, rejected, 8, "drop")
    assert keep.tolist() == [False, False] and counts["pairs_dropped"] == 2
    cols, keep, counts = fit_preference(prompt, chosen, rejected, 10, "drop")  # 6 + 5 > 10, 2 + 8 <= 10
    assert (
        keep.tolist() == [False, True]
        and to_lists(cols[0]) == [[1, 2]]
        and to_lists(cols[2]) == [list(range(20, 28))]
    )


def test_preference_end_to_end_counts(tmp_path, toks):
    tok = load(toks["plain"])
    rows = {
        "prompt": ["what is two plus two? " * k for k in (1, 2, 6)],
        "chosen": ["four", "four " * 8, "four"],
        "rejected": ["five", "five", "five"],
    }
    src = str(tmp_path / "pref.parquet")
    pq.write_table(pa.table(rows), src)
    lp = [len(tok(p)["input_ids"]) for p in rows["prompt"]]
    lc = [len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for c in rows["chosen"]]
    lr = [len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for c in rows["rejected"]]
    max_length = 24
    res = run_pipeline(
        [src], str(tmp_path / "t"), PipelineConfig(max_length=max_length, tokenizer=toks["plain"])
    )
    budget = max_length // 2
    assert res.stats["prompts_truncated"] == sum(n > budget for n in lp)
    assert res.stats["chosen_truncated"] == sum(c > max_length - min(p, budget) for p, c in zip(lp, lc))
    assert res.stats["rows_out"] == 3 and res.stats["packed"] is False
    ds = datasets.load_from_disk(str(tmp_path / "t"))
    assert ds.column_names == ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    full = tok(rows["prompt"][2])["input_ids"]
    assert ds[2]["prompt_input_ids"] == full[-budget:]  # the prompt keeps its end
    for r in ds:
        assert (
            len(r["prompt_input_ids"]) + max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"]))
            <= max_length
        )
    res = run_pipeline(
        [src],
        str(tmp_path / "d"),
        PipelineConfig(max_length=max_length, tokenizer=toks["plain"], overlong="drop"),
    )
    too_long = sum(p + max(c, r) > max_length for p, c, r in zip(lp, lc, lr))
    assert too_long >= 1
    assert res.stats["pairs_dropped"] == too_long and res.stats["rows_out"] == 3 - too_long


@pytest.mark.slow
def test_num_proc_gives_the_same_output(tmp_path, toks):
    src = tmp_path / "data.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"hello world {i} " * (i % 5 + 1)}) + "\n" for i in range(3000))
    )
    one = run_pipeline(
        [str(src)], str(tmp_path / "a"), PipelineConfig(max_length=64, tokenizer=toks["plain"])
    )
    two = run_pipeline(
        [str(src)], str(tmp_path / "b"), PipelineConfig(max_length=64, tokenizer=toks["plain"]), num_proc=2
    )
    assert one.manifest["fingerprint"] == two.manifest["fingerprint"]
    a = datasets.load_from_disk(str(tmp_path / "a")).data.table
    b = datasets.load_from_disk(str(tmp_path / "b")).data.table
    assert a.equals(b)
