"""PaddingFreeCollator: the padding-free contract, TRL / transformers equality, padded mode, input errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from packtools import PackingError  # noqa: E402
from packtools.batches.collate import PaddingFreeCollator  # noqa: E402
from packtools.batches.flatten import flatten_rows  # noqa: E402

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
transformers = pytest.importorskip("transformers")


@st.composite
def packed_rows(draw, with_labels=True, max_rows=4):
    """Rows of 1..4 sequences each, random token ids, optional labels with some -100."""
    n_rows = draw(st.integers(1, max_rows))
    rows = []
    token = 1
    for _ in range(n_rows):
        seg = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
        n = sum(seg)
        ids = list(range(token, token + n))
        token += n
        row = {"input_ids": ids, "seq_lengths": seg}
        if with_labels and draw(st.booleans()):
            keep = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            row["labels"] = [t if k else -100 for t, k in zip(ids, keep)]
        rows.append(row)
    return rows


def _docs(rows):
    """The documents inside packed rows, one dict each."""
    out = []
    for row in rows:
        ids = np.asarray(row["input_ids"])
        labels = np.asarray(row.get("labels", row["input_ids"]))
        start = 0
        for n in row["seq_lengths"]:
            out.append(
                {"input_ids": ids[start : start + n].tolist(), "labels": labels[start : start + n].tolist()}
            )
            start += n
    return out


def _check_contract(b, total, multiple):
    T = b["input_ids"].shape[1]
    assert (
        b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == b["seq_idx"].shape == (1, T)
    )
    assert T == (total if multiple is None else -(-total // multiple) * multiple)
    cu = b["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and b["seq_idx"].dtype == torch.int32
    assert b["cu_seq_lens_k"] is cu or torch.equal(b["cu_seq_lens_k"], cu)
    assert cu[0] == 0 and cu[-1] == T and bool((cu.diff() > 0).all())
    assert isinstance(b["max_length_q"], int) and b["max_length_q"] == int(cu.diff().max())
    assert b["max_length_k"] == b["max_length_q"]
    pos = b["position_ids"][0]
    labels = b["labels"][0]
    for s in range(cu.numel() - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        assert torch.equal(pos[lo:hi], torch.arange(hi - lo))
        assert labels[lo] == -100
        assert bool((b["seq_idx"][0, lo:hi] == s).all())
    assert bool((labels[total:] == -100).all())
    if T > total:  # padding is exactly one segment, the last
        assert int(cu[-2]) == total
    assert "attention_mask" not in b


@settings(max_examples=60, deadline=None)
@given(rows=packed_rows(), multiple=st.sampled_from([None, 1, 4, 16]))
def test_contract_holds(rows, multiple):
    b = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=multiple)(rows)
    total = sum(len(r["input_ids"]) for r in rows)
    _check_contract(b, total, multiple)
    flat_ids = [t for r in rows for t in r["input_ids"]]
    assert b["input_ids"][0, :total].tolist() == flat_ids
    assert bool((b["input_ids"][0, total:] == 0).all())
    # Inside each segment, labels are the given labels (or the ids) except at the start.
    flat_labels = [t for r in rows for t in r.get("labels", r["input_ids"])]
    starts = set(b["cu_seq_lens_q"][:-1].tolist())
    for j in range(total):
        assert b["labels"][0, j] == (-100 if j in starts else flat_labels[j])


@settings(max_examples=60, deadline=None)
@given(rows=packed_rows())
def test_equals_trl_padding_free_collator(rows):
    ours = PaddingFreeCollator(pad_token_id=0)(rows)
    trl = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    assert ours.pop("use_cache") is False  # ours only: model(**batch) runs without a cache
    if "cu_seq_lens_q" in trl:
        assert set(ours) == set(trl)
    else:  # TRL < 1.16 returns no varlen keys (cu_seq_lens_*, max_length_*, seq_idx); the rest must be equal
        assert set(trl) < set(ours)
    for key, value in trl.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@settings(max_examples=40, deadline=None)
@given(rows=packed_rows(), multiple=st.sampled_from([3, 8]))
def test_relation_to_trl_with_padding(rows, multiple):
    """TRL pads positions with 0, so each pad token is its own segment; ours is one segment."""
    ours = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=multiple)(rows)
    trl = trl_sft.DataCollatorForLanguageModeling(
        pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple
    )(rows)
    total = sum(len(r["input_ids"]) for r in rows)
    assert torch.equal(ours["input_ids"], trl["input_ids"])
    assert torch.equal(ours["labels"], trl["labels"])
    assert torch.equal(ours["position_ids"][:, :total], trl["position_ids"][:, :total])
    pad = ours["input_ids"].shape[1] - total
    assert ours["position_ids"][0, total:].tolist() == list(range(pad))
    # TRL < 1.16 returns no cu_seq_lens: its segments are where its positions restart, as TRL 1.16 computes them
    starts = (trl["position_ids"][0] == 0).nonzero().flatten().tolist()
    trl_cu = trl["cu_seq_lens_q"].tolist() if "cu_seq_lens_q" in trl else [*starts, trl["input_ids"].shape[1]]
    expected = [c for c in trl_cu if c <= total] + ([total + pad] if pad else [])
    assert ours["cu_seq_lens_q"].tolist() == expected


@settings(max_examples=40, deadline=None)
@given(rows=packed_rows())
def test_equals_transformers_flattening_on_documents(rows):
    flattening = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    theirs = flattening(_docs(rows))
    ours = PaddingFreeCollator(pad_token_id=0, return_use_cache=False)(rows)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@settings(max_examples=30, deadline=None)
@given(rows=packed_rows(with_labels=False))
def test_relation_to_transformers_flattening_on_packed_rows(rows):
    """Given whole packed rows, DataCollatorWithFlattening sees one sequence per row: ours differs exactly
    at the inner sequence starts (labels -100, positions restart, extra cu boundaries)."""
    flattening = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    theirs = flattening([{"input_ids": r["input_ids"]} for r in rows])
    ours = PaddingFreeCollator(pad_token_id=0)(rows)
    row_starts = set(theirs["cu_seq_lens_q"][:-1].tolist())
    inner = set(ours["cu_seq_lens_q"][:-1].tolist()) - row_starts
    assert row_starts <= set(ours["cu_seq_lens_q"].tolist())
    differ = set(torch.nonzero(ours["labels"][0] != theirs["labels"][0]).flatten().tolist())
    assert differ == inner
    assert all(ours["labels"][0, j] == -100 for j in inner)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])


def test_numpy_and_tensor_inputs_equal_list_input():
    rows = [
        {"input_ids": [3, 4, 5, 6], "seq_lengths": [1, 3], "labels": [3, -100, 5, 6]},
        {"input_ids": [7, 8], "seq_lengths": [2]},
    ]
    as_np = [{k: np.asarray(v, dtype=np.int32) for k, v in r.items()} for r in rows]
    as_pt = [{k: torch.tensor(v) for k, v in r.items()} for r in rows]
    c = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=4)
    ref = c(rows)
    for other in (c(as_np), c(as_pt)):
        for key in ref:
            if isinstance(ref[key], torch.Tensor):
                assert torch.equal(ref[key], other[key]) and ref[key].dtype == other[key].dtype
            else:
                assert ref[key] == other[key]
    assert ref["input_ids"].dtype == torch.int64
    assert as_np[0]["labels"].tolist() == [3, -100, 5, 6]  # inputs are never modified


def test_masks_build_labels_like_trl():
    rows = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
        {"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 1]},
        {"input_ids": [8, 9, 10], "completion_mask": [0, 1, 1], "assistant_masks": [1, 0, 1]},
        {"input_ids": [11, 12], "labels": [11, 12], "completion_mask": [0, 0]},  # labels win
    ]
    b = PaddingFreeCollator(pad_token_id=0, unpacked=True)(rows)
    assert b["labels"][0].tolist() == [-100, -100, 3, 4, -100, 6, 7, -100, -100, 10, -100, 12]
    # Loss masks switched off, like TRL's completion_only_loss=False / assistant_only_loss=False.
    off = PaddingFreeCollator(pad_token_id=0, unpacked=True, completion_only_loss=False)(rows)
    assert off["labels"][0].tolist() == [-100, 2, 3, 4, -100, 6, 7, -100, -100, 10, -100, 12]
    both = PaddingFreeCollator(0, unpacked=True, completion_only_loss=False, assistant_only_loss=False)(rows)
    assert both["labels"][0].tolist() == [-100, 2, 3, 4, -100, 6, 7, -100, 9, 10, -100, 12]


def test_rows_without_seq_lengths_are_one_sequence_when_unpacked_and_empty_rows_skipped():
    b = PaddingFreeCollator(pad_token_id=9, unpacked=True)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4], "seq_lengths": [1]}]
    )
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 4]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0]]


def test_padded_mode_packed_rows_have_no_attention_mask():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    b = PaddingFreeCollator(
        pad_token_id=0, padding_free=False, pad_to_multiple_of=4, attn_implementation="sdpa"
    )(rows)
    assert set(b) == {"input_ids", "labels", "position_ids", "use_cache"}
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 0, 0, 0, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert b["labels"].tolist() == [[-100, 2, -100, 4, 5, -100, -100, -100], [-100, 7] + [-100] * 6]


@settings(max_examples=40, deadline=None)
@given(rows=packed_rows(), multiple=st.sampled_from([None, 4]))
def test_padded_mode_agrees_with_padding_free_row_by_row(rows, multiple):
    padded = PaddingFreeCollator(
        0, padding_free=False, pad_to_multiple_of=multiple, attn_implementation="sdpa"
    )(rows)
    flat = PaddingFreeCollator(pad_token_id=0)(rows)
    B, T = padded["input_ids"].shape
    assert B == len(rows) and T % (multiple or 1) == 0 and T >= max(len(r["input_ids"]) for r in rows)
    packed = any(len(r["seq_lengths"]) > 1 for r in rows)
    assert ("attention_mask" in padded) == (not packed)
    start = 0
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(padded[key][b, :n], flat[key][0, start : start + n]), key
        assert bool((padded["input_ids"][b, n:] == 0).all()) and bool((padded["labels"][b, n:] == -100).all())
        assert padded["position_ids"][b, n:].tolist() == list(range(T - n))  # padding: one segment
        if not packed:
            assert padded["attention_mask"][b].tolist() == [1] * n + [0] * (T - n)
        start += n


def test_padded_mode_packed_rows_give_block_diagonal_attention_in_transformers():
    """transformers' packed-sequence detection from our position_ids finds exactly our segments."""
    from transformers.masking_utils import find_packed_sequence_indices

    rows = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [1, 4]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    b = PaddingFreeCollator(pad_token_id=0, padding_free=False, attn_implementation="sdpa")(rows)
    found = find_packed_sequence_indices(b["position_ids"])
    assert found.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_padded_mode_unpacked_rows_match_trl_padded_collator():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}]
    ours = PaddingFreeCollator(pad_token_id=0, padding_free=False, pad_to_multiple_of=4, unpacked=True)(rows)
    trl = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert torch.equal(ours["input_ids"], trl["input_ids"])
    assert torch.equal(ours["attention_mask"], trl["attention_mask"])
    # Ours also masks column 0 (a sequence start); the shifted causal-LM loss never reads that label.
    assert torch.equal(ours["labels"][:, 1:], trl["labels"][:, 1:])
    assert bool((ours["labels"][:, 0] == -100).all())


