"""pack_dataset / truncate_dataset on datasets objects, and exact parity with trl.pack_dataset."""

import os

import numpy as np
import pyarrow as pa
import pytest

import packtools
from packtools.core.reference import reference_pack

datasets = pytest.importorskip("datasets")


def random_dataset(rng, n, max_len=60, empty_share=0.1):
    lengths = rng.integers(1, max_len, n)
    lengths[rng.random(n) < empty_share] = 0
    ids = [rng.integers(0, 32000, k).astype(np.int32).tolist() for k in lengths]
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "attention_mask": [[1] * len(x) for x in ids],
            "labels": [[t if j % 3 else -100 for j, t in enumerate(x)] for x in ids],
        }
    )


@pytest.mark.parametrize("strategy", packtools.core.STRATEGIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identical_to_trl_under_1000_rows(strategy, seed):
    trl_data_utils = pytest.importorskip("trl.data_utils")
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 1000))
    max_length = int(rng.choice([8, 32, 64, 100]))
    ds = random_dataset(rng, n)
    ours = packtools.pack_dataset(ds, max_length, strategy)
    theirs = trl_data_utils.pack_dataset(ds, max_length, strategy)
    assert ours.column_names == theirs.column_names
    assert ours.num_rows == theirs.num_rows
    assert ours[:] == theirs[:]
    assert ours.features == theirs.features


def test_format_is_kept_and_seq_lengths_added():
    ds = random_dataset(np.random.default_rng(0), 50).with_format("numpy", columns=["input_ids"])
    out = packtools.pack_dataset(ds, 64)
    assert out.format["type"] == "numpy"
    assert out.format["columns"] == ["input_ids", "seq_lengths"]
    row = out[0]
    assert isinstance(row["input_ids"], np.ndarray)
    assert row["seq_lengths"].sum() == row["input_ids"].shape[0]


def test_indices_mapping_after_select_and_shuffle():
    ds = random_dataset(np.random.default_rng(1), 300)
    view = ds.shuffle(seed=0).select(range(120))
    out = packtools.pack_dataset(view, 50, "bfd_split")
    tokens, seq_lengths = reference_pack(view["input_ids"], 50, "bfd_split")
    assert out["input_ids"] == tokens
    assert out["seq_lengths"] == seq_lengths


def test_memory_mapped_multichunk_dataset(tmp_path):
    ds = random_dataset(np.random.default_rng(2), 2500)
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="20KB")
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert loaded.data.table.column("input_ids").num_chunks > 1
    out = packtools.pack_dataset(loaded, 128)
    tokens, seq_lengths = reference_pack(ds["input_ids"], 128, "bfd")
    assert out["input_ids"] == tokens
    assert out["seq_lengths"] == seq_lengths


def test_dataset_dict_packs_each_split():
    rng = np.random.default_rng(3)
    dd = datasets.DatasetDict({"train": random_dataset(rng, 80), "test": random_dataset(rng, 30)})
    out = packtools.pack_dataset(dd, 64, "wrapped")
    assert set(out) == {"train", "test"}
    for split in dd:
        flat = [t for row in dd[split]["input_ids"] for t in row]
        assert [t for row in out[split]["input_ids"] for t in row] == flat


def test_shuffle_reorders_rows_deterministically():
    ds = random_dataset(np.random.default_rng(4), 400)
    a = packtools.pack_dataset(ds, 64, shuffle=True, seed=7)
    b = packtools.pack_dataset(ds, 64, shuffle=True, seed=7)
    base = packtools.pack_dataset(ds, 64)
    assert a[:] == b[:]
    assert a["input_ids"] != base["input_ids"]
    assert sorted(map(tuple, a["input_ids"])) == sorted(map(tuple, base["input_ids"]))


