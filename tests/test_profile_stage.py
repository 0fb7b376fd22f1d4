"""Profiling raw and packed input: through pack's stage into the stage cache (which pack reuses), packed
folders by their sequences, the default rule on long-tailed data, and no silent drop in the Python API."""

from __future__ import annotations

import filecmp
import json
import os
import warnings

import _stage_fixtures
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import CORPUS, build_tokenizer  # noqa: E402

from packtools import pack_files, profile_lengths
from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.pipeline import stage_cache
from packtools.pipeline.profile import profile_files
from packtools.pipeline.tokenizer.chat.head import HEAD_COLUMN
from packtools.profiling import LengthProfile

# The shared fixtures (tests/_stage_fixtures.py), named here for pytest to find.
tok, cache = _stage_fixtures.tok, _stage_fixtures.cache


def _texts(n=400, seed=0):
    rng = np.random.default_rng(seed)
    words = " ".join(CORPUS).split()
    return [" ".join(rng.choice(words, int(rng.lognormal(2.5, 1.0)) + 1)) for _ in range(n)]


def _write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def _same_folder(a, b):
    names = sorted(n for n in os.listdir(a) if n != "manifest.json")
    assert names == sorted(n for n in os.listdir(b) if n != "manifest.json")
    return all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def test_profile_then_pack_reuses_the_stage(tmp_path, tok, cache, capsys):
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t, "id": i} for i, t in enumerate(_texts())])
    assert main(["profile", data, "--tokenizer", tok, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "1 tokenized" in out and "reuses these 1 staged part(s)" in out
    assert any(n.endswith(".npz") for n in os.listdir(cache))
    prof = profile_files(data, tok).profile  # a second profile finds the cache
    assert profile_files(data, tok).stage["reused"] == 1

    res = pack_files(data, tmp_path / "packed", 256, "bfd_split", tokenizer=tok)
    assert (
        res.timings["parts_from_stage_cache"] == 1 and res.timings["parts_reused"] == 0
    )  # no run was killed
    # the profile measured what pack packs
    assert prof.total_tokens == res.stats["tokens_in"] and prof.count == res.stats["rows_in"]
    assert res.stats["columns_left_out"] == ["id"]
    # negative control: with another (empty) cache pack tokenizes, and writes the same bytes
    os.environ[stage_cache.CACHE_ENV] = str(tmp_path / "empty-cache")
    fresh = pack_files(data, tmp_path / "fresh", 256, "bfd_split", tokenizer=tok)
    assert fresh.timings["parts_from_stage_cache"] == 0 == fresh.timings["parts_reused"]
    assert _same_folder(res.out, fresh.out)
    # S1/U1: the adopted part keeps its engine report, so the manifest says what a run without the cache says
    assert res.stats["tokenizer"] == fresh.stats["tokenizer"] and "engine" in res.stats["tokenizer"]
    # the cache entry outlives the pack (its hard link in the work folder is gone with the work folder)
    assert any(n.endswith(".arrow") for n in os.listdir(cache))


def test_pack_cli_says_it_reused_the_stage(tmp_path, tok, cache, capsys):
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts(50)])
    profile_files(data, tok)
    assert main(["pack", data, "--tokenizer", tok, "--out", str(tmp_path / "o"), "--max-length", "128"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the summary wraps its lines
    assert "reused, not tokenized again" in out
    assert "1 from the stage cache" in out and "interrupted" not in out  # where the part came from


def test_another_tokenizer_or_option_does_not_reuse(tmp_path, tok, cache):
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts(50)])
    profile_files(data, tok)
    res = pack_files(data, tmp_path / "a", 128, tokenizer=tok, add_eos=False)
    assert res.timings["parts_from_stage_cache"] == 0  # add_eos is part of the key
    other = build_tokenizer(str(tmp_path / "tok2"), chat_template=None)  # other files, other hash
    assert pack_files(data, tmp_path / "b", 128, tokenizer=other).timings["parts_from_stage_cache"] == 0
    assert pack_files(data, tmp_path / "c", 128, tokenizer=tok).timings["parts_from_stage_cache"] == 1


def test_no_stage_cache_leaves_nothing(tmp_path, tok, cache):
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts(30)])
    res = profile_files(data, tok, stage_cache=False)
    assert res.profile.count == 30 and not os.path.exists(cache) and not os.path.exists(res.stage["folder"])


