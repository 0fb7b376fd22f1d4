"""Turn-aware splitting of rows with labels under ``bfd_split`` (:mod:`packtools.pipeline.turn_split`): pieces
start at turn boundaries (checked against a real chat template's renderings), carry the system prompt unlabeled,
pieces without a trained token are dropped and counted, and every input token is accounted for."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from _pipeline_data import CHATML_GENERATION, CHATML_PLAIN, build_tokenizer, load
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packtools.constants import IGNORE_INDEX
from packtools.core import unpack
from packtools.pipeline import pack_files
from packtools.pipeline.turn_split import carried_head, plan_pieces, turn_ends

datasets = pytest.importorskip("datasets")


# -- the cut, on generated label rows ----------------------------------------------------------------------
@st.composite
def label_rows(draw):
    """A row's labels as alternating unlabeled (prompt) and trained (reply) runs, a head, a max_length."""
    runs = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12)), min_size=1, max_size=8))
    labels = np.concatenate([np.r_[np.full(p, IGNORE_INDEX), np.full(r, 5)] for p, r in runs] + [np.zeros(0)])
    labels = labels.astype(np.int64)
    if labels.size == 0:
        labels = np.array([IGNORE_INDEX], np.int64)
    head = draw(st.integers(0, min(10, labels.size)))
    return labels, head, draw(st.integers(2, 64))


@settings(max_examples=300, deadline=None)
@given(label_rows())
@example(case=(np.array([5, IGNORE_INDEX, 5]), 2, 2))  # a turn end inside the head, in a cut exchange
@example(case=(np.array([5, 5, IGNORE_INDEX, 5]), 1, 2))  # an exchange that fits only without the head
def test_cut_covers_the_row_at_turn_ends(case):
    labels, head, max_length = case
    pieces, cut, _ = plan_pieces(labels, head, max_length)
    n = labels.size
    ends = {e for e in turn_ends(labels).tolist() if e > head}  # a turn end inside the head is no boundary
    carry = carried_head(head, max_length)
    assert pieces[0][1] == 0 and pieces[-1][2] == n
    assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))  # in order, each token once
    inside = 0
    trained = labels != IGNORE_INDEX
    for c, a, b in pieces:
        assert a < b and c + b - a <= max_length
        assert c in (0, carry)
        if c:
            assert not trained[a]  # after a carried head comes a question, never a trained token
        elif a and carry:
            # a piece of a cut exchange without the head: a reply's continuation (its first token, like every
            # sequence's, is not trained), or a first reply piece too short for the head (it starts in the
            # question); no trained token follows a head or a context it was not answering
            assert cut and (trained[a - 1] or not trained[a])
        if a and a not in ends:
            inside += 1  # a piece starting inside a turn: only inside an exchange longer than a piece
        # a reply's first trained token is never a piece's first own token: its question (some) comes first
        # (a turn end inside the head is no boundary: there a continuation may start at a span's start)
        assert a <= head or not (trained[a] and not trained[a - 1])
    assert cut or not inside  # a piece starts inside a turn only in a cut exchange
    if cut and not inside:  # an exchange that fits a piece only without the head (the head leaves it no room)
        assert carry and any(c == 0 and a > 0 for c, a, _ in pieces)
    # negative control: the fixed cut starts pieces inside turns where the turn cut does not
    fixed = plan_pieces(labels, head, max_length, "tokens").pieces
    assert all(b - a <= max_length for _, a, b in fixed) and fixed[-1][2] == n


def test_a_turn_end_moves_past_the_templates_closing_tokens():
    labels = np.array([IGNORE_INDEX] * 3 + [7, 7] + [IGNORE_INDEX] * 4 + [8], np.int64)
    ids = np.array([1, 2, 3, 7, 7, 99, 4, 5, 6, 8], np.int64)  # 99: the closing text after the span
    assert plan_pieces(labels, 0, 6).pieces == [(0, 0, 5), (0, 5, 10)]
    assert plan_pieces(labels, 0, 6, ids=ids, closing=np.array([99])).pieces == [(0, 0, 6), (0, 6, 10)]
    other = ids.copy()
    other[5] = 42  # not the closing text: the end stays where the span ends
    assert plan_pieces(labels, 0, 6, ids=other, closing=np.array([99])).pieces == [(0, 0, 5), (0, 5, 10)]


