"""Sharded packing with the local executors: shard plan, outputs, manifest, reruns, failures, CLI."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packtools
from packtools import pack_shards
from packtools.cli.main import main
from packtools.pipeline.executors import get_executor
from packtools.pipeline.shards import FAIL_ENV, MANIFEST, read_shard, row_ranges, shard_id

MAX_LENGTH = 64
ROWS = (300, 250, 400, 50)


def make_inputs(folder, rows=ROWS, seed=0, row_group_size=None):
    """Four small tokenized parquet files (input_ids + labels), token ids unique."""
    rng = np.random.default_rng(seed)
    paths, next_id = [], 0
    os.makedirs(folder, exist_ok=True)
    for f, n in enumerate(rows):
        lengths = rng.integers(0, 90, n)  # some empty, some longer than MAX_LENGTH
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        ids = np.arange(next_id, next_id + offsets[-1], dtype=np.int32)
        next_id += int(offsets[-1])
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        labels = pa.ListArray.from_arrays(pa.array(offsets), pa.array(-ids))
        path = os.path.join(folder, f"part-{f}.parquet")
        pq.write_table(pa.table({"input_ids": col, "labels": labels}), path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def read_outputs(report):
    return {s.shard_id: pq.read_table(s.output) for s in report.shards if s.status != "failed"}


@pytest.fixture
def inputs(tmp_path):
    return make_inputs(tmp_path / "in")


def test_row_ranges_cover_rows_with_at_least_shard_rows():
    rng = np.random.default_rng(0)
    for n in (0, 1, 99, 100, 199, 200, 1001, 5000):
        for blocks in (
            None,
            [n],
            [37] * (n // 37) + [n % 37],
            list(np.diff(np.sort(rng.integers(0, n + 1, 6)), prepend=0, append=n)),
        ):
            if blocks is not None:
                blocks = [int(b) for b in blocks]
                assert sum(blocks) == n
            ranges = row_ranges(n, 100, blocks)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if n >= 100:
                assert all(b - a >= 100 for a, b in ranges)
            if blocks is None:
                assert all(b - a < 200 for a, b in ranges)


def test_shards_follow_parquet_row_groups(tmp_path):
    inputs = make_inputs(tmp_path / "in", rows=(300, 1000), row_group_size=64)
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, "bfd_split", shard_rows=100)
    assert [(s.row_start, s.row_stop) for s in report.shards][:2] == [(0, 128), (128, 300)]
    for s in report.shards:
        assert s.row_start % 64 == 0 and s.row_stop - s.row_start >= 100
        expected = packtools.pack_table(
            pq.read_table(s.input).slice(s.row_start, s.row_stop - s.row_start), MAX_LENGTH, "bfd_split"
        )
        assert pq.read_table(s.output).select(expected.column_names).equals(expected)


def test_each_shard_is_pack_table_of_its_rows(inputs, tmp_path):
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, "bfd_split", shard_rows=100)
    assert report.ok and len(report.shards) == 3 + 2 + 4 + 1
    outs = read_outputs(report)
    for s in report.shards:
        assert s.status == "packed" and os.path.basename(s.output) == s.shard_id + ".parquet"
        expected = packtools.pack_table(
            read_shard(s.input, s.row_start, s.row_stop, None), MAX_LENGTH, "bfd_split"
        )
        assert outs[s.shard_id].select(expected.column_names).equals(expected)
        assert s.stats["rows_out"] == expected.num_rows
    # every token lands exactly once (bfd_split keeps all), aligned columns stay aligned
    whole = pa.concat_tables(pq.read_table(p) for p in inputs)
    tokens = np.sort(
        np.concatenate([pa.compute.list_flatten(t.column("input_ids")).to_numpy() for t in outs.values()])
    )
    assert np.array_equal(tokens, np.sort(pa.compute.list_flatten(whole.column("input_ids")).to_numpy()))
    for t in outs.values():
        flat = pa.compute.list_flatten
        assert np.array_equal(flat(t.column("labels")).to_numpy(), -flat(t.column("input_ids")).to_numpy())


def test_manifest_lists_shards_inputs_config_and_totals(inputs, tmp_path):
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, "bfd", shard_rows=100)
    with open(tmp_path / "out" / MANIFEST) as fh:
        m = json.load(fh)
    assert m["config"] == {"max_length": MAX_LENGTH, "strategy": "bfd", "columns": None, "shard_rows": 100}
    assert m["inputs"] == [os.path.abspath(p) for p in inputs]
    assert [s["id"] for s in m["shards"]] == [s.shard_id for s in report.shards]
    tokens_kept = sum(s["stats"]["tokens_kept"] for s in m["shards"])
    rows_out = sum(s["stats"]["rows_out"] for s in m["shards"])
    t = m["totals"]
    assert t["rows_in"] == sum(ROWS) and t["rows_out"] == rows_out
    assert t["lower_bound"] == -(-tokens_kept // MAX_LENGTH)
    assert t["rows_over_bound"] == rows_out - t["lower_bound"] >= 0
    for s in m["shards"]:
        assert s["output_bytes"] == os.path.getsize(tmp_path / "out" / s["output"])
        assert s["stats"]["rows_over_bound"] == s["stats"]["rows_out"] - s["stats"]["lower_bound"]


def test_shard_ids_come_from_path_and_range_not_order(inputs, tmp_path):
    a = pack_shards(inputs, tmp_path / "a", MAX_LENGTH, shard_rows=100)
    b = pack_shards(inputs[::-1], tmp_path / "b", MAX_LENGTH, shard_rows=100)
    assert sorted(s.shard_id for s in a.shards) == sorted(s.shard_id for s in b.shards)
    s = a.shards[1]
    assert s.shard_id == shard_id(s.input, s.row_start, s.row_stop) and s.shard_id.startswith(
        "part-0.100-200."
    )


def test_pool_executor_gives_the_same_shards(inputs, tmp_path):
    local = pack_shards(inputs, tmp_path / "local", MAX_LENGTH, "bfd", shard_rows=100)
    pool = pack_shards(
        inputs, tmp_path / "pool", MAX_LENGTH, "bfd", shard_rows=100, executor="pool", workers=2
    )
    assert pool.executor == "pool" and pool.ok
    lo, po = read_outputs(local), read_outputs(pool)
    assert lo.keys() == po.keys()
    for k in lo:
        assert po[k].equals(lo[k])


def test_rerun_skips_done_shards_and_redoes_changed_ones(inputs, tmp_path):
    out = tmp_path / "out"
    first = pack_shards(inputs, out, MAX_LENGTH, shard_rows=100)
    mtimes = {s.shard_id: os.stat(s.output).st_mtime_ns for s in first.shards}
    again = pack_shards(inputs, out, MAX_LENGTH, shard_rows=100)
    assert {s.status for s in again.shards} == {"skipped"}
    assert {s.shard_id: os.stat(s.output).st_mtime_ns for s in again.shards} == mtimes
    assert again.totals()["rows_out"] == first.totals()["rows_out"]
    os.unlink(out / MANIFEST)  # as if the driver died before writing it: the footers still tell what is done
    assert {s.status for s in pack_shards(inputs, out, MAX_LENGTH, shard_rows=100).shards} == {"skipped"}
    # a lost output, a truncated output and a changed input are packed again; the rest is skipped
    os.unlink(first.shards[3].output)  # part-1
    with open(first.shards[5].output, "r+b") as fh:  # part-2
        fh.truncate(100)
    new = make_inputs(tmp_path / "new", seed=1)
    os.replace(new[0], inputs[0])  # part-0 gets other content
    third = pack_shards(inputs, out, MAX_LENGTH, shard_rows=100)
    status = {s.shard_id: s.status for s in third.shards}
    redo = {s.shard_id for s in first.shards if s.input == os.path.abspath(inputs[0])}
    redo |= {first.shards[3].shard_id, first.shards[5].shard_id}
    assert {k for k, v in status.items() if v == "packed"} == redo and len(redo) == 5
    # a worker that died while writing left a temp file: it is removed, never taken for an output
    (out / ".packtools-dead.parquet").write_bytes(b"PAR1 partial")
    pack_shards(inputs, out, MAX_LENGTH, shard_rows=100)
    assert not (out / ".packtools-dead.parquet").exists()
    # a different config packs everything again
    fourth = pack_shards(inputs, out, MAX_LENGTH // 2, shard_rows=100)
    assert {s.status for s in fourth.shards} == {"packed"}


def test_failing_shard_is_reported_while_the_others_land(inputs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    pack_shards(inputs, out, MAX_LENGTH, shard_rows=100)  # outputs of another config exist
    monkeypatch.setenv(FAIL_ENV, "part-2.100-200")
    report = pack_shards(inputs, out, MAX_LENGTH // 2, shard_rows=100, retries=1)
    assert not report.ok
    [bad] = report.failed
    assert bad.shard_id.startswith("part-2.100-200.") and bad.attempts == 2
    assert "InjectedFailure" in bad.error and bad.shard_id in bad.error
    assert not os.path.exists(bad.output)  # the stale output of the old config is gone, nothing partial left
    assert all(os.path.exists(s.output) for s in report.shards if s is not bad)
    assert [p for p in os.listdir(out) if p.startswith(".")] == []
    with open(out / MANIFEST) as fh:
        listed = {s["id"]: s for s in json.load(fh)["shards"]}
    assert listed[bad.shard_id]["status"] == "failed" and "InjectedFailure" in listed[bad.shard_id]["error"]
    assert report.totals()["failed"] == 1 and report.totals()["packed"] == len(report.shards) - 1
    # the next run (failure gone) packs only that shard
    monkeypatch.delenv(FAIL_ENV)
    rerun = pack_shards(inputs, out, MAX_LENGTH // 2, shard_rows=100)
    assert [s.shard_id for s in rerun.shards if s.status == "packed"] == [bad.shard_id]


def test_a_failure_is_retried(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "part-3:1")
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, shard_rows=100, executor="local", retries=1)
    [s] = [s for s in report.shards if s.shard_id.startswith("part-3")]
    assert report.ok and s.status == "packed" and s.attempts == 2 and s.error is None
    monkeypatch.setenv(FAIL_ENV, "part-3:1")
    report = pack_shards(inputs, tmp_path / "out2", MAX_LENGTH, shard_rows=100, retries=0)
    assert [s.shard_id[:6] for s in report.failed] == ["part-3"]


def test_one_shard_per_file_and_columns(inputs, tmp_path):
    report = pack_shards(inputs, tmp_path / "out", MAX_LENGTH, "wrapped", ["input_ids"], shard_rows=None)
    assert [(s.row_start, s.row_stop) for s in report.shards] == [(0, n) for n in ROWS]
    for t in read_outputs(report).values():
        assert t.column_names == ["input_ids"]
        assert all(n == MAX_LENGTH for n in pa.compute.list_value_length(t.column(0)).to_pylist()[:-1])


def test_bad_arguments_name_the_fix(inputs, tmp_path):
    with pytest.raises(packtools.PackingError, match="shard_rows"):
        pack_shards(inputs, tmp_path / "o", MAX_LENGTH, shard_rows=-1)
    with pytest.raises(packtools.PackingError, match="twice"):
        pack_shards([inputs[0], inputs[0]], tmp_path / "o", MAX_LENGTH)
    with pytest.raises(FileNotFoundError):
        pack_shards([str(tmp_path / "missing.parquet")], tmp_path / "o", MAX_LENGTH)
    with pytest.raises(packtools.PackingError, match="executor"):
        get_executor("spark")
    with pytest.raises(packtools.PackingError, match="are not in"):
        pack_shards(inputs, tmp_path / "o", MAX_LENGTH, columns=["nope"], retries=0)


def test_cli_shard_pack(inputs, tmp_path, capsys, monkeypatch):
    argv = [
        "shard-pack",
        *inputs,
        "--out",
        str(tmp_path / "out"),
        "--max-length",
        "64",
        "--shard-rows",
        "100",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "10 shards (10 packed, 0 skipped, 0 failed)" in text and "manifest:" in text
    assert main(argv) == 0
    assert "(0 packed, 10 skipped, 0 failed)" in capsys.readouterr().out
    monkeypatch.setenv(FAIL_ENV, "part-1")
    assert main([*argv, "--strategy", "bfd_split", "--retries", "0", "--executor", "local"]) == 1
    text = capsys.readouterr().out
    assert "2 failed" in text and "InjectedFailure" in text  # part-1 has two shards


def test_executors_report_exceptions_and_dead_workers_as_outcomes():
    with get_executor("local") as ex:
        out = dict(ex.run(abs, [-1, "x"]))
    assert out[0] == 1 and isinstance(out[1], TypeError)
    with get_executor("pool", workers=1) as ex:
        [(i, outcome)] = list(ex.run(os._exit, [3]))  # the worker process dies
    assert i == 0 and isinstance(outcome, Exception)


def test_cli_one_shard_per_file_and_default_shard_rows(inputs, tmp_path, capsys):
    assert (
        main(["shard-pack", *inputs, "--out", str(tmp_path / "a"), "--max-length", "64", "--shard-rows", "0"])
        == 0
    )
    assert "4 shards (4 packed" in capsys.readouterr().out
    assert main(["shard-pack", *inputs, "--out", str(tmp_path / "b"), "--max-length", "64"]) == 0  # 100k rows
    assert "4 shards (4 packed" in capsys.readouterr().out
    with open(tmp_path / "b" / MANIFEST) as fh:
        assert json.load(fh)["config"]["shard_rows"] == 100_000


def test_a_folder_stands_for_its_files_and_text_columns_fail_early(inputs, tmp_path):
    report = pack_shards([os.path.dirname(inputs[0])], tmp_path / "out", MAX_LENGTH, shard_rows=None)
    assert [s.input for s in report.shards] == [os.path.abspath(p) for p in inputs]
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "raw.parquet")
    with pytest.raises(packtools.PackingError, match="not token lists"):
        pack_shards([tmp_path / "raw.parquet"], tmp_path / "o", MAX_LENGTH)
    assert not (tmp_path / "o").exists()


def test_pack_command_delegates_to_sharded_packing(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["pack", *inputs, "--out", str(out), "--max-length", "64", "--shard-rows", "100"]
    assert main([*argv, "--executor", "pool", "--workers", "2"]) == 0
    assert "10 shards (10 packed, 0 skipped, 0 failed) with pool" in capsys.readouterr().out
    with open(out / MANIFEST) as fh:
        assert json.load(fh)["config"] == {
            "max_length": 64,
            "strategy": "bfd",
            "columns": None,
            "shard_rows": 100,
        }
    assert main([*argv, "--shuffle"]) == 1
    assert "--shuffle cannot be used with sharded packing" in capsys.readouterr().err
