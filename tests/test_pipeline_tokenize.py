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

from packtools import PackingError
from packtools.constants import IGNORE_INDEX
from packtools.core import unpack
from packtools.pipeline.config import PipelineConfig
from packtools.pipeline.formats import detect_format
from packtools.pipeline.run import run_pipeline
from packtools.pipeline.tokenizer.batch import BatchTokenizer

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


def test_detect_format_refuses_kto_rows_rather_than_training_every_completion():
    # KTO's unpaired rows guessed as prompt_completion would train the undesirable completions (label false) too
    with pytest.raises(PackingError, match="KTO.*label false.*format='prompt_completion'") as err:
        detect_format(["prompt", "completion", "label"])
    assert err.value.param == "format"
    assert detect_format(["prompt", "completion", "id"]) == "prompt_completion"
    assert detect_format(["text", "label"]) == "text"  # a classification set's text: not KTO


@pytest.mark.parametrize(
    "raw", [{"messages": CONVS[1]}, {"prompt": "hi", "completion": " yo"}, {"text": "hello"}]
)
def test_input_ids_beside_raw_columns_are_packed_not_replaced(tmp_path, toks, raw):
    """A dataset the user tokenized (``input_ids`` + ``labels``) that kept its raw columns is tokenized data,
    as TRL takes it: before, ``messages`` or ``prompt``/``completion`` beside ``input_ids`` won the detection,
    and a run with a tokenizer silently replaced the user's ids and labels by a new tokenization (without one,
    it was refused as "--format 'messages' needs a tokenizer")."""
    row = {**raw, "input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(row) + "\n")
    assert detect_format(list(row)) == "tokenized"
    res = run_pipeline([str(src)], str(tmp_path / "o"), PipelineConfig(max_length=16))
    assert res.stats["format"] == "tokenized"
    assert datasets.load_from_disk(str(tmp_path / "o"))[0] == {
        "input_ids": [5, 6, 7, 8],
        "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8],
        "seq_lengths": [4],
    }
    # a tokenizer given with it is refused, naming the format that tokenizes the raw columns instead
    with pytest.raises(PackingError, match=r"format='(messages|prompt_completion|text)' to tokenize") as err:
        run_pipeline([str(src)], str(tmp_path / "o2"), PipelineConfig(max_length=16, tokenizer=toks["plain"]))
    assert err.value.param == "tokenizer"
    # and that format, chosen, tokenizes them
    fmt = detect_format(list(raw))
    res = run_pipeline(
        [str(src)], str(tmp_path / "o3"), PipelineConfig(max_length=64, tokenizer=toks["plain"], format=fmt)
    )
    assert res.stats["format"] == fmt
    assert datasets.load_from_disk(str(tmp_path / "o3"))[0]["input_ids"] != [5, 6, 7, 8]


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


@pytest.mark.parametrize("fmt", ["prompt_completion", "preference"])
def test_a_completion_ending_with_eos_gets_no_second_one(toks, fmt):
    """adv46: a string completion that already ends with the EOS token got a second EOS (trained: EOS predicts
    EOS); TRL's add_eos (SFT, DPO, KTO) appends it only to a completion that does not end with it."""
    tok = load(toks["plain"])
    eos = tok.eos_token
    names = ["completion"] if fmt == "prompt_completion" else ["chosen", "rejected"]
    values = {"prompt": ["hello", "hi"], **{n: [f" world{eos}", " there"] for n in names}}
    out = BatchTokenizer(toks["plain"], fmt)(pa.table(values))
    for row in range(2):
        prompt = tok(values["prompt"][row])["input_ids"]
        for n in names:
            # TRL: the string with eos_token appended unless it ends with it, tokenized without special tokens
            text = values[n][row] if values[n][row].endswith(eos) else values[n][row] + eos
            want = tok(text, add_special_tokens=False)["input_ids"]
            assert want[-1] == tok.eos_token_id and want[-2] != tok.eos_token_id
            if fmt == "prompt_completion":
                assert out["input_ids"][row].as_py() == prompt + want
            else:
                assert out["prompt_input_ids"][row].as_py() == prompt
                assert out[f"{n}_input_ids"][row].as_py() == want


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


def test_preference_end_to_end_packs_pairs_whole(tmp_path, toks):
    """`packtools pack --format preference` writes packed pair rows: [prompt + chosen][prompt + rejected] per
    pair, never split, each pair fitted to max_length (the prompt keeps its end)."""
    from packtools.core.pairs import fit_pairs

    tok = load(toks["plain"])
    rows = {
        "prompt": ["what is two plus two? " * k for k in (1, 2, 6)],
        "chosen": ["four", "four " * 8, "four"],
        "rejected": ["five", "five", "five"],
    }
    src = str(tmp_path / "pref.parquet")
    pq.write_table(pa.table(rows), src)
    prompts = [tok(p)["input_ids"] for p in rows["prompt"]]
    chosen = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in rows["chosen"]]
    rejected = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in rows["rejected"]]
    lp, lc, lr = ([len(x) for x in col] for col in (prompts, chosen, rejected))
    max_length = 48
    res = run_pipeline(
        [src], str(tmp_path / "t"), PipelineConfig(max_length=max_length, tokenizer=toks["plain"])
    )
    fitted = fit_pairs(np.array(lp), np.array(lc), np.array(lr), max_length)
    assert res.stats["packed"] is True and res.stats["pairs_out"] == 3
    assert res.stats["prompts_truncated"] == int((fitted.prompt_keep < np.array(lp)).sum()) >= 1
    ds = datasets.load_from_disk(str(tmp_path / "t"))
    assert ds.column_names == ["input_ids", "completion_mask", "seq_lengths"]
    sequences = []
    for r in ds:
        assert len(r["input_ids"]) <= max_length and len(r["seq_lengths"]) % 2 == 0
        start = 0
        for n in r["seq_lengths"]:
            sequences.append((r["input_ids"][start : start + n], r["completion_mask"][start : start + n]))
            start += n
    expected = []
    for i in range(3):
        kp, kc, kr = int(fitted.prompt_keep[i]), int(fitted.chosen_keep[i]), int(fitted.rejected_keep[i])
        prompt = prompts[i][len(prompts[i]) - kp :]  # the prompt keeps its end
        expected.append((prompt + chosen[i][:kc], [0] * kp + [1] * kc))
        expected.append((prompt + rejected[i][:kr], [0] * kp + [1] * kr))
    pairs = sorted(zip(sequences[0::2], sequences[1::2]))
    assert pairs == sorted(zip(expected[0::2], expected[1::2]))
    res = run_pipeline(
        [src],
        str(tmp_path / "d"),
        PipelineConfig(max_length=max_length, tokenizer=toks["plain"], overlong="drop"),
    )
    too_long = sum(2 * p + c + r > max_length for p, c, r in zip(lp, lc, lr))
    assert too_long >= 1
    assert res.stats["pairs_dropped"] == too_long and res.stats["pairs_out"] == 3 - too_long


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