def test_iterable_dataset_packs_in_windows():
    ds = random_dataset(np.random.default_rng(5), 250)
    stream = ds.to_iterable_dataset(num_shards=1)
    out = list(packtools.pack_dataset(stream, 64, window=100))
    expected = []
    for start in range(0, 250, 100):
        expected += reference_pack(ds["input_ids"][start : start + 100], 64, "bfd")[0]
    assert [r["input_ids"] for r in out] == expected
    assert all(sum(r["seq_lengths"]) == len(r["input_ids"]) for r in out)


def test_truncate_dataset():
    ds = random_dataset(np.random.default_rng(6), 40).with_format("numpy")
    out = packtools.integrations.truncate_dataset(ds, 5)
    assert out.format["type"] == "numpy"
    assert all(len(r) <= 5 for r in out["input_ids"])
    assert [list(r) for r in out["labels"]] == [r[:5] for r in ds.with_format(None)["labels"]]
    dd = packtools.integrations.truncate_dataset(datasets.DatasetDict({"a": ds}), 3)
    assert max(len(r) for r in dd["a"]["input_ids"]) <= 3


def test_errors_on_datasets():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "text": ["hello"]})
    with pytest.raises(packtools.PackingError, match=r"\['text'\] are not list columns"):
        packtools.pack_dataset(ds, 4)
    out = packtools.pack_dataset(ds, 4, columns=["input_ids"])
    assert out.column_names == ["input_ids", "seq_lengths"]
    with pytest.raises(packtools.PackingError, match="pack_table"):
        packtools.pack_dataset(pa.table({"input_ids": [[1]]}), 4)
    with pytest.raises(packtools.PackingError, match="window"):
        packtools.pack_dataset(ds.to_iterable_dataset(), 4, columns=["input_ids"], window=0)


def test_result_is_a_memory_mapped_cache_file_reused_on_rerun(tmp_path):
    ds = random_dataset(np.random.default_rng(7), 300)
    ds.save_to_disk(str(tmp_path / "ds"))
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    out = packtools.pack_dataset(loaded, 64, "bfd_split")
    in_memory = packtools.pack_dataset(loaded, 64, "bfd_split", keep_in_memory=True)
    assert out[:] == in_memory[:]
    assert in_memory.cache_files == []
    (cache,) = out.cache_files
    assert os.path.dirname(cache["filename"]) == str(tmp_path / "ds")
    stamp = os.stat(cache["filename"]).st_mtime_ns
    again = packtools.pack_dataset(loaded, 64, "bfd_split")
    assert again.cache_files == out.cache_files and os.stat(cache["filename"]).st_mtime_ns == stamp
    other = packtools.pack_dataset(loaded, 32, "bfd_split")
    assert other.cache_files[0]["filename"] != cache["filename"]
    # Blocks smaller than the data: several record batches, same rows.
    import packtools.integrations.data.datasets as hfd

    old = hfd.BLOCK_TOKENS
    hfd.BLOCK_TOKENS = 100
    try:
        blocked = packtools.pack_dataset(loaded, 64, "bfd_split", shuffle=True, seed=1)
    finally:
        hfd.BLOCK_TOKENS = old
    assert blocked.data.table.column("input_ids").num_chunks > 1
    assert (
        blocked[:]
        == packtools.pack_dataset(loaded, 64, "bfd_split", shuffle=True, seed=1, keep_in_memory=True)[:]
    )


def test_page_releaser_only_touches_read_only_file_mappings(tmp_path):
    from packtools.io.pages import PageReleaser

    anon = np.arange(1 << 16, dtype=np.int32)
    path = tmp_path / "x.arrow"
    table = pa.table({"x": anon})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    mapped = pa.ipc.open_file(pa.memory_map(str(path))).read_all().column("x").chunks[0].to_numpy()
    releaser = PageReleaser()
    assert releaser.release(anon) is False
    assert (anon == np.arange(1 << 16)).all()
    if os.path.exists("/proc/self/maps"):
        assert releaser.release(mapped) is True
    assert (mapped == np.arange(1 << 16)).all()  # pages come back from the file