def test_return_numpy():
    b = PaddingFreeCollator(pad_token_id=0, return_tensors="np")([{"input_ids": [1, 2], "seq_lengths": [2]}])
    assert isinstance(b["input_ids"], np.ndarray) and b["cu_seq_lens_q"].dtype == np.int32


@pytest.mark.parametrize(
    "rows, match",
    [
        ([], "non-empty list"),
        ({"input_ids": [1]}, "non-empty list"),
        ([{"labels": [1]}], "row 0 has no 'input_ids'"),
        ([{"input_ids": [1], "seq_lengths": [1]}, {"input_ids": [1.5]}], "row 1: 'input_ids' holds float64"),
        ([{"input_ids": [[1, 2]]}], "row 0: 'input_ids' must be a flat list"),
        ([{"input_ids": [True, False]}], "row 0: 'input_ids' holds bool"),
        ([{"input_ids": [1, 2], "labels": [1]}], "row 0: 'labels' has 1 values"),
        ([{"input_ids": [1, 2], "seq_lengths": [1]}], "row 0: 'seq_lengths' sum to 1"),
        ([{"input_ids": [1, 2], "seq_lengths": [2, 0]}], r"row 0: 'seq_lengths'\[1\] = 0"),
        ([{"input_ids": [1, 2], "completion_mask": [1]}], "row 0: 'completion_mask' has shape"),
        ([{"input_ids": []}], "every row in the batch is empty"),
        (
            [{"input_ids": [1, 2], "seq_lengths": [2]}, {"input_ids": [3]}],
            "row 1 of the batch has no 'seq_lengths'",
        ),
        (
            [{"input_ids": [1, 2], "seq_lengths": [1, 1], "attention_mask": [1, 1]}],
            "row 0 has an 'attention_mask'",
        ),
    ],
)
def test_bad_rows_raise_packing_error(rows, match):
    with pytest.raises(PackingError, match=match):
        PaddingFreeCollator(pad_token_id=0)(rows)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pad_token_id": None}, "pad_token_id must be an int"),
        # the labels' ignore index as the pad id: the padding reached the model's embedding (IndexError there)
        (
            {"pad_token_id": -100, "pad_to_multiple_of": 8},
            "pad_token_id=-100 is not a token id.*ignore index",
        ),
        ({"pad_token_id": 0, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        ({"pad_token_id": 0, "return_tensors": "tf"}, "return_tensors"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(PackingError, match=match):
        PaddingFreeCollator(**kwargs)


def test_flatten_rows_doctest_shape():
    f = flatten_rows([{"input_ids": np.arange(5), "seq_lengths": np.array([2, 3])}])
    assert f.segs_per_row.tolist() == [2]


def test_import_packtools_does_not_import_torch():
    code = (
        "import sys, packtools; packtools.PackingError; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "import packtools.batches.sampler; assert 'torch' not in sys.modules, 'sampler imported torch'; "
        "c = packtools.PaddingFreeCollator(0, return_tensors='np'); c([{'input_ids': [1], 'seq_lengths': [1]}]); "
        "assert 'torch' not in sys.modules, 'np collator imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rows_without_seq_lengths_are_refused_unless_unpacked():
    """A packed row whose seq_lengths was dropped (remove_unused_columns) must not pass as one sequence."""
    rows = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}]
    for padding_free in (True, False):
        with pytest.raises(PackingError, match=r"remove_unused_columns.*prepare_trainer.*unpacked=True"):
            PaddingFreeCollator(0, padding_free=padding_free)(rows)
        assert PaddingFreeCollator(0, padding_free=padding_free, unpacked=True)(rows)["input_ids"].numel() > 0


def test_attention_mask_column():
    packed = [{"input_ids": [1, 2, 3], "seq_lengths": [3], "attention_mask": [1, 1, 1]}]
    with pytest.raises(PackingError, match="beside 'seq_lengths'.*remove_columns"):
        PaddingFreeCollator(0)(packed)
    plain = [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}]
    b = PaddingFreeCollator(0, unpacked=True)(plain)  # an all-ones mask on a plain sequence says nothing
    assert "attention_mask" not in b
    with pytest.raises(PackingError, match="has 0s, so the row holds padding"):
        PaddingFreeCollator(0, unpacked=True)([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}])


