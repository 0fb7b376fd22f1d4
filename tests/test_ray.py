"""The Ray executor and the Ray Data adapter on a local Ray (2 CPUs); skipped when ray is not installed."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from packtools import pack_ray_dataset, pack_shards
from packtools.pipeline.shards import FAIL_ENV

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from test_shards import MAX_LENGTH, make_inputs, read_outputs  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("in"))


def dataset(inputs):
    """One block per file.  (Not ray.data.read_parquet: with fsspec installed but not aiohttp, Ray 2.60's
    parallel path resolution can race on a half-imported fsspec.implementations.http and fail.)"""
    return ray.data.from_arrow([pq.read_table(p) for p in inputs])


def test_ray_executor_gives_the_same_shards_as_local(ray_local, inputs, tmp_path):
    local = pack_shards(inputs, tmp_path / "local", MAX_LENGTH, "bfd", shard_rows=100)
    on_ray = pack_shards(inputs, tmp_path / "ray", MAX_LENGTH, "bfd", shard_rows=100, executor="ray")
    assert on_ray.executor == "ray" and on_ray.ok and ray_local.is_initialized()  # a running Ray is reused
    lo, ra = read_outputs(local), read_outputs(on_ray)
    assert lo.keys() == ra.keys() and len(lo) == 10
    for k in lo:
        assert ra[k].equals(lo[k])  # same rows, same tokens, shard by shard
    assert on_ray.totals() == local.totals()
    again = pack_shards(inputs, tmp_path / "ray", MAX_LENGTH, "bfd", shard_rows=100, executor="ray")
    assert {s.status for s in again.shards} == {"skipped"}


def test_ray_failing_shard_is_reported_while_others_land(ray_local, inputs, tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "part-0.0-100,part-3:1")  # one always fails, one fails once
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, shard_rows=100, executor="ray", retries=1)
    [bad] = report.failed
    assert bad.shard_id.startswith("part-0.0-100.") and bad.attempts == 2 and "InjectedFailure" in bad.error
    assert not os.path.exists(bad.output)
    [retried] = [s for s in report.shards if s.shard_id.startswith("part-3")]
    assert retried.status == "packed" and retried.attempts == 2
    assert sum(s.status == "packed" for s in report.shards) == 9


def test_ray_data_adapter_packs_every_token(ray_local, inputs):
    ds = dataset(inputs)
    full = pa.concat_tables(ray.get(pack_ray_dataset(ds, MAX_LENGTH, "bfd_split").to_arrow_refs()))
    assert pc.list_value_length(full.column("input_ids")).to_numpy().max() <= MAX_LENGTH
    src = pa.concat_tables(pq.read_table(p) for p in inputs).column("input_ids")
    tokens = np.sort(pc.list_flatten(full.column("input_ids")).to_numpy())
    assert np.array_equal(tokens, np.sort(pc.list_flatten(src).to_numpy()))  # every token exactly once
    labels = pc.list_flatten(full.column("labels")).to_numpy()
    assert np.array_equal(labels, -pc.list_flatten(full.column("input_ids")).to_numpy())


def test_ray_data_adapter_with_limit_downstream(ray_local, inputs):
    # With bfd the first rows of a packed block are full rows made of one truncated long sequence.  Were
    # limit(3) pushed below the packer, only the first 3 input rows would be packed, and in no file are those
    # all >= MAX_LENGTH long, so their rows could not all be full.
    for p in inputs:
        first = pc.list_value_length(pq.read_table(p).column("input_ids")).to_numpy()[:3]
        assert not (first >= MAX_LENGTH).all()
    packed = pack_ray_dataset(dataset(inputs), MAX_LENGTH, "bfd", columns=["input_ids", "labels"])
    top = packed.limit(3).take_all()
    assert len(top) == 3
    for row in top:
        assert list(row["seq_lengths"]) == [MAX_LENGTH] == [len(row["input_ids"])]
        assert [-v for v in row["labels"]] == list(row["input_ids"])


def test_ray_executor_reports_exceptions_and_dead_workers(ray_local):
    from packtools.pipeline.executors import RayExecutor

    ex = RayExecutor()
    out = dict(ex.run(abs, [-1, "x"]))
    assert out[0] == 1 and isinstance(out[1], TypeError)
    [(i, outcome)] = list(ex.run(os._exit, [3]))  # the worker process dies
    assert i == 0 and isinstance(outcome, Exception)
    ex.close()
    assert ray_local.is_initialized()  # close() leaves a runtime it did not start
