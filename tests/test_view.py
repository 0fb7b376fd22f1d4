"""Packed views: rows gathered on demand from the source buffers equal the rows pack_table/pack_dataset write."""

import io
import pickle

import numpy as np
import pyarrow as pa
import pytest

from packtools import pack_dataset, pack_table, packed_view, plan
from packtools.batches.collate import PaddingFreeCollator
from packtools.batches.loader import ArrowCollator, PackedRows
from packtools.batches.sampler import TokenBudgetBatchSampler
from packtools.batches.view import PackedRow, PackedView
from packtools.core import STRATEGIES
from packtools.errors import PackingError

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()


def token_table(n=300, seed=0, chunk=None, masks=True, mean=3.0):
    """Lognormal lengths (some empty, some over 64), input_ids, labels and a completion mask."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean, 0.9, n).astype(np.int64)
    lengths[::37] = 0
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(1, 1000, int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(ids.shape[0]) < 0.2, -100, ids).astype(np.int64)
    cols = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
    }
    if masks:
        mask = (rng.random(ids.shape[0]) < 0.7).astype(np.int8)
        cols["completion_mask"] = pa.LargeListArray.from_arrays(
            pa.array(offsets.astype(np.int64)), pa.array(mask)
        )
    table = pa.table(cols)
    if chunk == "separate":  # chunks in separately allocated buffers (several sources)
        table = pa.concat_tables(
            pa.table({k: pa.array(c.to_pylist(), c.type) for k, c in zip(table.column_names, t.columns)})
            for t in table.to_batches(max_chunksize=50)
        )
    elif chunk:  # slices of the same buffers (one source)
        table = pa.Table.from_batches(table.to_batches(max_chunksize=chunk))
    return table


def assert_rows_equal(view, packed: pa.Table):
    assert len(view) == packed.num_rows
    assert view.column_names == packed.column_names
    for i in range(packed.num_rows):
        row = view[i]
        for name in packed.column_names:
            expected = packed.column(name)[i].values.to_numpy(zero_copy_only=False)
            np.testing.assert_array_equal(row[name], expected)
            assert row[name].dtype == expected.dtype, name


def assert_batches_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k])
            assert a[k].dtype == b[k].dtype, k
        else:
            assert a[k] == b[k], k


def ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("chunk", [None, 41, "separate"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_view_of_a_table_is_pack_table(strategy, chunk, shuffle):
    table = token_table(chunk=chunk)
    view = packed_view(table, 64, strategy, shuffle=shuffle, seed=3)
    sources = len(view._source.sources["input_ids"])
    assert sources == (table.column("input_ids").num_chunks if chunk == "separate" else 1)
    packed = pack_table(table, 64, strategy, shuffle=shuffle, seed=3)
    assert type(view) is PackedView
    materialized = view.materialize()
    assert materialized.equals(packed) and ipc_bytes(materialized) == ipc_bytes(packed)
    assert_rows_equal(view, packed)
    np.testing.assert_array_equal(view.lengths, packed.column("input_ids").combine_chunks().value_lengths())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("masks", [True, False])
def test_view_batches_equal_packed_rows_batches(strategy, masks):
    table = token_table(chunk="separate", masks=masks)
    if not masks:
        table = table.drop_columns(["labels"])
    view = packed_view(table, 64, strategy)
    rows = PackedRows(view.materialize())
    # wrapped rows carry no seq_lengths: the collator takes them as one sequence each only when told so
    collator = PaddingFreeCollator(0, return_tensors="np", unpacked=strategy == "wrapped")
    rng = np.random.default_rng(1)
    for _ in range(20):
        idx = rng.choice(len(view), size=int(rng.integers(1, 6)), replace=False).tolist()
        expected = ArrowCollator(rows, collator)(idx)
        assert_batches_equal(ArrowCollator(view, collator)(idx), expected)
        # the lazy rows a DataLoader gets: ArrowCollator gathers them at once, any collator reads them as dicts
        lazy = view.__getitems__(idx)
        assert all(isinstance(r, PackedRow) for r in lazy)
        assert_batches_equal(ArrowCollator(view, collator)(lazy), expected)
        assert_batches_equal(collator(lazy), expected)


def in_memory(table):
    return datasets.Dataset(table)


def on_disk(table, tmp_path):
    datasets.Dataset(table).save_to_disk(str(tmp_path / "ds"), max_shard_size="20KB")
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    assert len(ds.cache_files) > 1
    return ds


@pytest.mark.parametrize("source", ["memory", "disk"])
@pytest.mark.parametrize("mapping", [None, "select", "shuffle"])
@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_materialize_is_pack_dataset_byte_for_byte(tmp_path, source, mapping, strategy):
    table = token_table(masks=False)
    ds = in_memory(table) if source == "memory" else on_disk(table, tmp_path)
    if mapping == "select":
        ds = ds.select(range(0, len(ds), 3))
    elif mapping == "shuffle":
        ds = ds.shuffle(seed=4)
    ds = ds.with_format("numpy")
    view = packed_view(ds, 64, strategy, shuffle=True, seed=2)
    with datasets.disable_caching_context() if hasattr(datasets, "disable_caching_context") else _no_cache():
        expected = pack_dataset(ds, 64, strategy, shuffle=True, seed=2)
        expected_bytes = _file_bytes(expected)
        got = view.materialize()
    assert got.format == expected.format and got._fingerprint == expected._fingerprint
    assert got.data.table.equals(expected.data.table)
    assert ipc_bytes(got.data.table) == ipc_bytes(expected.data.table)
    if source == "disk":  # both wrote a cache file: the same bytes
        assert expected_bytes is not None and _file_bytes(got) == expected_bytes
    assert_rows_equal(view, expected.data.table)


class _no_cache:
    def __enter__(self):
        self.was = datasets.is_caching_enabled()
        datasets.disable_caching()

    def __exit__(self, *exc):
        if self.was:
            datasets.enable_caching()


def _file_bytes(ds):
    files = ds.cache_files
    if not files:
        return None
    with open(files[0]["filename"], "rb") as fh:
        return fh.read()


def test_dataset_dict_gives_a_view_per_split():
    dd = datasets.DatasetDict({"train": in_memory(token_table()), "test": in_memory(token_table(50, seed=1))})
    views = packed_view(dd, 64)
    assert set(views) == {"train", "test"}
    assert views["test"].materialize().data.table.equals(pack_dataset(dd, 64)["test"].data.table)


def test_pickle_sends_plan_and_paths_not_tokens(tmp_path):
    table = token_table(2000, masks=False, mean=4.0)
    ds = on_disk(table, tmp_path).shuffle(seed=1)
    view = packed_view(ds, 128)
    blob = pickle.dumps(view)
    tokens = sum(
        b.size for c in table.columns for chunk in c.chunks for b in chunk.buffers() if b is not None
    )
    plan_bytes = sum(a.nbytes for a in (view.plan.seg_source, view.plan.seg_start, view.plan.seg_length))
    assert len(blob) < plan_bytes + view.plan.source_lengths.nbytes + 20 * 2000 + 50_000 < tokens
    assert str(tmp_path) in blob.decode("latin-1")
    copy = pickle.loads(blob)
    collator = PaddingFreeCollator(0, return_tensors="np")
    assert_batches_equal(ArrowCollator(copy, collator)([5, 0, 3]), ArrowCollator(view, collator)([5, 0, 3]))
    # an in-memory table travels with its data and still works
    small = packed_view(token_table(), 64)
    assert pickle.loads(pickle.dumps(small)).materialize().equals(small.materialize())


def test_state_is_a_few_dozen_bytes_per_sequence():
    table = token_table(5000, masks=True, chunk=700)
    view = packed_view(table, 64, "bfd_split")
    # plan (3 x 8 bytes per segment, 8 per sequence, 8 per row) + one shared offsets array (8 per table row)
    p = view.plan
    assert view.state_bytes == 24 * p.num_segments + 8 * p.num_sequences + 8 * (p.num_rows + 1) + 8 * 5000


torch = pytest.importorskip("torch")


def torch_batches(loader):
    return [{k: v.numpy() if hasattr(v, "numpy") else v for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_over_view_equals_materialized_rows(workers, tmp_path):
    ds = on_disk(token_table(600, mean=3.5), tmp_path)
    view = packed_view(ds, 96)
    rows = PackedRows(view.materialize())
    collator = PaddingFreeCollator(0)
    batches = {}
    for name, data in (("view", view), ("rows", rows)):
        sampler = TokenBudgetBatchSampler(data.lengths, 256, seed=3, seq_lengths=data.seq_lengths)
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=sampler, collate_fn=ArrowCollator(data, collator), num_workers=workers
        )
        batches[name] = torch_batches(loader)
    assert len(batches["view"]) == len(batches["rows"]) > 5
    for a, b in zip(batches["view"], batches["rows"]):
        assert_batches_equal(a, b)


@pytest.mark.slow
def test_dataloader_spawned_worker_reopens_the_files(tmp_path):
    ds = on_disk(token_table(300, masks=False), tmp_path)
    view = packed_view(ds, 64)
    collator = PaddingFreeCollator(0)
    loader = torch.utils.data.DataLoader(
        view,
        batch_size=3,
        collate_fn=ArrowCollator(view, collator),
        num_workers=1,
        multiprocessing_context="spawn",
    )
    expected = [
        ArrowCollator(view, collator)(list(range(i, min(i + 3, len(view))))) for i in range(0, len(view), 3)
    ]
    got = list(loader)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert_batches_equal(torch_batches([a])[0], torch_batches([b])[0])


def test_readme_loop_trains_the_same_on_a_view():
    from _hf_models import sequences, tiny_llama
    from _scripts import script

    loop = script("train_loop")
    ds = datasets.Dataset.from_list(sequences(40, seed=7))
    losses = {}
    for name, data in (
        ("dataset", pack_dataset(ds, 32, "bfd_split")),
        ("view", packed_view(ds, 32, "bfd_split")),
    ):
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(
            data, batch_size=2, shuffle=True, collate_fn=PaddingFreeCollator(0)
        )
        model = tiny_llama("sdpa")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = loop.train(model, loader, optimizer, accumulation_steps=2)
    assert len(losses["view"]) > 3 and losses["view"] == losses["dataset"]


def test_trainer_with_prepare_trainer_trains_the_same_on_a_view(tmp_path):
    from _hf_models import max_diff, params, sequences, tiny_llama
    from test_hf import train_args

    from packtools.integrations.trainers.transformers import prepare_trainer

    transformers = pytest.importorskip("transformers")
    ds = datasets.Dataset.from_list(sequences(40, seed=5))
    trained = {}
    for name, data in (("dataset", pack_dataset(ds, 32)), ("view", packed_view(ds, 32))):
        model = tiny_llama("sdpa")
        collator = PaddingFreeCollator(0)
        if name == "view":
            collator = ArrowCollator(data, collator)
        trainer = transformers.Trainer(
            model=model, args=train_args(tmp_path / name), train_dataset=data, data_collator=collator
        )
        prepare_trainer(trainer).train()
        trained[name] = params(model)
    assert max_diff(trained["view"], trained["dataset"]) == 0.0
    assert max_diff(trained["view"], params(tiny_llama("sdpa"))) > 1e-2  # it trained


def test_errors_name_the_problem():
    table = token_table(masks=False)
    with pytest.raises(PackingError, match="other lengths"):
        PackedView(table, plan([3, 4], 64))
    with pytest.raises(PackingError, match="pyarrow.Table"):
        PackedView({"input_ids": [[1]]}, plan([1], 4))
    view = packed_view(table, 64)
    with pytest.raises(IndexError, match="out of range"):
        view[len(view)]
    with pytest.raises(TypeError, match="gather"):
        view[0:2]
    with pytest.raises(PackingError, match="IterableDataset"):
        packed_view(in_memory(table).to_iterable_dataset(), 64)
    with pytest.raises(PackingError, match="integers"):
        packed_view(pa.table({"input_ids": [[1.0, 2.0]]}), 4)
    with pytest.raises(PackingError, match="strategy"):
        packed_view(table, 64, "first_fit")
    with pytest.raises(PackingError, match="several PackedViews"):
        other = packed_view(table, 64)
        ArrowCollator(view, PaddingFreeCollator(0))([view.__getitems__([0])[0], other.__getitems__([1])[0]])
    assert view[-1]["input_ids"].tolist() == view[len(view) - 1]["input_ids"].tolist()


def test_docs_static_shapes_view_block_runs():
    import re
    from pathlib import Path

    import packtools

    doc = (Path(__file__).parents[1] / "docs" / "batches.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "pad_to_buckets" in b)
    ds = datasets.Dataset(token_table(400, masks=False, mean=5.0))
    scope = {"packtools": packtools, "ds": ds, "DataLoader": torch.utils.data.DataLoader}
    exec(compile(block, "docs/batches.md view block", "exec"), scope)
    batches = list(scope["loader"])
    assert len(batches) == len(scope["sampler"]) > 1
    assert {b["input_ids"].shape[1] for b in batches} <= set(scope["sampler"].buckets)


def test_view_batches_follow_the_collators_loss_mask_switch():
    # Without a labels column the completion mask decides the labels, unless the collator turns it off;
    # every way the view builds a batch must follow that switch, like PackedRows does.
    table = token_table().drop_columns(["labels"])
    view = packed_view(table, 64)
    rows = PackedRows(view.materialize())
    idx = [[0, 1, 2], [3, 4]]
    for collator in (
        PaddingFreeCollator(0, return_tensors="np"),
        PaddingFreeCollator(0, return_tensors="np", completion_only_loss=False),
    ):
        expected = [ArrowCollator(rows, collator)(i) for i in idx]
        for got, want in zip(view.iter_batches(idx, collator), expected):
            assert_batches_equal(got, want)
        for i, want in zip(idx, expected):
            assert_batches_equal(ArrowCollator(view, collator)(i), want)
    masked = ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np"))(idx[0])["labels"]
    plain = ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np", completion_only_loss=False))(
        idx[0]
    )
    assert (masked == -100).sum() > (plain["labels"] == -100).sum()  # the switch changes something here


def test_warmup_compiles_the_view_and_plan_check_kernels():
    """After packtools.core.warmup() a packed view's first gather compiles nothing new (fresh process)."""
    import subprocess
    import sys

    code = """
import pyarrow as pa, packtools
from packtools.core import kernels
packtools.core.warmup()
names = ("view_segments", "gather_scattered", "plan_violation")
before = {k: set(getattr(kernels, k).signatures) for k in names}
t = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5], [6]], pa.list_(pa.int32())),
              "labels": pa.array([[1, 2, 3], [4, 5], [6]], pa.list_(pa.int64()))})
view = packtools.packed_view(t, 4)
view.gather([0, 1]); view[0]
after = {k: set(getattr(kernels, k).signatures) for k in names}
assert all(before[k] for k in names), before
assert after == before, {k: after[k] - before[k] for k in names}
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