def test_profile_says_why_the_tokenizers_library_is_not_the_reference(
    tmp_path, tok, cache, monkeypatch, capsys
):
    """Where the installed ``tokenizers`` cannot be the reference (``reference.library_gap`` gives a reason),
    ``packtools profile`` prints that reason, the note ``packtools pack`` gives, with the stage cache on or off."""
    from packtools.pipeline import stage
    from packtools.pipeline.tokenizer import reference

    why = "the tokenizers library is not installed, so transformers is loaded as the reference"
    monkeypatch.setattr(reference, "library_gap", lambda: why)
    monkeypatch.setattr(stage, "_TOKENIZERS", {})  # tokenizers loaded by earlier tests asked no library_gap
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts(30)])
    assert main(["profile", data, "--tokenizer", tok, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"  {why}\n" in out and "reuses these 1 staged part(s)" in out, out
    assert (
        why in pack_files(data, tmp_path / "packed", 256, tokenizer=tok).notes
    )  # pack's note: the same text
    assert main(["profile", data, "--tokenizer", tok, "--quiet", "--no-stage-cache"]) == 0
    out = capsys.readouterr().out
    assert f"  {why}\n" in out and "(--no-stage-cache: the staged parts were removed" in out, out


def test_chat_prompt_completion_and_preference_lengths(tmp_path, tok, cache):
    from packtools.pipeline.tokenizer.batch import BatchTokenizer

    texts = _texts(40)
    sets = {
        "prompt_completion": [{"prompt": a, "completion": b} for a, b in zip(texts, texts[1:])],
        "messages": [
            {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
            for a, b in zip(texts, texts[1:])
        ],
        "preference": [
            {"prompt": a, "chosen": b, "rejected": c} for a, b, c in zip(texts, texts[1:], texts[2:])
        ],
    }
    for fmt, rows in sets.items():
        path = _write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
        res = profile_files(path, tok)
        assert res.format == fmt
        table = BatchTokenizer(tok, fmt)(pa.Table.from_pylist(rows), 0)
        lens = {
            c: np.array([len(x) for x in table.column(c).to_pylist()])
            for c in table.column_names
            if c != HEAD_COLUMN
        }
        if fmt == "preference":  # a pair as pack lays it out: [prompt + chosen][prompt + rejected]
            want = 2 * lens["prompt_input_ids"] + lens["chosen_input_ids"] + lens["rejected_input_ids"]
        else:
            want = lens["input_ids"]
        assert res.profile.lengths.tolist() == want.tolist(), fmt


def test_preference_recommendation_names_the_strategy_pack_takes(tmp_path, tok, cache):
    """Pairs are packed whole by bfd only (pack refuses bfd_split): the recommendation said "Pack with strategy
    bfd_split ... keeps every token" for preference data, which pack then refused."""
    texts = _texts(200, 3)
    rows = [{"prompt": a, "chosen": b, "rejected": c} for a, b, c in zip(texts, texts[1:], texts[2:])]
    rows[0]["chosen"] = " ".join(texts[:40])  # a few long pairs, so that some do not fit
    rows[1]["rejected"] = " ".join(texts[40:80])
    path = _write_jsonl(tmp_path / "pref.jsonl", rows)
    profile = profile_files(path, tok).profile
    rec = profile.recommend()
    assert rec.truncated_share > 0 and rec.strategy == "bfd" and "bfd_split" not in rec.reason
    assert all(o.strategy == "bfd" for o in rec.options)
    res = pack_files(path, tmp_path / "packed", rec.max_length, rec.strategy, tokenizer=tok)
    assert res.stats["rows_out"] == rec.options[0].bfd_rows


def test_tokenized_parquet_with_labels_profiles_as_its_json_lines(tmp_path, cache):
    """The same labelled rows as parquet and as JSON lines: the parquet profile had no trained tokens, so its
    token rule counted every token (another max_length) and it never said what pack's turn split drops."""
    rng = np.random.default_rng(4)
    rows = []
    for n in rng.integers(2, 400, 300):
        k = int(rng.integers(1, n))
        rows.append({"input_ids": list(range(int(n))), "labels": [-100] * k + list(range(k, int(n)))})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    jsonl = _write_jsonl(tmp_path / "rows.jsonl", rows)
    from_json = profile_files(jsonl).profile
    from_parquet = profile_files(str(tmp_path / "rows.parquet")).profile
    assert from_parquet.trained is not None and from_parquet.trained.total == from_json.trained.total
    for kw in ({}, {"keep_tokens": 0.99}):
        assert from_parquet.recommend(**kw).to_text() == from_json.recommend(**kw).to_text()
    assert from_parquet.tradeoffs([128, 256]).to_dicts() == from_json.tradeoffs([128, 256]).to_dicts()


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_labels_of_tokenized_files_are_read_a_bounded_batch_at_a_time(tmp_path, cache, monkeypatch, suffix):
    """The labels of tokenized parquet were read in pyarrow's default batches (65,536 rows): with long rows a
    batch held hundreds of millions of labels, several int64 arrays of each at once (1.7 GB peak for 40,000 rows
    of 1,024 tokens, where the lengths alone took 0.2 GB).  Each batch now holds at most LABEL_BATCH_TOKENS
    labels (a row longer than that: the row alone), with the same counts."""
    import packtools.pipeline.profile as stage_profile
    from packtools.profiling.trained import TrainedTokens

    rng = np.random.default_rng(5)
    rows = []
    for n in rng.integers(2, 300, 400):
        k = int(rng.integers(1, n))
        rows.append({"input_ids": list(range(int(n))), "labels": [-100] * k + list(range(k, int(n)))})
    table = pa.Table.from_pylist(rows)
    path = tmp_path / f"rows.{suffix}"
    if suffix == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)  # one record batch of 400 rows
    whole = TrainedTokens.from_labels(table.column("labels"))
    seen = []
    real = TrainedTokens.from_labels.__func__

    def counted(cls, labels):
        seen.append(sum(len(v) for v in labels.to_pylist()))
        return real(cls, labels)

    monkeypatch.setattr(stage_profile, "LABEL_BATCH_TOKENS", 1000)
    monkeypatch.setattr(TrainedTokens, "from_labels", classmethod(counted))
    got = profile_files(str(path)).profile.trained
    assert len(seen) > 1 and max(seen) <= 1000, seen
    assert got.total == whole.total and got.first.tolist() == whole.first.tolist()
    assert got.lengths.tolist() == whole.lengths.tolist() and got.at.tolist() == whole.at.tolist()


def test_tokenized_files_with_and_without_labels_are_refused_by_name(tmp_path, cache):
    """Profiling tokenized parquet whose first file has labels and another not failed with a bare
    'IndexError: index out of bounds' (pack refuses those inputs, naming the file)."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4]]}), tmp_path / "b.parquet")
    with pytest.raises(PackingError, match=r"b\.parquet.*labels") as info:
        profile_files(str(tmp_path))
    assert info.value.param == "paths"


def test_raw_input_without_tokenizer_names_the_flag(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    assert main(["profile", data]) == 1
    err = capsys.readouterr().err
    assert "(--tokenizer)" in err and "--tokenizer DIR" in err and "tokenizer=" not in err
    pq.write_table(pa.table({"text": ["a b"]}), tmp_path / "t.parquet")
    with pytest.raises(PackingError, match="profile_files") as e:
        profile_lengths(str(tmp_path / "t.parquet"))
    assert e.value.param == "tokenizer"


def test_eviction_keeps_the_budget_and_this_runs_entries(tmp_path, tok, cache, monkeypatch):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in _texts(60, 1)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in _texts(60, 2)])
    profile_files(a, tok)
    first = {n for n in os.listdir(cache) if n.endswith(".npz")}
    monkeypatch.setattr(stage_cache, "MIN_AGE_S", 0.0)
    monkeypatch.setenv(stage_cache.MAX_GB_ENV, "0")
    res = profile_files(b, tok)
    left = {n for n in os.listdir(cache) if n.endswith(".npz")}
    assert res.stage["evicted"] == 1 and not (first & left) and len(left) == 1
    # negative control: the budget is what evicts (a large one keeps both)
    monkeypatch.setenv(stage_cache.MAX_GB_ENV, "10")
    profile_files(a, tok)
    assert len({n for n in os.listdir(cache) if n.endswith(".npz")}) == 2


def test_a_packed_folder_is_profiled_by_its_sequences(tmp_path, capsys):
    rng = np.random.default_rng(3)
    lens = np.clip(rng.lognormal(4.0, 1.0, 500), 1, 900).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], np.int32)))
    pq.write_table(pa.table({"input_ids": col}), tmp_path / "in.parquet")
    res = pack_files(str(tmp_path / "in.parquet"), tmp_path / "packed", 1024)
    for column in ("input_ids", "seq_lengths"):  # by default, and with --column seq_lengths
        p = profile_lengths(res.out, column=column)
        assert sorted(p.lengths.tolist()) == sorted(lens.tolist())  # sequences, not rows (nor segment counts)
        assert p.count == 500 != res.stats["rows_out"]
        assert p.packed["rows"] == res.stats["rows_out"] and p.packed["max_length"] == 1024
        assert p.packed["fill"] == pytest.approx(res.stats["fill"])
    assert main(["profile", res.out, "--column", "seq_lengths"]) == 0
    out = capsys.readouterr().out
    assert "500 sequences" in out and f"packed input: {res.stats['rows_out']:,} rows" in out
    table = pa.table({"seq_lengths": [[3, 4], [5]], "input_ids": [[1] * 7, [2] * 5]})
    assert profile_lengths(table).lengths.tolist() == [3, 4, 5]


def _bad_batch(path) -> None:
    """Overwrite the header of the first record batch of the Arrow stream at ``path`` (its schema still reads)."""
    whole = open(path, "rb").read()
    with pa.OSFile(str(path), "rb") as src:
        pa.ipc.open_stream(src)
        first = src.tell()
    open(path, "wb").write(whole[:first] + b"\xff" * 8 + whole[first + 8 :])


def test_a_corrupt_shard_of_a_packed_folder_is_named(tmp_path, capsys):
    """A packed folder with a shard that is no Arrow file, or whose batches are corrupted behind a readable
    schema: ``packtools profile`` and profile_lengths name the shard and the fix (as pack does), never pyarrow's
    bare error."""
    offsets = np.arange(0, 601 * 40, 40, dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], np.int32)))
    pq.write_table(pa.table({"input_ids": col}), tmp_path / "in.parquet")
    res = pack_files(str(tmp_path / "in.parquet"), tmp_path / "packed", 256, shard_tokens=4000)
    shards = sorted(f for f in os.listdir(res.out) if f.endswith(".arrow"))
    assert len(shards) >= 2
    bad = os.path.join(res.out, shards[1])
    argvs = (["profile", res.out], ["profile", res.out, "--column", "seq_lengths"])
    for argv in argvs:  # negative control: the whole folder profiles
        assert main(argv) == 0
    capsys.readouterr()
    whole = open(bad, "rb").read()
    said = f"{shards[1]}' cannot be read as an Arrow IPC file"
    for fault in ("batches", "not arrow"):
        if fault == "batches":
            _bad_batch(bad)
        else:
            open(bad, "wb").write(b"not an Arrow file\n" * 64)
        for argv in argvs:
            assert main(argv) == 1
            err = capsys.readouterr().err
            assert said in err and "copy it again" in err and "Error:" not in err, (fault, argv, err)
        with pytest.raises(PackingError, match=said):
            profile_lengths(res.out)
        open(bad, "wb").write(whole)


def test_a_corrupt_packed_or_tokenized_file_is_named(tmp_path):
    """profile_lengths of a packed ``.parquet`` cut in half, and of tokenized files whose data (not footer or
    schema) is corrupted: PackingError naming the file."""
    packed = pa.table({"input_ids": [[1] * 7, [2] * 5], "seq_lengths": [[3, 4], [5]]})
    pq.write_table(packed, tmp_path / "packed.parquet")
    assert profile_lengths(str(tmp_path / "packed.parquet")).lengths.tolist() == [3, 4, 5]  # control
    blob = (tmp_path / "packed.parquet").read_bytes()
    (tmp_path / "packed.parquet").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(PackingError, match="packed.parquet' cannot be read as a Parquet file"):
        profile_lengths(str(tmp_path / "packed.parquet"))
    tokens = pa.table({"input_ids": pa.array([[1, 2, 3]] * 100, pa.list_(pa.int32()))})
    pq.write_table(tokens, tmp_path / "pages.parquet")
    with (
        pa.OSFile(str(tmp_path / "batches.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, tokens.schema) as w,
    ):
        w.write_table(tokens)
    for name in ("pages.parquet", "batches.arrow"):
        assert profile_lengths(str(tmp_path / name)).count == 100  # control
    blob = (tmp_path / "pages.parquet").read_bytes()
    (tmp_path / "pages.parquet").write_bytes(blob[:4] + b"\xff" * 16 + blob[20:])  # the first page's header
    assert pq.read_schema(tmp_path / "pages.parquet").names == ["input_ids"]  # its footer still reads
    _bad_batch(tmp_path / "batches.arrow")
    for name, kind in (("pages.parquet", "a Parquet"), ("batches.arrow", "an Arrow IPC")):
        with pytest.raises(PackingError, match=f"{name}' cannot be read as {kind} file"):
            profile_lengths(str(tmp_path / name))


def test_default_rule_holds_on_a_long_tail():
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(5.0, 1.6, 20_000), 1, 2_000_000).astype(np.int64)
    p = LengthProfile(lens)
    rec = p.recommend()
    assert rec.rule == "sequences" and rec.strategy == "bfd_split"
    assert (lens <= rec.max_length).mean() >= 0.99
    tok = p.recommend(keep_tokens=0.99)
    assert tok.max_length > 2 * rec.max_length  # the token rule would ask for much more on this tail
    assert [o.rule for o in rec.options] == ["sequences", "tokens"]
    assert rec.options[1].max_length == tok.max_length and rec.options[0].tokens_dropped_bfd > 0
    # above max_context: said, never silent
    assert not p.recommend(max_context=1 << 20).flags[:1] or rec.max_length > 1 << 20
    flagged = p.recommend(max_context=rec.max_length - 1)
    assert flagged.max_length == rec.max_length and "recommended value" in flagged.flags[0]
    assert "both rules" in rec.to_text() and rec.reason in rec.to_text()


def test_python_api_warns_when_tokens_are_dropped():
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset, packed_view
    from packtools.integrations import truncate_dataset
    from packtools.integrations.data.drops import TokensDroppedWarning

    ds = datasets.Dataset.from_dict({"input_ids": [[1] * 50, [2] * 5, [3] * 3000]})
    for call in (
        lambda: pack_dataset(ds, 1024),
        lambda: packed_view(ds, 1024),
        lambda: truncate_dataset(ds, 1024),
        lambda: packed_view(ds.data.table, 1024),
    ):
        with pytest.warns(TokensDroppedWarning, match=r"dropped 1,976 of 3,055 tokens \(64\.68%.*bfd_split"):
            call()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokensDroppedWarning)  # negative control: nothing dropped, no warning
        pack_dataset(ds, 1024, "bfd_split")
        packed_view(ds, 4096)
        truncate_dataset(ds, 4096)
    with pytest.warns(TokensDroppedWarning):
        out, report = pack_dataset(ds, 1024, return_report=True)
    assert (report.tokens_in, report.tokens_dropped, report.sequences_truncated) == (3055, 1976, 1)
    assert len(out) == 2
    with pytest.warns(TokensDroppedWarning, match="split 'train'"):
        _, reports = truncate_dataset(datasets.DatasetDict({"train": ds}), 1024, return_report=True)
    assert reports["train"].tokens_kept == 1079


def test_cli_errors_use_flag_names(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a b"]}), tmp_path / "raw.parquet")
    assert main(["pack", str(tmp_path / "raw.parquet"), "--out", str(tmp_path / "x.parquet")]) == 1
    err = capsys.readouterr().err
    assert "use --out DIR" in err and "(--out)" in err
    assert main(["pack", str(tmp_path / "raw.parquet"), "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "pass --tokenizer DIR" in err and "tokenizer=DIR" not in err
    assert main(["profile", str(tmp_path / "nope")]) == 1
    assert main(["profile", str(tmp_path / "raw.parquet"), "--column", "ids"]) == 1
    err = capsys.readouterr().err
    assert "--column NAME" in err and "column=" not in err


def test_tokenized_json_lines_are_staged_and_reused(tmp_path, cache):
    rows = [{"input_ids": list(range(n)), "id": n} for n in (3, 9, 1, 40)]
    data = _write_jsonl(tmp_path / "tok.jsonl", rows)
    res = profile_files(data)
    assert res.format == "tokenized" and res.profile.lengths.tolist() == [3, 9, 1, 40]
    assert res.stage["parts"] == 1 and res.stage["reused"] == 0
    packed = pack_files(data, tmp_path / "p", 16, "bfd_split")
    assert packed.timings["parts_from_stage_cache"] == 1 and packed.stats["tokens_in"] == 53


def test_first_label_is_the_first_labelled_position_of_every_row():
    """stage.first_label (the position of each row's first label token, the row's length if none) against a
    plain loop, on random ragged rows with empty rows, unlabelled rows and several chunks."""
    import numpy as np
    import pyarrow as pa

    from packtools.core.arrow import list_array
    from packtools.pipeline.stage import first_label

    rng = np.random.default_rng(0)
    for _ in range(200):
        chunks, want = [], []
        for _ in range(rng.integers(1, 3)):
            lens = rng.integers(0, 6, rng.integers(0, 30))
            off = np.concatenate([[0], np.cumsum(lens)])
            vals = np.where(rng.random(off[-1]) < 0.3, rng.integers(0, 9, off[-1]), -100).astype(np.int32)
            chunks.append(list_array(off, vals, False, pa.int32()))
            for i, n in enumerate(lens):
                row = vals[off[i] : off[i + 1]].tolist()
                want.append(next((j for j, v in enumerate(row) if v != -100), int(n)))
        assert first_label(pa.chunked_array(chunks, pa.list_(pa.int32()))).tolist() == want


def test_an_executor_object_is_read_by_its_name_and_anything_else_refused(tmp_path, tok, cache, monkeypatch):
    """profile_files(executor=...) reads an Executor by its own name, as pack_files does: a LocalExecutor's jobs use
    the engine's threads (they were made single-threaded, as for a pool); a non-executor is refused by name."""
    from packtools.pipeline import profile as profile_module
    from packtools.pipeline.executors import LocalExecutor

    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts(50)])
    seen = []
    real = profile_module.run_jobs

    def spy(ex, fn, jobs, *args, **kwargs):
        seen.extend(j.single_threaded for j in jobs)
        return real(ex, fn, jobs, *args, **kwargs)

    monkeypatch.setattr(profile_module, "run_jobs", spy)
    assert profile_files(data, tok, executor=LocalExecutor(), stage_cache=False).profile.lengths.size == 50
    assert seen and not any(seen)
    for bad in (None, 3, "threads"):
        with pytest.raises(PackingError, match="executor=") as info:
            profile_files(data, tok, executor=bad, stage_cache=False)
        assert info.value.param == "executor"