def test_cut_example_keeps_the_reply_with_the_end_of_its_question():
    # head 2, then an exchange of 12 tokens (10 prompt, 2 reply), then one of 3
    labels = np.array([IGNORE_INDEX] * 12 + [7, 7] + [IGNORE_INDEX, IGNORE_INDEX, 8], np.int64)
    pieces, cut, _ = plan_pieces(labels, 2, 6)
    assert cut == 1
    assert pieces == [(0, 0, 6), (2, 6, 10), (2, 10, 14), (2, 14, 17)]
    # the piece holding the reply (10..14) also holds the end of the question before it


# -- through the pipeline, with a real chat template ----------------------------------------------------
@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {
        name: build_tokenizer(str(root / name), template)
        for name, template in [("plain", CHATML_PLAIN), ("generation", CHATML_GENERATION)]
    }


WORDS = ["the quick brown fox", "hello world", "two plus two", "tokens", "packing sequences into rows"]


@st.composite
def conversations(draw):
    convs = []
    for _ in range(draw(st.integers(1, 6))):
        conv = [{"role": "system", "content": "be brief"}] if draw(st.booleans()) else []
        for _ in range(draw(st.integers(1, 4))):
            conv.append(
                {
                    "role": "user",
                    "content": " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=14))),
                }
            )
            conv.append(
                {
                    "role": "assistant",
                    "content": " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=5))),
                }
            )
        if draw(st.integers(0, 5)) == 0:
            conv.append({"role": "user", "content": "tokens"})  # ends with a question: a piece with no reply
        convs.append(conv)
    return convs


