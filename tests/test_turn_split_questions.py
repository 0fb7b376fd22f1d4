"""A reply cut across pieces keeps its question, and a tool call, its result and the answer stay together
(issue 40: review-2026-12c C1, newcomer-2026-12c §3).  The rules are in :mod:`packtools.pipeline.turn_split`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _pipeline_data import CHATML_GENERATION, CHATML_PLAIN, build_tokenizer, load

from packtools.constants import IGNORE_INDEX
from packtools.core import unpack
from packtools.pipeline import pack_files, turn_split
from packtools.pipeline.turn_split import piece_columns, plan_pieces, trained_tokens
from packtools.testing import chat_conversations

datasets = pytest.importorskip("datasets")
IGN = IGNORE_INDEX


def test_review_c1_reply_longer_than_a_piece_keeps_its_question():
    ids = np.arange(100, 115)
    labels = np.array([IGN, IGN, IGN] + list(range(103, 115)))  # head 2, user 1, reply 12
    pieces, cut, _ = plan_pieces(labels, head=2, max_length=8)
    assert cut == 1
    # the first piece: head, question and the reply's start; the second continues the reply without the head
    assert pieces == [(0, 0, 8), (0, 8, 15)]
    cols = piece_columns({"input_ids": ids, "labels": labels}, pieces, [])
    assert [x.tolist() for x in cols["input_ids"]] == [list(range(100, 108)), list(range(108, 115))]
    # the continuation's first token follows no head: a padding-free batch masks it as every sequence's first
    assert [trained_tokens(x) for x in cols["labels"]] == [5, 6]


def test_a_long_question_keeps_its_end_with_the_reply():
    labels = np.array([IGN] * 2 + [IGN] * 10 + [7] * 20, np.int64)  # head 2, question 10, reply 20
    pieces = plan_pieces(labels, head=2, max_length=10).pieces
    # the question's start trains nothing (dropped); the first reply piece: head + the question's last
    # 6 tokens (three quarters of the 8 besides the head) + the reply's start; then the reply without the head
    assert pieces == [(0, 0, 6), (2, 6, 14), (0, 14, 24), (0, 24, 32)]


def _tool_row(call_at: list[int], q: int = 3, call: int = 3, result: int = 4, answer: int = 3):
    """ids and labels of exchanges [user q, assistant call, tool result, assistant answer]; 9 opens a tool."""
    ids, labels = [], []
    for _ in call_at:
        ids += [1] * q + [2] * call + [9] + [3] * (result - 1) + [4] * answer
        labels += [IGN] * q + [2] * call + [IGN] * result + [4] * answer
    return np.array(ids, np.int64), np.array(labels, np.int64)


def test_a_tool_result_stays_with_its_call_where_the_chain_fits():
    ids, labels = _tool_row([0, 1])  # two chains of 13 tokens
    opener = np.array([9])
    plain = turn_split.plan_pieces(labels, 0, 20, ids=ids)
    assert plain.pieces == [(0, 0, 19), (0, 19, 26)]  # without the opener: cut after the second call
    got = turn_split.plan_pieces(labels, 0, 20, ids=ids, tool_opener=opener)
    assert got.pieces == [(0, 0, 13), (0, 13, 26)] and got.questions_dropped == 0
    # a chain longer than a piece is cut at its tool result, and counted
    longer = turn_split.plan_pieces(labels, 0, 8, ids=ids, tool_opener=opener)
    starts = [a for _, a, _ in longer.pieces]
    assert 6 in starts and longer.questions_dropped == sum(1 for a in starts if ids[a] == 9)


def _pack(tmp_path, tok_dir, convs, max_length):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    res = pack_files(str(src), str(tmp_path / "out"), max_length, "bfd_split", tokenizer=tok_dir, quiet=True)
    seqs = unpack(datasets.load_from_disk(str(tmp_path / "out")).data.table)
    return res.stats, seqs.column("input_ids").to_pylist(), seqs.column("labels").to_pylist()


def answers_without_question(ids_rows, labels_rows, user_opener: list[int]) -> tuple[int, int]:
    """``(replies, replies with no user message before them in their sequence)`` over packed sequences: a
    reply is where a trained label follows an untrained one (a sequence's first token is never trained)."""
    k = len(user_opener)
    replies = orphans = 0
    for ids, labels in zip(ids_rows, labels_rows):
        seen_user = False
        for i in range(1, len(ids)):
            if ids[i - 1 : i - 1 + k] == user_opener:
                seen_user = True
            if labels[i] != -100 and labels[i - 1] == -100:
                replies += 1
                orphans += not seen_user
    return replies, orphans


@pytest.fixture(scope="module", params=["plain", "generation"])
def tok_dir(request, tmp_path_factory):
    template = CHATML_PLAIN if request.param == "plain" else CHATML_GENERATION
    return build_tokenizer(str(tmp_path_factory.mktemp(request.param)), template)


def test_review_c1_end_to_end(tmp_path, tok_dir):
    tok = load(tok_dir)
    reply = " ".join(["packing sequences into rows"] * 18)
    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is packing"},
        {"role": "assistant", "content": reply},
    ]
    stats, ids, labels = _pack(tmp_path, tok_dir, [conv], 32)
    assert stats["turns_cut"] == 1
    head = tok(tok.apply_chat_template(conv[:1], tokenize=False), add_special_tokens=False)["input_ids"]
    texts = [tok.decode(x) for x in ids]
    with_head = [i for i, x in enumerate(ids) if x[: len(head)] == head]
    assert len(with_head) == 1  # the head once, in the piece that holds the question and the reply's start
    assert (
        "what is packing" in texts[with_head[0]]
        and "packing sequences" in texts[with_head[0]].split("assistant")[1]
    )
    for x, lab in zip(ids, labels):
        if x[: len(head)] == head:
            assert lab[len(head)] == IGN  # after the head, the question: never a trained token
        else:
            assert tok.decode(x) in tok.apply_chat_template(
                [conv[2]], tokenize=False
            )  # a window of the reply
    # every token accounted for; every trained token kept but the continuations' first (not trained, no head)
    row = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    kept = sum(len(x) for x in ids)
    assert len(row) == kept - stats["tokens_carried"] + stats["tokens_dropped_unlabeled"]
    continuations = len(ids) - len(with_head)
    assert continuations >= 2
    assert stats["tokens_trained_kept"] == stats["tokens_trained_in"] - continuations