def test_input_in_which_nothing_trains_is_refused(tmp_path, toks):
    """Chat rows whose roles no template calls 'assistant' (ShareGPT's 'human' / 'gpt') have no trained token:
    the run packed them with status 0, no warning (a summary line under --quiet was all), into rows that train
    nothing. Now it stops naming the cause; rows without a trained token beside rows with one are still kept
    and counted."""
    src = tmp_path / "sharegpt.jsonl"
    convs = [[{"role": "human", "content": f"q{i}"}, {"role": "gpt", "content": f"a{i}"}] for i in range(4)]
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    config = PipelineConfig(max_length=128, tokenizer=toks["plain"])
    with pytest.raises(PackingError, match=r"has a trained token .* check the roles \(ShareGPT's 'human'"):
        run_pipeline([str(src)], str(tmp_path / "o"), config)
    assert not (tmp_path / "o").exists()
    # tokenized labels all -100: the same refusal, in its own words
    tok_src = tmp_path / "tok.parquet"
    pq.write_table(
        pa.table({"input_ids": [[1, 2], [3]], "labels": [[IGNORE_INDEX] * 2, [IGNORE_INDEX]]}), tok_src
    )
    with pytest.raises(PackingError, match=r"every label is -100"):
        run_pipeline([str(tok_src)], str(tmp_path / "o2"), PipelineConfig(max_length=8))
    # control: one trained row among them is enough; the others are kept and counted
    convs.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    res = run_pipeline([str(src)], str(tmp_path / "o"), config)
    assert res.stats["rows_unlabeled"] == 4 and res.stats["tokens_trained_in"] > 0
