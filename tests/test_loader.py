"""The Arrow-native batch path: same batches as PaddingFreeCollator on the same rows, from datasets and tables."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from packtools import PackingError, pack_dataset, pack_table  # noqa: E402
from packtools.batches.collate import PaddingFreeCollator  # noqa: E402
from packtools.batches.loader import ArrowCollator, PackedRows  # noqa: E402
from packtools.batches.sampler import TokenBudgetBatchSampler  # noqa: E402


def _source(n=120, seed=0, with_labels=False, with_mask=False):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 1000, rng.integers(1, 25)).tolist() for _ in range(n)]
    data = {"input_ids": ids}
    if with_labels:
        data["labels"] = [[t if rng.random() < 0.7 else -100 for t in row] for row in ids]
    if with_mask:
        data["completion_mask"] = [[int(rng.random() < 0.6) for _ in row] for row in ids]
    return data


def _assert_same(a, b):
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def packed_views():
    """Packed datasets with and without an indices mapping, labels and masks."""
    plain = pack_dataset(datasets.Dataset.from_dict(_source()), 40)
    labelled = pack_dataset(datasets.Dataset.from_dict(_source(seed=1, with_labels=True)), 40, "bfd_split")
    masked = pack_dataset(datasets.Dataset.from_dict(_source(seed=2, with_mask=True)), 40)
    return {
        "plain": plain,
        "shuffled": plain.shuffle(seed=3).select(range(20)),
        "labelled": labelled.shuffle(seed=4),
        "masked": masked,
        "unpacked": datasets.Dataset.from_dict(_source(seed=5)),
    }


@settings(max_examples=40, deadline=None)
@given(
    view=st.sampled_from(["plain", "shuffled", "labelled", "masked", "unpacked"]),
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
    multiple=st.sampled_from([None, 8]),
    padding_free=st.booleans(),
)
def test_arrow_path_equals_list_collator(packed_views, view, picks, multiple, padding_free):
    ds = packed_views[view]
    indices = [p % len(ds) for p in picks]
    collator = PaddingFreeCollator(
        pad_token_id=0,
        pad_to_multiple_of=multiple,
        padding_free=padding_free,
        unpacked=view == "unpacked",
        attn_implementation="sdpa",
    )
    rows = PackedRows(ds)
    _assert_same(ArrowCollator(rows, collator)(indices), collator([ds[i] for i in indices]))


def test_chunked_sliced_int32_table():
    data = _source(n=60, seed=7)
    table = pack_table(pa.table({"input_ids": pa.array(data["input_ids"], pa.list_(pa.int32()))}), 32)
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5, 4), table.slice(9)])
    assert chunked.column("input_ids").num_chunks == 3
    sliced = chunked.slice(2)
    rows = PackedRows(sliced)
    collator = PaddingFreeCollator(pad_token_id=0)
    as_lists = sliced.to_pylist()
    for indices in ([0], [1, 2, 3, 4, 5], [len(as_lists) - 1, 0, 6]):
        _assert_same(ArrowCollator(rows, collator)(indices), collator([as_lists[i] for i in indices]))
    assert rows.lengths.tolist() == [len(r["input_ids"]) for r in as_lists]


def test_dataloader_with_token_budget_sampler(packed_views):
    ds = packed_views["shuffled"]
    rows = PackedRows(ds)
    assert rows.seq_lengths.to_pylist() == ds["seq_lengths"]
    sampler = TokenBudgetBatchSampler(rows.lengths, 100, seq_lengths=rows.seq_lengths, seed=2)
    collator = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=4)
    loader = torch.utils.data.DataLoader(
        rows, batch_sampler=sampler, collate_fn=ArrowCollator(rows, collator)
    )
    batches = list(loader)
    assert len(batches) == len(sampler)
    for indices, batch in zip(sampler, batches):
        _assert_same(batch, collator([ds[i] for i in indices]))
        assert batch["cu_seq_lens_q"][-1] <= 100 + 3
    again = [b["input_ids"] for b in rows.iter_batches(sampler, collator)]
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(again, batches))


def test_dataloader_with_workers(packed_views):
    ds = packed_views["plain"]
    rows = PackedRows(ds)
    sampler = TokenBudgetBatchSampler(rows.lengths, 120, seed=0)
    collator = PaddingFreeCollator(pad_token_id=0)
    loader = torch.utils.data.DataLoader(
        rows, batch_sampler=sampler, collate_fn=ArrowCollator(rows, collator), num_workers=2
    )
    for indices, batch in zip(sampler, loader):
        _assert_same(batch, collator([ds[i] for i in indices]))


def test_map_style_protocol():
    rows = PackedRows(pa.table({"input_ids": [[1, 2], [3]]}))
    assert len(rows) == 2 and rows[1] == 1 and rows[-1] == 1 and rows.__getitems__([1, 0]) == [1, 0]
    assert rows.seq_lengths is None
    with pytest.raises(IndexError):
        rows[2]
    with pytest.raises(PackingError, match="row index 5 is out of range"):
        rows.gather([5])


@pytest.mark.parametrize(
    "table, match",
    [
        (pa.table({"tokens": [[1]]}), "no 'input_ids' column"),
        (pa.table({"input_ids": [[1.0, 2.0]]}), "holds float64 values"),
        (pa.table({"input_ids": [[1, 2]], "labels": [[1]]}), "differ in length at row 0"),
        (pa.table({"input_ids": [[1, 2], [3]], "seq_lengths": [[2], [2]]}), "row 1: 'seq_lengths' sum to 2"),
        (pa.table({"input_ids": [[1, 2]], "seq_lengths": [[2, 0]]}), "entry <= 0"),
        (pa.table({"input_ids": [[1], None]}), "row 1 is null"),
    ],
)
def test_bad_tables(table, match):
    with pytest.raises(PackingError, match=match):
        PackedRows(table)


def test_bad_inputs():
    with pytest.raises(PackingError, match="datasets.Dataset or a pyarrow.Table"):
        PackedRows({"input_ids": [[1]]})
    rows = PackedRows(pa.table({"input_ids": [[], [1]]}))
    with pytest.raises(PackingError, match="every row in the batch is empty"):
        rows.gather([0])
    with pytest.raises(PackingError, match="must be a PaddingFreeCollator"):
        ArrowCollator(rows, lambda x: x)
    with pytest.raises(PackingError, match="not used by PackedRows"):
        PackedRows(pa.table({"input_ids": [[1]], "x": [[1]]}), columns=["input_ids", "x"])


def test_arrow_path_is_strict_like_the_list_collator(packed_views):
    rows = PackedRows(packed_views["unpacked"])
    with pytest.raises(PackingError, match="no 'seq_lengths'.*remove_unused_columns"):
        ArrowCollator(rows, PaddingFreeCollator(0))([0, 1])
    masked = packed_views["masked"]
    off = PaddingFreeCollator(0, completion_only_loss=False)
    _assert_same(ArrowCollator(PackedRows(masked), off)([0, 1]), off([masked[0], masked[1]]))
    table = pa.table({"input_ids": [[1, 2]], "seq_lengths": [[2]], "attention_mask": [[1, 1]]})
    with pytest.raises(PackingError, match="'attention_mask' column beside 'seq_lengths'"):
        PackedRows(table)
