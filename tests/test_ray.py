"""The Ray executor (through the command line, which starts its own local Ray with 2 CPUs) and the Ray Data
adapter (on a local Ray started here); skipped when ray is not installed."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from packtools.integrations import pack_ray_dataset

# Ray starts worker processes; in .ci/run, not in the README's quick command.  One xdist group: one local Ray
# cluster at a time (the module keeps its cluster for all its tests)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from test_pipeline_engine import MAX_LENGTH, executor_args, folder_digest, make_inputs, tokenized_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_ray_executor_writes_the_same_bytes_as_local(tmp_path):
    """``--executor ray`` from a fresh process: packtools starts a local Ray (2 CPUs), runs the read and write
    stages as Ray tasks, shuts Ray down, and the folder is the same bytes as with ``--executor local``."""
    paths, _ = make_inputs(str(tmp_path / "in"))
    args = executor_args(paths)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    for name, extra in (("local", []), ("ray", ["--executor", "ray", "--workers", "2"])):
        cmd = [sys.executable, "-m", "packtools.cli", "pack", *args, "--out", str(tmp_path / name), *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    local = folder_digest(str(tmp_path / "local"))
    assert len(local) > 5 and local == folder_digest(str(tmp_path / "ray"))


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
    folder = tmp_path_factory.mktemp("in")
    paths, first = [], 0
    for i, n in enumerate((300, 250, 400, 50)):
        ids = tokenized_table(n, seed=i, first_id=first).column("input_ids").combine_chunks()
        first += len(ids.values)
        labels = pa.ListArray.from_arrays(ids.offsets, pc.negate(ids.values))
        t = pa.table({"input_ids": ids, "labels": labels})
        paths.append(str(folder / f"part-{i}.parquet"))
        pq.write_table(t, paths[-1])
    return paths


def dataset(inputs):
    """One block per file.  (Not ray.data.read_parquet: with fsspec installed but not aiohttp, Ray 2.60's
    parallel path resolution can race on a half-imported fsspec.implementations.http and fail.)"""
    return ray.data.from_arrow([pq.read_table(p) for p in inputs])


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


@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_ray_data_adapter_refuses_processed_vision_rows(ray_local, columns):
    """pack_ray_dataset(columns=['input_ids']) packed each block's token column and left pixel_values /
    image_grid_thw out, no error: image placeholder tokens in input_ids with no pixels. Refused now, up front
    when the dataset knows its schema, and by pack_table at the first block when it does not."""
    from packtools.errors import PackingError

    rows = pa.table(
        {
            "input_ids": [[1, 9, 2], [3, 4]],
            "pixel_values": [np.ones((4, 6)).tolist(), []],
            "image_grid_thw": [[[1, 2, 2]], []],
        }
    )
    with pytest.raises(PackingError, match=r"vision-language rows \(\['pixel_values', 'image_grid_thw'\]\)"):
        pack_ray_dataset(ray.data.from_arrow(rows), MAX_LENGTH, "bfd", columns=columns)
    unknown = ray.data.from_arrow(rows).map_batches(lambda b: b, batch_format="pyarrow")  # schema not known
    with pytest.raises(Exception, match="pack_table plans token columns only"):
        pack_ray_dataset(unknown, MAX_LENGTH, "bfd", columns=columns).take_all()
