"""The one file-packing engine: executors change where work runs, never the output; plans; column policy."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools import pack_files, pack_table
from packtools.cli.main import main
from packtools.core import unpack
from packtools.errors import PackingError
from packtools.pipeline.executors import Executor, PoolExecutor, get_executor, run_jobs

datasets = pytest.importorskip("datasets")

MAX_LENGTH = 64


def tokenized_table(n: int, seed: int = 0, first_id: int = 0) -> pa.Table:
    """``input_ids`` with unique ids (lengths 0..89: some empty, some over MAX_LENGTH) and ``labels``: the
    first half of each row -100, and every 7th row without any label."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 90, n)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = np.arange(first_id, first_id + offsets[-1], dtype=np.int32)
    labels = ids.copy()
    for r in range(n):
        a, b = offsets[r], offsets[r + 1]
        labels[a : a + (b - a) // 2] = -100
        if r % 7 == 0:
            labels[a:b] = -100
    lists = lambda v: pa.ListArray.from_arrays(pa.array(offsets), pa.array(v))  # noqa: E731
    return pa.table({"input_ids": lists(ids), "labels": lists(labels), "id": pa.array(np.arange(n))})


def executor_args(paths: list[str]) -> list[str]:
    """``packtools pack`` arguments of the executor comparisons (several parts and shards), ``--out`` apart."""
    return [
        *paths,
        "--max-length",
        str(MAX_LENGTH),
        "--shard-tokens",
        "3000",
        "--part-rows",
        "100",
        "--quiet",
    ]


def make_inputs(folder, rows=(300, 250, 400)) -> tuple[list[str], pa.Table]:
    """The same kind of rows as parquet (small row groups), JSON lines and a save_to_disk folder; returns the
    input paths and all rows in input order."""
    os.makedirs(folder, exist_ok=True)
    tables, first = [], 0
    for i, n in enumerate(rows):
        t = tokenized_table(n, seed=i, first_id=first)
        first += int(pa.compute.sum(pa.compute.list_value_length(t.column("input_ids"))).as_py() or 0)
        tables.append(t)
    paths = [os.path.join(folder, "a.parquet"), os.path.join(folder, "b.jsonl"), os.path.join(folder, "c")]
    pq.write_table(tables[0], paths[0], row_group_size=40)
    with open(paths[1], "w") as fh:
        for row in tables[1].to_pylist():
            fh.write(json.dumps(row) + "\n")
    datasets.Dataset(tables[2]).save_to_disk(paths[2], num_shards=2)
    return paths, pa.concat_tables(tables)


def folder_digest(folder: str) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return make_inputs(str(tmp_path_factory.mktemp("in")))


def test_global_plan_equals_packing_all_rows_at_once(mixed, tmp_path):
    paths, table = mixed
    out = str(tmp_path / "out")
    # split_at="tokens", drop_unlabeled=False: pack_table's fixed cut, every piece kept (rows with labels are
    # otherwise cut at turns, tests/test_turn_split.py)
    res = pack_files(
        paths, out, MAX_LENGTH, "bfd_split", shard_tokens=2000, part_rows=100, part_bytes=20_000,
        split_at="tokens", drop_unlabeled=False,
    )  # fmt: skip
    assert res.timings["parts"] > 5 and res.stats["shards"] > 5
    want = pack_table(table, MAX_LENGTH, "bfd_split", columns=["input_ids", "labels"])
    got = datasets.load_from_disk(out).data.table
    assert got.equals(want.cast(got.schema))
    assert res.stats["rows_out"] == want.num_rows
    assert res.stats["columns"] == ["input_ids", "labels"] and res.stats["columns_left_out"] == ["id"]
    # rows without a label token are packed as given, and counted
    lengths = np.asarray(pa.compute.list_value_length(table.column("input_ids")))
    unlabeled = sum(bool(lab) and max(lab) == -100 for lab in table.column("labels").to_pylist())
    assert res.stats["rows_unlabeled"] == unlabeled and res.stats["rows_dropped_unlabeled"] == 0
    assert res.stats["documents_packed"] == int((lengths > 0).sum())
    # sequences as the model sees them: the pieces the plan cut are one each
    assert res.stats["sequences_packed"] == len(pa.compute.list_flatten(got.column("seq_lengths")))
    assert res.stats["sequences_packed"] > res.stats["documents_packed"]


@pytest.mark.slow
def test_executors_write_the_same_bytes(mixed, tmp_path):
    paths, _ = mixed
    args = executor_args(paths)
    assert main(["pack", *args, "--out", str(tmp_path / "local")]) == 0
    assert main(["pack", *args, "--out", str(tmp_path / "pool"), "--executor", "pool", "--workers", "2"]) == 0
    local = folder_digest(str(tmp_path / "local"))
    assert len(local) > 5 and local == folder_digest(str(tmp_path / "pool"))
    with open(tmp_path / "local" / "manifest.json") as fh:
        manifest = json.load(fh)
    assert "executor" not in json.dumps(manifest) and "time" not in manifest["stats"]


def test_drop_unlabeled_and_plan_shards(mixed, tmp_path):
    paths, table = mixed
    res = pack_files(paths, tmp_path / "d", MAX_LENGTH, drop_unlabeled=True)
    assert res.stats["rows_dropped_unlabeled"] == res.stats["rows_unlabeled"] > 0
    seqs = unpack(datasets.load_from_disk(str(tmp_path / "d")).data.table)
    assert all(any(v != -100 for v in labels) for labels in seqs.column("labels").to_pylist())

    glob = pack_files(paths, tmp_path / "g", MAX_LENGTH, "bfd", part_rows=100)
    shards = pack_files(paths, tmp_path / "s", MAX_LENGTH, "bfd", plan="shards", part_rows=100)
    assert shards.stats["plan"] == "shards" and shards.stats["tokens_kept"] == glob.stats["tokens_kept"]
    assert shards.stats["rows_out"] >= glob.stats["rows_out"]
    # each part is planned alone: the output is the parts packed one by one, one after the other
    parts = [
        table.slice(a, b - a)
        for a, b in [(0, 120), (120, 240), (240, 300), (300, 550), (550, 750), (750, 950)]
    ]
    want = pa.concat_tables(pack_table(p, MAX_LENGTH, "bfd", columns=["input_ids", "labels"]) for p in parts)
    got = datasets.load_from_disk(str(tmp_path / "s")).data.table
    assert got.equals(want.cast(got.schema))


def test_the_pack_command_with_plan_shards_is_the_same_engine(mixed, tmp_path):
    paths, _ = mixed
    common = ["--max-length", str(MAX_LENGTH), "--quiet"]
    argv = ["pack", *paths, "--out", str(tmp_path / "b"), "--plan", "shards", "--part-rows", "100", *common]
    assert main(argv) == 0
    pack_files(paths, tmp_path / "a", MAX_LENGTH, "bfd", plan="shards", part_rows=100)
    assert folder_digest(str(tmp_path / "a")) == folder_digest(str(tmp_path / "b"))
    with pytest.raises(SystemExit):  # the deprecated shard-pack command of the unreleased 0.1 API is gone
        main(["shard-pack", *paths, "--out", str(tmp_path / "c"), *common])


def test_token_column_types(tmp_path, capsys):
    floats = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32()))}), floats)
    assert main(["pack", floats, "--out", str(tmp_path / "o1"), "--max-length", "4"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "'input_ids' has type list<element: float>" in err
    assert "cast the column to list<int32>" in err
    text_ids = str(tmp_path / "s.parquet")
    pq.write_table(pa.table({"input_ids": ["a b", "c"]}), text_ids)
    assert main(["pack", text_ids, "--out", str(tmp_path / "o2"), "--max-length", "4"]) == 1
    err = capsys.readouterr().err
    # in command-line words (issue 23): flags, not Python arguments
    assert "'input_ids' has type string" in err and "--format 'text' and --tokenizer DIR" in err
    assert "tokenizer=DIR" not in err and "format=" not in err
    jsonl = tmp_path / "j.jsonl"  # floats in a JSON file: refused naming the file
    jsonl.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": [1.5, 2]}) + "\n")
    assert main(["pack", str(jsonl), "--out", str(tmp_path / "o3"), "--max-length", "4"]) == 1
    err = capsys.readouterr().err
    assert "j.jsonl'" in err and "list<item: double>" in err and "integers" in err
    assert sorted(os.listdir(tmp_path)) == ["f.parquet", "j.jsonl", "s.parquet"]  # nothing left behind


def test_a_float_in_a_later_json_block_is_named_by_its_own_line(tmp_path):
    """A float in a tokenized JSON block after the first file's was named by the block's first line ("line 1")
    rather than its own; a ``2.0`` (read as an integer-valued float) too.  JSON arrays name the object."""
    ints = json.dumps({"input_ids": [1, 2, 3]}) + "\n"
    (tmp_path / "a.jsonl").write_text(ints * 3)
    for value, rows_before in ((2.5, 10), (2.0, 10), (2.0, 8200)):  # 8200: the second block of 8192 rows
        folder = tmp_path / f"in-{value}-{rows_before}"
        folder.mkdir()
        (folder / "a.jsonl").write_text(ints * 3)
        lines = [ints] * rows_before + ["\n", json.dumps({"input_ids": [1, value, 3]}) + "\n", ints]
        (folder / "b.jsonl").write_text("".join(lines))
        with pytest.raises(PackingError, match=rf"b\.jsonl' line {rows_before + 2}: column 'input_ids'"):
            pack_files(str(folder), tmp_path / "out", max_length=8)
    folder = tmp_path / "array"
    folder.mkdir()
    (folder / "a.jsonl").write_text(ints * 3)
    (folder / "b.json").write_text(
        json.dumps([{"input_ids": [1, 2]}] * 4 + [{"input_ids": [1, 2.5]}], indent=1)
    )
    with pytest.raises(PackingError, match=r"b\.json' object 4: column 'input_ids'"):
        pack_files(str(folder), tmp_path / "out", max_length=8)


def test_a_float_in_the_first_files_first_block_is_named_by_its_line(tmp_path, capsys):
    """A float in the first JSON-lines file's first block made the column's type (read before any work) and was
    refused naming the file alone; every later position named its line.  Now that one names its line too."""
    ints = json.dumps({"input_ids": [1, 2, 3]}) + "\n"
    for value in (2.5, 2.0):
        folder = tmp_path / f"in-{value}"
        folder.mkdir()
        lines = [ints] * 5 + ["\n", json.dumps({"input_ids": [1, value, 3]}) + "\n", ints]
        (folder / "a.jsonl").write_text("".join(lines))
        assert main(["pack", str(folder), "--out", str(tmp_path / "out"), "--max-length", "8"]) == 1
        err = capsys.readouterr().err
        assert "a.jsonl' line 7: column 'input_ids' has type list<item: double>" in err, err


def test_negative_token_ids_are_refused_by_row(tmp_path, capsys):
    """Negative ids in ``input_ids`` (a -100 copied from the labels, an overflowed id) were packed as given,
    to reach the embedding lookup; ids beyond int32 were already refused by line.  Refused now by line (JSON
    lines), row (Parquet, an Arrow file mapped as is) and in pack_table / pack_dataset; -100 in labels packs."""
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 4 + [
        {"input_ids": [4, -100, 6], "labels": [4, 5, 6]}
    ]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["pack", str(tmp_path / "j"), "--out", str(tmp_path / "o1"), "--max-length", "8"]) == 1
    err = capsys.readouterr().err
    assert "a.jsonl' line 5: column 'input_ids' holds -100 at position 1" in err, err
    table = pa.Table.from_pylist(rows)
    (tmp_path / "p").mkdir()
    pq.write_table(table, tmp_path / "p" / "a.parquet")
    with pytest.raises(PackingError, match=r"a\.parquet' row 4: column 'input_ids' holds -100"):
        pack_files(str(tmp_path / "p"), tmp_path / "o2", max_length=8)
    (tmp_path / "a").mkdir()
    with pa.OSFile(str(tmp_path / "a" / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(PackingError, match=r"a\.arrow' row 4: column 'input_ids' holds -100"):
        pack_files(str(tmp_path / "a"), tmp_path / "o3", max_length=8)
    with pytest.raises(PackingError, match=r"'input_ids' holds -100 \(first negative in row 4, position 1\)"):
        pack_table(table, 8)
    ds = datasets.Dataset.from_list(rows)
    with pytest.raises(PackingError, match=r"'input_ids' holds -100 \(first negative in row 4"):
        from packtools import pack_dataset

        pack_dataset(ds, 8)
    assert pack_table(table.slice(0, 4), 8).num_rows == 2  # -100 in labels packs


def test_mixed_formats_name_the_file(tmp_path, capsys):
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), tmp_path / "tok.parquet")
    (tmp_path / "raw.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    assert main(["pack", str(tmp_path), "--out", str(tmp_path.parent / "mixed-out")]) == 1
    err = capsys.readouterr().err
    assert "mixed input formats" in err and "tok.parquet" in err and "raw.jsonl" in err and "\n" == err[-1]
    assert err.count("\n") == 1
    assert "pack them in separate runs" in err
    # profile said "pack them in separate runs" too: it names the command that runs
    assert main(["profile", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        "mixed input formats" in err and "profile them in separate runs" in err and "pack them" not in err
    ), err


def _die_once(marker: str) -> str:
    """A job whose worker process dies the first time it runs (a lost worker), then succeeds."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return marker


def _fail(x: int) -> int:
    raise PackingError(f"bad row {x}")


@pytest.mark.slow
def test_lost_workers_are_retried_and_errors_are_not(tmp_path):
    ex = PoolExecutor(1)
    try:
        marker = str(tmp_path / "died")
        assert run_jobs(ex, _die_once, [marker], "stage", quiet=True, retries=1) == [marker]
        with pytest.raises(PackingError, match="bad row 5"):
            run_jobs(ex, _fail, [5], "stage", quiet=True, retries=3)
    finally:
        ex.close()


def test_executors_report_exceptions_and_dead_workers_as_outcomes():
    with get_executor("local") as ex:
        out = dict(ex.run(abs, [-1, "x"]))
    assert out[0] == 1 and isinstance(out[1], TypeError)
    with get_executor("pool", workers=1) as ex:
        [(i, outcome)] = list(ex.run(os._exit, [3]))  # the worker process dies
    assert i == 0 and isinstance(outcome, Exception)


def test_caches_cannot_go_stale(tmp_path, monkeypatch):
    from packtools.io import fingerprint as fp_mod
    from packtools.pipeline.tokenizer.folder import tokenizer_fingerprint

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": 1}')
    (tok / "model.safetensors").write_bytes(b"\0" * 4096)
    first = tokenizer_fingerprint(str(tok))
    (tok / "model.safetensors").write_bytes(b"\1" * 8192)  # weights are not read
    assert tokenizer_fingerprint(str(tok)) == first
    (tok / "tokenizer.json").write_text('{"model": 2}')
    assert tokenizer_fingerprint(str(tok)) != first

    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]]}), src)
    out = str(tmp_path / "out")
    assert not pack_files(src, out, 4).cached
    assert pack_files(src, out, 4).cached
    monkeypatch.setattr(fp_mod, "__version__", "999.0")  # another packtools version: nothing is reused
    assert not pack_files(src, out, 4).cached


class _NamedLocal(Executor):
    """An executor of the caller's own: jobs one after another, under its own name."""

    name = "mine"

    def run(self, fn, jobs):
        for i, job in enumerate(jobs):
            try:
                yield i, fn(job)
            except Exception as exc:  # noqa: BLE001 - the job's outcome
                yield i, exc


def test_an_executor_is_a_name_or_an_executor_and_anything_else_is_refused_by_name(tmp_path):
    path = str(tmp_path / "in.parquet")
    pq.write_table(tokenized_table(50), path)
    res = pack_files(path, str(tmp_path / "mine"), MAX_LENGTH, executor=_NamedLocal())
    assert res.timings["executor"] == "mine" and res.stats["rows_out"] > 0
    for wrong in (None, 3, concurrent.futures.ThreadPoolExecutor(1)):
        with pytest.raises(
            PackingError, match=r"executor=.* is not an executor: pass one of local, pool, ray"
        ) as e:
            pack_files(path, str(tmp_path / "wrong"), MAX_LENGTH, executor=wrong)
        assert e.value.param == "executor"
    assert not (tmp_path / "wrong").exists()