@pytest.mark.parametrize(
    "switch, gone",
    [
        ("return_position_ids", {"position_ids"}),
        ("return_flash_attn_kwargs", {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}),
        ("return_seq_idx", {"seq_idx"}),
    ],
)
def test_key_switches_like_data_collator_with_flattening(switch, gone):
    rows = [{"input_ids": [1, 2, 3, 4], "seq_lengths": [3, 1]}]
    full = PaddingFreeCollator(0)(rows)
    c = PaddingFreeCollator(0, **{switch: False})
    less = c(rows)
    assert set(full) - set(less) == gone
    assert all(
        torch.equal(less[k], full[k]) if isinstance(full[k], torch.Tensor) else less[k] == full[k]
        for k in less
    )
    assert c.replace(**{switch: True})(rows).keys() == full.keys()
    assert repr(c).startswith("PaddingFreeCollator(pad_token_id=0,") and f"{switch}=False" in repr(c)


@pytest.mark.parametrize(
    "switches",
    [
        {"padding_free": False, "attn_implementation": "sdpa", "return_position_ids": False},
        {
            "return_position_ids": False,
            "return_flash_attn_kwargs": False,
        },  # seq_idx alone: attention ignores it
        {"return_position_ids": False, "return_flash_attn_kwargs": False, "return_seq_idx": False},
    ],
)
def test_packed_rows_with_nothing_that_separates_their_sequences_are_refused(switches):
    """With position_ids switched off (and, padding-free, cu_seq_lens too) a packed batch held input_ids and
    labels only (seq_idx at most): a tiny Llama ran each row as one sequence, 0.9 away from the sequences'
    own logits, no error from the collator or from guard_model (nothing marked the batch packed)."""
    rows = [
        {"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]},
        {"input_ids": [12, 13], "seq_lengths": [2]},
    ]
    collator = PaddingFreeCollator(0, **switches)
    with pytest.raises(
        PackingError, match=r"row 0 of the batch holds 2 packed sequences.*return_position_ids=True"
    ):
        collator(rows)
    # one row of one sequence has nothing to separate: still collated
    assert "position_ids" not in collator([{"input_ids": [5, 6, 7], "seq_lengths": [3]}])
    # rows of one sequence each: padded, their attention_mask separates them; padding-free they are laid end to
    # end in one [1, T] row, two sequences with nothing between them (were collated so, no error)
    ones = [{"input_ids": [5, 6, 7], "seq_lengths": [3]}, {"input_ids": [8, 9], "seq_lengths": [2]}]
    if switches.get("padding_free", True):
        with pytest.raises(PackingError, match=r"2 rows are laid end to end in one padding-free row"):
            collator(ones)
        with pytest.raises(PackingError, match=r"laid end to end"):
            collator.replace(unpacked=True)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    else:
        single = collator(ones)
        assert "position_ids" not in single and single["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    # what such a batch does: the row runs whole, its second sequence attends to the first (tiny Llama, eager)
    from packtools.testing import tiny_model

    model = tiny_model("Llama", "eager").eval()
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([rows[0]["input_ids"]])).logits[0, 3:]
        alone = model(input_ids=torch.tensor([rows[0]["input_ids"][3:]])).logits[0]
    assert (whole - alone).abs().max() > 1e-2