def test_in_memory_dataset_packs_in_memory_unless_asked():
    ds = random_dataset(np.random.default_rng(8), 200)
    assert ds.cache_files == []
    assert packtools.pack_dataset(ds, 64).cache_files == []
    on_disk = packtools.pack_dataset(ds, 64, keep_in_memory=False)
    assert len(on_disk.cache_files) == 1
    assert on_disk[:] == packtools.pack_dataset(ds, 64)[:]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"seq_lengths": [[2], [1]]}, "already has a 'seq_lengths' column"),
        ({"position_ids": [[0, 0], [0]]}, r"row 0: 'position_ids' restart inside the row"),
        ({"cu_seq_lens_q": [[0, 2], [0, 1]]}, r"\['cu_seq_lens_q'\], columns that only packed"),
        ({"seq_idx": [[0, 1], [0]]}, r"\['seq_idx'\]"),
    ],
)
def test_already_packed_datasets_are_refused_even_without_seq_lengths(extra, match):
    """Packing packed rows again would merge their sequences: refused from whatever shows they are packed."""
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], **extra})
    with pytest.raises(packtools.PackingError, match=match):
        packtools.pack_dataset(ds, 8)
    with pytest.raises(packtools.PackingError, match=match):  # naming the columns does not get around it
        packtools.pack_dataset(ds, 8, columns=["input_ids"])
    with pytest.raises(packtools.PackingError, match=match):
        list(packtools.pack_dataset(ds.to_iterable_dataset(), 8))


def test_position_ids_that_count_up_do_not_look_packed():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "position_ids": [[0, 1, 2], [0, 1]]})
    out = packtools.pack_dataset(ds, 8)
    assert out[0]["position_ids"] == [0, 1, 2, 0, 1] and out[0]["seq_lengths"] == [3, 2]
    with pytest.raises(packtools.PackingError, match="position_ids' restart"):
        packtools.pack_dataset(out.remove_columns("seq_lengths"), 8)  # the silent re-pack of issue 11


def test_pack_dataset_refuses_padded_rows():
    """The common slip: tokenizer(..., padding="max_length") before packing. Refused, naming the row."""
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[5, 6, 7], [8, 0, 0]], "attention_mask": [[1, 1, 1], [1, 0, 0]]}
    )
    with pytest.raises(packtools.PackingError, match="first in row 1, position 1"):
        packtools.pack_dataset(ds, 8)


def _mask_first(batch):
    """A transform that masks each document's first two tokens (its 'prompt') in labels it adds."""
    return {**batch, "labels": [[-100, -100] + list(r[2:]) for r in batch["input_ids"]]}


def test_a_dataset_with_a_transform_is_refused_not_packed_raw():
    """adv46: ``pack_dataset`` / ``packed_view`` read a ``with_transform`` dataset's stored Arrow data: the labels
    the transform makes (what ``datasets.map`` sees) were left out of the packed rows (the view trained every
    prompt token), and ``pack_dataset`` put the transform back on the packed rows, so each row's first two tokens
    were masked instead of each document's.  Now refused naming the transform and the fix."""
    from packtools.errors import PackingError
    from packtools.integrations import truncate_dataset

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]})
    shown = ds.with_transform(_mask_first)
    assert shown.map(lambda r: {"n": sum(x != -100 for x in r["labels"])}).with_format(None)["n"] == [2, 1, 1]
    for call in (
        lambda: packtools.pack_dataset(shown, 16),
        lambda: packtools.packed_view(shown, 16),
        lambda: truncate_dataset(shown, 2),
    ):
        with pytest.raises(PackingError, match=r"transform \('_mask_first'.*with_format\(None\)\.map"):
            call()
    # the fix the message gives: the transform applied first, every document keeps its own mask
    packed = packtools.pack_dataset(ds.with_format(None).map(_mask_first, batched=True), 16)
    assert packed[0]["labels"] == [-100, -100, 3, 4, -100, -100, 7, -100, -100, 10]