def test_profile_then_pack_reuses_the_stage_of_a_small_input(tmp_path, tok, cache, monkeypatch):
    """A small input of a large vocabulary is tokenized by the reference alone (load.reference_suffices): profile
    chose its engine without the input's size, so it staged on the fast engine and pack, on the reference, dropped
    those parts and tokenized again, while profile had said pack would reuse them."""
    from packtools.pipeline import stage as stage_module
    from packtools.pipeline.tokenizer import load as tokenizer_load

    # the test tokenizer counts as a large vocabulary
    monkeypatch.setattr(tokenizer_load, "OVERLAP_MIN_BYTES", 0)
    monkeypatch.setattr(stage_module, "_TOKENIZERS", {})  # no tokenizer of another test's size class
    data = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in _texts()])
    assert os.path.getsize(data) < tokenizer_load.SMALL_INPUT_BYTES
    staged = profile_files(data, tok)
    assert staged.stage["parts"] == 1
    res = pack_files(data, tmp_path / "packed", 256, "bfd_split", tokenizer=tok)
    assert res.timings["parts_from_stage_cache"] == 1 and res.timings.get("parts_restaged", 0) == 0
    assert res.stats["tokenizer"]["engine"] == "transformers"  # the reference alone, in both


def test_profile_refuses_a_tokenizer_it_would_not_use_as_pack_does(tmp_path, tok, cache):
    """Rows holding both input_ids and messages are tokenized data (pack packs their input_ids and refuses a
    tokenizer, naming format='messages'); profile took the tokenizer and measured the input_ids without a word."""
    rows = [
        {
            "messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}],
            "input_ids": [1, 2],
        }
        for t in _texts(20)
    ]
    data = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(PackingError, match="format='messages'") as err:
        profile_files(data, tok)
    assert err.value.param == "tokenizer"
    with pytest.raises(PackingError, match="format='messages'"):
        pack_files(data, tmp_path / "packed", 256, tokenizer=tok)
    assert profile_files(data).profile.count == 20  # without the tokenizer: the input_ids, as pack packs them


def test_column_on_json_lines_says_to_drop_it(tmp_path, capsys):
    """`packtools profile rows.jsonl --column labels` was told to use `packtools profile PATH`, the command it ran."""
    data = _write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}])
    assert main(["profile", data, "--column", "labels"]) == 1
    err = capsys.readouterr().err
    assert "error (--column)" in err and "drop --column" in err and "packtools profile PATH" not in err, err