def test_tool_chains_keep_their_question_end_to_end(tmp_path, tok_dir):
    tok = load(tok_dir)
    chain = [
        {"role": "user", "content": "what does keys do"},
        {"role": "assistant", "content": 'let me look <tool_call>{"name": "read_file"}</tool_call>'},
        {"role": "tool", "content": '{"result": "' + "the quick brown fox " * 4 + '"}'},
        {"role": "assistant", "content": "keys returns the header names " * 3},
    ]
    conv = [{"role": "system", "content": "be brief"}, *chain * 6]
    one = len(tok(tok.apply_chat_template([conv[0], *chain], tokenize=False))["input_ids"])
    stats, ids, labels = _pack(tmp_path, tok_dir, [conv], one + 8)
    user = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    assert stats["pieces"] >= 5 and stats["questions_dropped"] == 0
    assert answers_without_question(ids, labels, user) == (12, 0)  # every call and answer with its question

    # negative control: a piece that holds the question and the call, or the result and the answer, but not
    # the call, result and answer together, cuts at the tool result, and the summary counts it
    def upto(k):
        return len(tok(tok.apply_chat_template(conv[:k], tokenize=False))["input_ids"])

    head, ex1, ex2 = upto(1), upto(3) - upto(1), upto(5) - upto(3)
    small = head + max(ex1, ex2) + 1
    assert small < upto(5) - 1  # the call, result and answer do not fit beside the head
    (tmp_path / "small").mkdir()
    stats, ids, labels = _pack(tmp_path / "small", tok_dir, [conv], small)
    orphans = answers_without_question(ids, labels, user)[1]
    assert stats["questions_dropped"] == orphans == 6
    from packtools.pipeline.summary import format_pipeline_summary

    text = format_pipeline_summary(stats, str(tmp_path / "small" / "out"))
    assert "6 answers without their question (a tool chain longer than a piece)" in " ".join(text.split())


def test_newcomer_shape_drops_no_question(tmp_path, tok_dir):
    stats, ids, labels = _pack(tmp_path, tok_dir, chat_conversations(60, seed=1), 2048)
    tok = load(tok_dir)
    tool = tok("<|im_start|>tool\n", add_special_tokens=False)["input_ids"]
    sys_end = tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    starts_at_tool = 0
    for x in ids:
        own = x
        if tok.decode(x[:3]).startswith("<|im_start|>system"):
            k = next(i for i in range(len(x)) if x[i : i + len(sys_end)] == sys_end) + len(sys_end)
            own = x[k:]
        starts_at_tool += own[: len(tool)] == tool
    assert stats["rows_split"] > 5 and stats["turns_cut"] > 0
    assert starts_at_tool == 0 and stats["questions_dropped"] == 0