def boundaries(tok, conv):
    """Token positions where message k starts, from the template's own renderings of ``conv[:k]``."""
    out = {0}
    for k in range(1, len(conv) + 1):
        text = tok.apply_chat_template(conv[:k], tokenize=False)
        out.add(len(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def pack(tmp_path, tok_dir, convs, max_length, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    out = tmp_path / "out"
    res = pack_files(str(src), str(out), max_length, "bfd_split", tokenizer=tok_dir, **options)
    table = datasets.load_from_disk(str(out)).data.table
    return res.stats, unpack(table)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    convs=conversations(),
    max_length=st.sampled_from([24, 40, 64]),
    template=st.sampled_from(["plain", "generation"]),
)
def test_pieces_start_at_turns_and_carry_the_system_prompt(
    tmp_path_factory, toks, convs, max_length, template
):
    # plain: the incremental rule's spans end where the next message starts; generation: the {% generation %}
    # span ends before ChatML's closing "\n", which the split steps over (chat_head.closing_ids)
    tmp_path = tmp_path_factory.mktemp("run")
    tok = load(toks[template])
    stats, seqs = pack(tmp_path, toks[template], convs, max_length)
    ids_col, labels_col = seqs.column("input_ids").to_pylist(), seqs.column("labels").to_pylist()

    rows = [
        tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"] for c in convs
    ]
    heads = []
    for c in convs:
        heads.append(
            len(tok(tok.apply_chat_template(c[:1], tokenize=False), add_special_tokens=False)["input_ids"])
            if c[0]["role"] == "system"
            else 0
        )
    # every output sequence is a whole conversation, or a piece: [head (unlabeled)] + row[a:b] with a at a turn
    found_at_turn = Counter()
    for ids, labels in zip(ids_col, labels_col):
        assert len(ids) <= max_length
        assert any(t != IGNORE_INDEX for t in labels[1:]), "a kept piece trains something"
        matched = False
        for r, (row, head) in enumerate(zip(rows, heads)):
            carry = carried_head(head, max_length)
            for c in {0, carry} if carry else {0}:
                body = ids[c:]
                if c and (ids[:c] != row[:c] or any(t != IGNORE_INDEX for t in labels[:c])):
                    continue
                for a in range(len(row) - len(body) + 1):
                    # a piece carries the head, but a long reply's continuation (no head: a plain window)
                    headed = c == (carry if a else 0) or (c == 0 and stats.get("turns_cut", 0) > 0)
                    if row[a : a + len(body)] == body and headed:
                        matched = True
                        found_at_turn[a in boundaries(tok, convs[r]) or a == 0] += 1
                        break
                if matched:
                    break
            if matched:
                break
        assert matched, f"an output sequence is no piece of any conversation: {ids}"
    if stats.get("turns_cut", 0) == 0:
        assert found_at_turn[False] == 0  # no exchange longer than a piece: every piece starts at a turn
    # accounting: tokens in = tokens kept - copies of the head + tokens of dropped pieces
    assert stats["tokens_in"] == sum(map(len, rows))
    kept = sum(map(len, ids_col))
    assert stats["tokens_kept"] == kept
    assert stats["tokens_in"] == kept - stats.get("tokens_carried", 0) + stats.get(
        "tokens_dropped_unlabeled", 0
    )
    assert stats["tokens_dropped"] == stats.get("tokens_dropped_unlabeled", 0)
    trained = sum(sum(t != IGNORE_INDEX for t in labels[1:]) for labels in labels_col)
    assert stats["tokens_trained_kept"] == trained
    assert stats["sequences_untrained"] == 0


def test_unlabeled_pieces_kept_with_drop_unlabeled_false(tmp_path, toks):
    convs = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": " ".join(["packing sequences into rows"] * 12)},
            {"role": "assistant", "content": "tokens"},
        ]
    ]
    stats, seqs = pack(tmp_path / "a", toks["plain"], convs, 24)
    assert stats["pieces_dropped_unlabeled"] > 0 and stats["turns_cut"] == 1
    assert stats["sequences_untrained"] == 0
    stats_all, seqs_all = pack(tmp_path / "b", toks["plain"], convs, 24, drop_unlabeled=False)
    assert stats_all["pieces_dropped_unlabeled"] == 0 and stats_all["tokens_dropped"] == 0
    assert stats_all["sequences_untrained"] == stats["pieces_dropped_unlabeled"]
    assert seqs_all.num_rows == seqs.num_rows + stats["pieces_dropped_unlabeled"]


def test_split_at_tokens_is_the_fixed_cut(tmp_path, toks):
    convs = [
        [{"role": "user", "content": " ".join(WORDS * 3)}, {"role": "assistant", "content": "hello world"}]
    ]
    stats, seqs = pack(tmp_path, toks["plain"], convs, 16, split_at="tokens", drop_unlabeled=False)
    n = stats["tokens_in"]
    assert [len(s) for s in seqs.column("input_ids").to_pylist()] == [16] * (n // 16) + (
        [n % 16] if n % 16 else []
    )
    assert stats["tokens_kept"] == n and stats["split_at"] == "tokens"
    idle = [lab for lab in seqs.column("labels").to_pylist() if all(t == IGNORE_INDEX for t in lab[1:])]
    assert stats["sequences_untrained"] == len(idle) > 0  # counted by piece, not by row
    assert stats["tokens_untrained"] == sum(map(len, idle))


def test_bad_split_at_is_refused(tmp_path, toks):
    from packtools import PackingError

    with pytest.raises(PackingError, match="split_at='middle'"):
        pack(tmp_path, toks["plain"], [[{"role": "user", "content": "x"}]], 16, split_at="middle")


