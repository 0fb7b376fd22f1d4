"""End-to-end ``packtools pack INPUT... --out DIR``: every input format, manifest cache, atomic writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from _pipeline_data import build_tokenizer, load

import packtools.pipeline.gather as outofcore
import packtools.pipeline.run as pipeline
from packtools import PackingError, pack_table
from packtools.cli.main import main
from packtools.core import unpack
from packtools.pipeline.config import PipelineConfig
from packtools.pipeline.run import run_pipeline

datasets = pytest.importorskip("datasets")

TEXTS = [f"hello world {i} " * (1 + i % 9) + "the quick brown fox" for i in range(60)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def expected_sequences(tok_dir):
    tok = load(tok_dir)
    return sorted(tuple(ids + [tok.eos_token_id]) for ids in tok(TEXTS)["input_ids"])


def packed_sequences(folder):
    ds = datasets.load_from_disk(folder)
    table = ds.data.table
    return sorted(tuple(r) for r in unpack(table).column("input_ids").to_pylist())


def write_inputs(root):
    """The same rows in every accepted input layout; returns {name: path}."""
    table = pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))})
    paths = {}
    os.makedirs(root, exist_ok=True)
    paths["jsonl"] = os.path.join(root, "data.jsonl")
    with open(paths["jsonl"], "w") as fh:
        for row in table.to_pylist():
            fh.write(json.dumps(row) + "\n")
    paths["json"] = os.path.join(root, "data.json")
    with open(paths["json"], "w") as fh:
        json.dump(table.to_pylist(), fh)
    paths["parquet"] = os.path.join(root, "data.parquet")
    pq.write_table(table, paths["parquet"], row_group_size=17)
    paths["feather"] = os.path.join(root, "data.feather")  # lz4-compressed Arrow IPC file
    feather.write_feather(table, paths["feather"])
    paths["arrow"] = os.path.join(root, "data.arrow")
    with pa.OSFile(paths["arrow"], "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=25)
    paths["saved"] = os.path.join(root, "saved")
    datasets.Dataset(table).save_to_disk(paths["saved"], num_shards=2)
    paths["directory"] = os.path.join(root, "parts")
    os.makedirs(paths["directory"])
    pq.write_table(table.slice(0, 20), os.path.join(paths["directory"], "a.parquet"))
    with open(os.path.join(paths["directory"], "b.jsonl"), "w") as fh:
        for row in table.slice(20).to_pylist():
            fh.write(json.dumps(row) + "\n")
    return paths


def test_every_input_format_packs_the_same_tokens(tmp_path, tok_dir):
    paths = write_inputs(str(tmp_path / "in"))
    expected = expected_sequences(tok_dir)
    for name, path in paths.items():
        out = str(tmp_path / f"out-{name}")
        assert (
            main(["pack", path, "--out", out, "--tokenizer", tok_dir, "--max-length", "64", "--quiet"]) == 0
        )
        assert packed_sequences(out) == expected, name
        ds = datasets.load_from_disk(out)
        assert ds.column_names == ["input_ids", "seq_lengths"]
        assert max(len(r) for r in ds["input_ids"]) <= 64
        manifest = json.load(open(os.path.join(out, "manifest.json")))
        assert manifest["format"] == "text"
        assert manifest["stats"]["rows_in"] == len(TEXTS)
        assert manifest["stats"]["tokens_kept"] == sum(len(s) for s in expected)
        assert [os.path.basename(f["path"]) for f in manifest["inputs"]]
    files = sorted(os.listdir(tmp_path / "out-jsonl"))
    run = json.load(open(tmp_path / "out-jsonl" / "manifest.json"))["fingerprint"][:12]
    assert files == [f"data-{run}-00000-of-00001.arrow", "dataset_info.json", "manifest.json", "state.json"]


def test_out_of_core_slices_equal_the_in_memory_packing(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "labels": pa.array(ids, pa.list_(pa.int32())),
            "id": range(500),
        }
    )
    src = str(tmp_path / "tok.parquet")
    pq.write_table(table, src)
    for strategy in ("bfd", "bfd_split", "wrapped"):
        out = str(tmp_path / f"out-{strategy}")
        # split_at="tokens", drop_unlabeled=False: the in-memory packers' fixed cut, every piece kept (the
        # pipeline's default cuts rows with labels at turns and drops pieces that train nothing, such as a
        # 1-token tail; tests/test_turn_split.py)
        split_at = "tokens" if strategy == "bfd_split" else "turns"  # only bfd_split cuts pieces
        cfg = PipelineConfig(
            max_length=256, strategy=strategy, shard_tokens=5000, split_at=split_at, drop_unlabeled=False
        )
        res = run_pipeline([src], out, cfg)
        assert res.stats["shards"] > 5
        got = datasets.load_from_disk(out).data.table
        want = pack_table(table, 256, strategy, columns=["input_ids", "labels"])
        assert got.equals(want.cast(got.schema)), strategy
        assert res.stats["rows_out"] == want.num_rows


def test_tokenized_input_columns_and_non_list_columns(tmp_path):
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2, 3], [4, 5], [6]], pa.list_(pa.int64())),
            "attention_mask": pa.array([[1, 1, 1], [1, 1], [1]], pa.list_(pa.int8())),
            "source": ["a", "b", "c"],
        }
    )
    src = str(tmp_path / "t.arrow")
    with pa.OSFile(src, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    out = str(tmp_path / "out")
    assert main(["pack", src, "--out", out, "--max-length", "4", "--quiet"]) == 0
    ds = datasets.load_from_disk(out)
    # the all-ones attention_mask is left out (the collator refuses one beside seq_lengths)
    assert ds.column_names == ["input_ids", "seq_lengths"]
    assert ds[:] == {"input_ids": [[1, 2, 3, 6], [4, 5]], "seq_lengths": [[3, 1], [2]]}
    assert (
        main(
            [
                "pack",
                src,
                "--out",
                str(tmp_path / "o2"),
                "--columns",
                "input_ids",
                "--max-length",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    assert datasets.load_from_disk(str(tmp_path / "o2")).column_names == ["input_ids", "seq_lengths"]


@pytest.mark.parametrize(
    "overlong, strategy, kept_rows, counts",
    [
        ("truncate", "bfd", 4, {"rows_truncated": 2, "tokens_truncated": 3 + 6}),
        ("drop", "bfd", 2, {"rows_dropped_overlong": 2, "tokens_dropped_overlong": 7 + 10}),
        ("split", "bfd_split", 4, {"rows_split": 2}),
    ],
)
def test_overlong_policies(tmp_path, overlong, strategy, kept_rows, counts):
    ids = [list(range(7)), [1, 2], list(range(10)), [3]]
    src = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), src)
    res = run_pipeline(
        [src], str(tmp_path / "out"), PipelineConfig(max_length=4, strategy=strategy, overlong=overlong)
    )
    for key, value in counts.items():
        assert res.stats[key] == value, key
    seqs = unpack(datasets.load_from_disk(str(tmp_path / "out")).data.table).column("input_ids").to_pylist()
    if overlong == "split":
        assert sum(len(s) for s in seqs) == 20
    else:
        assert len(seqs) == kept_rows
        assert all(len(s) <= 4 for s in seqs)
    assert res.stats["tokens_in"] == 20
    assert res.stats["tokens_kept"] + res.stats["tokens_dropped"] == 20


def test_split_needs_a_splitting_strategy():
    with pytest.raises(PackingError, match="bfd_split"):
        PipelineConfig(max_length=4, strategy="bfd", overlong="split")


def test_manifest_cache_hit_and_invalidation(tmp_path, tok_dir, monkeypatch, capsys):
    src = str(tmp_path / "data.jsonl")
    with open(src, "w") as fh:
        for t in TEXTS[:10]:
            fh.write(json.dumps({"text": t}) + "\n")
    out = str(tmp_path / "out")
    args = ["pack", src, "--out", out, "--tokenizer", tok_dir, "--max-length", "32"]
    assert main(args) == 0
    first = json.load(open(os.path.join(out, "manifest.json")))
    assert first["config"]["max_length"] == 32 and first["packtools_version"]
    assert first["tokenizer_sha256"] and first["inputs"][0]["size"] == os.path.getsize(src)
    capsys.readouterr()

    def boom(*a, **k):
        raise AssertionError("a cached run must not pack again")

    monkeypatch.setattr(pipeline, "_run", boom)
    assert main(args) == 0  # same inputs and options: nothing to do
    assert "cached" in capsys.readouterr().out
    monkeypatch.undo()

    assert main(args[:-1] + ["48", "--quiet"]) == 0  # another max_length: packed again, output replaced
    assert json.load(open(os.path.join(out, "manifest.json")))["config"]["max_length"] == 48
    with open(src, "a") as fh:
        fh.write(json.dumps({"text": "one more row"}) + "\n")
    res = run_pipeline([src], out, PipelineConfig(max_length=48, tokenizer=os.path.abspath(tok_dir)))
    assert not res.cached and res.stats["rows_in"] == 11
    assert run_pipeline([src], out, PipelineConfig(max_length=48, tokenizer=os.path.abspath(tok_dir))).cached
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".out.")]  # no leftovers


def test_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    src = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), src)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    assert main(["pack", src, "--out", str(tmp_path / "out"), "--max-length", "4"]) == 1
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_interrupted_write_leaves_no_output_folder(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 50, n).tolist() for n in rng.integers(1, 60, 300)]
    src = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), src)
    real = outofcore.write_shard
    calls = []

    def failing(path, table):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real(path, table)

    monkeypatch.setattr(outofcore, "write_shard", failing)
    args = [
        "pack",
        src,
        "--out",
        str(tmp_path / "out"),
        "--max-length",
        "64",
        "--shard-tokens",
        "500",
        "--quiet",
    ]
    assert main(args) == 1  # one line, no traceback, nothing left behind
    assert "disk full (simulated)" in capsys.readouterr().err
    assert len(calls) == 3
    assert sorted(os.listdir(tmp_path)) == ["t.parquet"]  # neither the output nor a temporary folder

    monkeypatch.setattr(outofcore, "write_shard", real)
    assert main(args) == 0
    before = datasets.load_from_disk(str(tmp_path / "out"))[:]
    calls.clear()
    monkeypatch.setattr(outofcore, "write_shard", failing)
    assert main(args[:-3] + ["--shard-tokens", "400", "--quiet"]) == 1  # fails midway: the old output stays

    assert datasets.load_from_disk(str(tmp_path / "out"))[:] == before
    assert sorted(os.listdir(tmp_path)) == ["out", "t.parquet"]


def test_errors_name_the_problem(tmp_path, tok_dir):
    src = str(tmp_path / "data.jsonl")
    with open(src, "w") as fh:
        fh.write(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(PackingError, match="format=") as err:
        run_pipeline([src], str(tmp_path / "o"), PipelineConfig(max_length=8, tokenizer=tok_dir))
    assert err.value.param == "format"
    with open(src, "w") as fh:
        fh.write(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(PackingError, match="tokenizer=") as err:
        run_pipeline([src], str(tmp_path / "o"), PipelineConfig(max_length=8))
    assert err.value.param == "tokenizer"
    with pytest.raises(PackingError, match="unknown file type"):
        bad = tmp_path / "x.csv"
        bad.write_text("a\n")
        run_pipeline([str(bad)], str(tmp_path / "o"), PipelineConfig(max_length=8))
    assert main(["pack", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 1
    assert not (tmp_path / "o").exists()


def test_no_input_still_prints_three_strategies(capsys):
    assert main(["pack", "--max-length", "2048"]) == 0
    out = capsys.readouterr().out
    assert "bfd_split" in out and "wrapped" in out and "rows out" in out


def test_uncompressed_arrow_inputs_are_mapped_without_staging(tmp_path):
    rng = np.random.default_rng(2)
    ids = [rng.integers(0, 100, n).tolist() for n in rng.integers(1, 80, 400)]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "n": range(400)})
    saved = str(tmp_path / "saved")
    datasets.Dataset(table).save_to_disk(saved, num_shards=3)  # uncompressed Arrow streams
    compressed = str(tmp_path / "t.feather")
    feather.write_feather(table, compressed, compression="lz4")
    want = pack_table(table, 128, "bfd_split", columns=["input_ids"])
    for src, staged in ((saved, False), (compressed, True)):
        out = str(tmp_path / f"out-{staged}")
        res = run_pipeline(
            [src], out, PipelineConfig(max_length=128, strategy="bfd_split", shard_tokens=3000)
        )
        assert bool(res.timings["parts_mapped"]) is not staged
        assert datasets.load_from_disk(out).data.table.equals(want)


def test_cli_error_names_the_flag(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools.cli.main import main

    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "text": ["a", "b"]}), path)
    assert main(["pack", str(path), "--out", str(tmp_path / "o.parquet"), "--max-length", "4"]) == 1
    err = capsys.readouterr().err
    assert "['text'] are not list columns" in err and "error (--columns):" in err
    assert not (tmp_path / "o.parquet").exists()