def test_prompt_completion_keeps_the_completion_with_the_end_of_its_prompt(tmp_path, toks):
    src = tmp_path / "pc.jsonl"
    src.write_text(json.dumps({"prompt": " ".join(WORDS * 4), "completion": "hello world"}) + "\n")
    res = pack_files(str(src), str(tmp_path / "out"), 16, "bfd_split", tokenizer=toks["plain"])
    seqs = unpack(datasets.load_from_disk(str(tmp_path / "out")).data.table)
    labels = seqs.column("labels").to_pylist()
    assert (
        len(labels) == 1 and labels[0][-1] != IGNORE_INDEX
    )  # one piece: the completion and its prompt's end
    assert res.stats["pieces_dropped_unlabeled"] == res.stats["pieces"] - 1 > 0  # the rest of the prompt
    assert res.stats["tokens_in"] == 16 + res.stats["tokens_dropped_unlabeled"]


def test_preference_data_is_not_split(tmp_path, toks):
    from packtools import PackingError

    src = tmp_path / "prefs.jsonl"
    src.write_text(
        json.dumps({"prompt": "the quick brown fox", "chosen": "hello", "rejected": "world"}) + "\n"
    )
    for strategy in ("bfd_split", "wrapped"):
        with pytest.raises(PackingError, match="each pair is packed whole"):
            pack_files(str(src), str(tmp_path / strategy), 16, strategy, tokenizer=toks["plain"])


@pytest.mark.parametrize("template", ["plain", "generation"])
def test_short_turns_split_exactly_at_message_starts(tmp_path, toks, template):
    conv = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        conv += [
            {"role": "user", "content": WORDS[i % 5]},
            {"role": "assistant", "content": WORDS[(i + 2) % 5]},
        ]
    tok = load(toks[template])
    row = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    head = len(tok(tok.apply_chat_template(conv[:1], tokenize=False), add_special_tokens=False)["input_ids"])
    starts = boundaries(tok, conv)
    stats, seqs = pack(tmp_path, toks[template], [conv], len(row) // 3)
    assert stats["rows_split"] == 1 and stats["turns_cut"] == 0 and stats["pieces"] >= 3
    for ids in seqs.column("input_ids").to_pylist():
        if ids == row[: len(ids)]:
            continue  # the first piece
        assert ids[:head] == row[:head]  # the system prompt, carried
        body = ids[head:]
        a = next(a for a in range(head, len(row)) if row[a : a + len(body)] == body)
        assert a in starts, f"a piece starts at token {a}, not at a message start {sorted(starts)}"


def test_tokenized_arrow_read_in_place_splits_like_parquet(tmp_path):
    """A tokenized .arrow input is read in place (its own sidecar, no copy): it must carry its trained tokens
    like a staged .parquet part, so bfd_split cuts at turns and drops untrained pieces the same way, and a
    rerun reuses the part instead of finding it damaged."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    from packtools.pipeline import staged

    ids = [list(range(1, 11)), list(range(11, 15)), list(range(15, 27))]
    labels = [[IGNORE_INDEX] * 6 + ids[0][6:], [IGNORE_INDEX] + ids[1][1:], [IGNORE_INDEX] * 9 + ids[2][9:]]
    table = pa.table({"input_ids": ids, "labels": labels})
    outs = {}
    for ext in ("arrow", "parquet"):
        folder = tmp_path / ext
        folder.mkdir()
        path = str(folder / f"in.{ext}")
        if ext == "arrow":
            feather.write_feather(table, path, compression="uncompressed")
        else:
            pq.write_table(table, path)
        res = pack_files(path, str(tmp_path / f"out-{ext}"), 8, "bfd_split", format="tokenized")
        outs[ext] = (res.stats, unpack(datasets.load_from_disk(res.out).data.table).to_pydict())
    (arrow_stats, arrow_rows), (parquet_stats, parquet_rows) = outs["arrow"], outs["parquet"]
    assert arrow_rows == parquet_rows
    for key in ("rows_out", "pieces_dropped_unlabeled", "tokens_trained_kept", "split_at"):
        assert arrow_stats.get(key) == parquet_stats.get(key), key
    assert "tokens_trained_kept" in arrow_stats
    sidecars = [p for p in (tmp_path / "out-arrow").rglob("*.npz")]
    for sidecar in sidecars:
        assert staged.damage(str(sidecar)) is None


def test_pack_dataset_says_when_a_split_leaves_pieces_that_train_nothing():
    """In memory, pack_dataset's bfd_split is TRL's fixed cut (its output equals trl.pack_dataset): pieces
    without a trained token are kept, and said (UntrainedPiecesWarning naming the turn-aware file pipeline)."""
    from packtools import pack_dataset
    from packtools.integrations.data.drops import UntrainedPiecesWarning

    long = {"input_ids": list(range(1, 13)), "labels": [IGNORE_INDEX] * 9 + [10, 11, 12]}
    short = {"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}
    ds = datasets.Dataset.from_list([long, short])
    with pytest.warns(UntrainedPiecesWarning, match=r"2 of the 3 pieces .*'labels'.*pack_files"):
        pack_dataset(ds, 4, "bfd_split")
    masked = datasets.Dataset.from_dict(
        {"input_ids": [long["input_ids"]], "completion_mask": [[0] * 9 + [1] * 3]}
    )
    with pytest.warns(UntrainedPiecesWarning, match="'completion_mask'"):
        pack_dataset(masked, 4, "wrapped")
    with warnings.catch_warnings():  # every piece trains, or nothing was cut: no warning
        warnings.simplefilter("error", UntrainedPiecesWarning)
        pack_dataset(datasets.Dataset.from_list([short, short]), 4, "bfd_split")
        trained = {"input_ids": list(range(1, 9)), "labels": list(range(1, 9))}
        pack_dataset(datasets.Dataset.from_list([trained]), 4, "bfd_split")


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_untrained_piece_count_equals_a_direct_count_in_blocks(strategy):
    """The count reads only the rows the plan cuts, a block at a time; it equals a count piece by piece (a
    wrapped piece's first label trains unless it starts a packed row)."""
    from packtools.core.plan import plan
    from packtools.integrations.data.drops import untrained_pieces

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 500)
    labels = [[int(x) if rng.random() < 0.2 else IGNORE_INDEX for x in range(n)] for n in lengths]
    table = pa.table({"input_ids": [list(range(n)) for n in lengths], "labels": labels})
    p = plan(lengths, 16, strategy)
    firsts = set(np.asarray(p.row_offsets[:-1]).tolist())
    pieces = empty = 0
    for s, (src, start, n) in enumerate(zip(p.seg_source, p.seg_start, p.seg_length)):
        lab = labels[src]
        if n >= lengths[src] or all(x == IGNORE_INDEX for x in lab[1:]):
            continue
        pieces += 1
        skip = 1 if strategy == "bfd_split" or s in firsts else 0
        empty += all(x == IGNORE_INDEX for x in lab[start + skip : start + n])
    assert untrained_pieces(table, None, p) == untrained_pieces(table, None, p, block_rows=7)
    assert untrained_pieces(table, None, p) == (pieces, empty, "labels") and empty > 0


def test_an_unlabeled_row_cut_by_the_plan_counts_each_piece_as_an_untrained_sequence(tmp_path):
    """adv46: a row without a trained token (kept, the default) longer than max_length is cut by bfd_split's
    plan into several sequences, each training nothing; ``sequences_untrained`` counted it as one ("10 tokens in
    1 sequences" for 3 sequences)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools import pack_files

    src = str(tmp_path / "t.parquet")
    pq.write_table(
        pa.table({"input_ids": [list(range(1, 11)), [11, 12, 13]], "labels": [[-100] * 10, [-100, 12, 13]]}),
        src,
    )
    for split_at in ("turns", "tokens"):
        stats = pack_files(src, str(tmp_path / split_at), 4, "bfd_split", split_at=split_at).stats
        assert stats["sequences_packed"] == 4  # 4 + 4 + 2 of the unlabeled row, and the labelled one
        assert stats["sequences_untrained"] == 3 and stats["tokens_untrained"] == 10
    # control: truncated, the unlabeled row is one sequence
    stats = pack_files(src, str(tmp_path / "bfd"), 4, "bfd").stats
    assert stats["sequences_untrained"] == 1 and stats["tokens_untrained"] == 4
