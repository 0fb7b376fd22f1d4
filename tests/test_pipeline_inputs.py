"""Every input file is read whole or the run fails (issue 22 item 2; findings S1-S9, S13, U1, U2, U3, U9).

Each silent case of the findings is run as it was found, and shows the run now fails with one line naming the
file (or packs everything and says what it skipped); each has a negative control: the same input without the
fault packs every row."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import build_tokenizer

from packtools import pack_files, profile_lengths
from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.io.discover import InputFile
from packtools.io.files import Part, read_part, read_schema, read_table


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return str(path)


def manifest(out) -> dict:
    return json.load(open(os.path.join(out, "manifest.json")))


# -- S1: an Arrow stream cut at a record-batch boundary ------------------------------------------------------
def _stream(path, rows=5000, batches=5) -> bytes:
    t = pa.table({"input_ids": pa.array([[i, i + 1] for i in range(rows)], pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
        for b in t.to_batches(max_chunksize=rows // batches):
            w.write_batch(b)
    return open(path, "rb").read()


def _batch_ends(path) -> list[int]:
    with pa.OSFile(str(path), "rb") as src:
        reader = pa.ipc.open_stream(src)
        return [src.tell() for _ in reader]


def test_an_arrow_stream_cut_at_a_batch_boundary_is_refused(tmp_path):
    whole = _stream(tmp_path / "whole.arrow")
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(whole[: _batch_ends(tmp_path / "whole.arrow")[2]])  # 3 of 5 batches, no end marker
    with pytest.raises(PackingError, match=r"cut\.arrow' is an Arrow IPC stream that ends after 3,000 rows"):
        pack_files(str(cut), str(tmp_path / "out"), max_length=64)
    with pytest.raises(PackingError, match="without its end-of-stream marker"):
        profile_lengths(str(cut))  # profile read the same 3,000 rows before
    assert not (tmp_path / "out").exists()
    # control: the whole stream packs all 5,000 rows
    assert (
        pack_files(str(tmp_path / "whole.arrow"), str(tmp_path / "out"), max_length=64).stats["rows_in"]
        == 5000
    )


def test_cut_and_corrupted_files_name_the_file(tmp_path, capsys):
    """U2: raw Arrow/Parquet errors become one line naming the file and the fix."""
    whole = _stream(tmp_path / "whole.arrow")
    pq.write_table(pa.table({"input_ids": [[1, 2]] * 100}), str(tmp_path / "ok.parquet"))
    pq_bytes = (tmp_path / "ok.parquet").read_bytes()
    cases = {"mid.arrow": whole[:-100], "zero.parquet": b"", "half.parquet": pq_bytes[: len(pq_bytes) // 2]}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        assert main(["pack", str(tmp_path / name), "--out", str(tmp_path / "out"), "--max-length", "8"]) == 1
        err = capsys.readouterr().err
        assert f"{name}' cannot be read as" in err and "copy it again" in err and "Error:" not in err, err


def test_a_folder_or_a_failed_system_read_is_not_called_a_corrupted_file(tmp_path):
    """Arrow's OSError is not always the file's contents: a folder named like a data file gets a line saying it
    is a folder; a read the system fails (EIO) names the system's error; neither claims the file is cut or
    corrupted.  A missing file still propagates as FileNotFoundError (its callers name it)."""
    for kind, name in (("parquet", "a Parquet"), ("arrow", "an Arrow IPC")):
        folder = tmp_path / f"x.{kind}"
        folder.mkdir()
        with pytest.raises(PackingError) as err:
            read_schema(InputFile(str(folder), kind, 0, 0, 0, 0))
        assert f"input {str(folder)!r} is a folder, not {name} file; pass a file" in str(err.value)
        assert "corrupted" not in str(err.value)
    with pytest.raises(PackingError, match=r"x\.arrow' is a folder, not an Arrow IPC file"):
        read_table(tmp_path / "x.arrow")
    with pytest.raises(FileNotFoundError):
        read_schema(InputFile(str(tmp_path / "missing.parquet"), "parquet", 0, 0, 0, 0))


def test_a_folder_that_a_saved_datasets_state_lists_as_a_data_file_is_named_as_a_folder(tmp_path):
    """A save_to_disk folder whose state.json lists a folder among its data files: the error says it is a
    folder the state lists, not "a pipe, socket or device"."""
    saved = tmp_path / "saved"
    (saved / "data-00000-of-00001.arrow").mkdir(parents=True)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    with pytest.raises(PackingError) as err:
        pack_files([str(saved)], str(tmp_path / "out"), max_length=8)
    message = str(err.value)
    assert (
        "data-00000-of-00001.arrow' is a folder, but its save_to_disk folder's state.json lists it" in message
    )
    assert "pipe" not in message


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="reads /proc/self/mem (Linux)")
def test_an_io_error_of_the_system_names_it_not_corruption(tmp_path):
    """Reading /proc/self/mem from its start fails in the kernel with EIO: a real failed read, which the
    error names as the system's, not as a cut or corrupted file."""
    link = tmp_path / "mem.arrow"
    link.symlink_to("/proc/self/mem")
    try:
        open(link, "rb").read(8)
    except OSError as exc:
        if exc.errno != errno.EIO:
            pytest.skip(f"reading /proc/self/mem fails here with {exc!r}, not EIO")
    else:
        pytest.skip("reading /proc/self/mem succeeds here")
    with pytest.raises(PackingError) as err:
        list(read_part(Part(InputFile(str(link), "arrow", 0, 0, 0, 0))))
    assert f"input {str(link)!r} could not be read: the system's read failed (EIO: " in str(err.value)
    assert "corrupted" not in str(err.value)


def test_a_system_error_that_is_not_the_disk_does_not_send_the_user_to_the_disk(tmp_path):
    """EMFILE (too many open files) names the limit's error and the system as the cause, not the disk or mount;
    EIO still points at the disk."""
    from packtools.io.files import reading

    path = str(tmp_path / "x.parquet")
    for code, disk in ((errno.EMFILE, False), (errno.EIO, True)):
        with pytest.raises(PackingError) as err, reading(path, "parquet"):
            raise OSError(code, os.strerror(code))
        message = str(err.value)
        assert f"({errno.errorcode[code]}: " in message and "corrupted" not in message
        assert ("check the disk or mount" in message) is disk


# -- S2-S4: a column that appears only later ----------------------------------------------------------------
def test_labels_only_in_a_later_file_stop_the_run(tmp_path):
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]] * 3}), a)
    pq.write_table(pa.table({"input_ids": [[4, 5]] * 3, "labels": [[-100, 5]] * 3}), b)
    with pytest.raises(
        PackingError, match=r"b\.parquet' has the token column\(s\) \['labels'\] that the first"
    ):
        pack_files([a, b], str(tmp_path / "out"), max_length=8)
    # choosing the columns is explicit, and what is left out is listed (from every file)
    res = pack_files([a, b], str(tmp_path / "out"), max_length=8, columns=("input_ids",))
    assert res.stats["columns_left_out"] == ["labels"] and res.stats["rows_in"] == 6
    # control: the same files with labels in both pack with labels
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]] * 3, "labels": [[1, 2, 3]] * 3}), a)
    assert pack_files([a, b], str(tmp_path / "out2"), max_length=8).stats["columns"] == [
        "input_ids",
        "labels",
    ]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_boolean_mask_column_is_refused_not_left_out(tmp_path, kind):
    """adv46: a ``completion_mask`` of booleans was left out of tokenized input without an error (only the
    summary's "left out" said it), so every prompt token was trained; ``pack_dataset`` refuses the same column.
    Now refused naming the column and the cast; named out with ``columns=`` it is left out knowingly."""
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [False, True, True]}] * 3
    if kind == "parquet":
        src = str(tmp_path / "m.parquet")
        pq.write_table(pa.Table.from_pylist(rows), src)
    else:
        src = jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(
        PackingError, match=r"column 'completion_mask' has type list<(element|item): bool>.*list<int8>"
    ):
        pack_files(src, str(tmp_path / "out"), max_length=8)
    assert not (tmp_path / "out").exists()
    res = pack_files(src, str(tmp_path / "out"), max_length=8, columns=("input_ids",))
    assert res.stats["columns_left_out"] == ["completion_mask"]
    # control: the same mask as integers is packed with the ids
    ints = [{**r, "completion_mask": [int(m) for m in r["completion_mask"]]} for r in rows]
    src = str(tmp_path / "i.parquet")
    pq.write_table(pa.Table.from_pylist(ints), src)
    assert pack_files(src, str(tmp_path / "out2"), max_length=8).stats["columns"] == [
        "input_ids",
        "completion_mask",
    ]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_id_that_does_not_fit_the_column_type_names_its_own_line(tmp_path, kind):
    """adv46: the id that does not fit the first file's integer type (int32 for JSON) was named at the first
    line of its block (line 1 for one on line 4); now at its own line (JSON lines) or row (Parquet)."""
    rows = [{"input_ids": [1, 2]}] * 3 + [{"input_ids": [1, 3_000_000_000]}] + [{"input_ids": [5]}]
    first = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}), first)
    if kind == "jsonl":
        src, want = jsonl(tmp_path / "b.jsonl", rows), "line 4"
    else:
        src, want = str(tmp_path / "b.parquet"), "row 3"
        pq.write_table(pa.Table.from_pylist(rows), src)
    with pytest.raises(
        PackingError, match=rf"b\.{kind}' {want}: column 'input_ids' .* does not fit list<int32>"
    ):
        pack_files([first, src], str(tmp_path / "out"), max_length=8)
    assert not (tmp_path / "out").exists()
    if kind == "jsonl":  # alone, a JSON file's ids are int32 by the run's rule, not by a "first input file"
        with pytest.raises(PackingError, match=r"line 4: .*int32 when the first input is JSON") as alone:
            pack_files([src], str(tmp_path / "out"), max_length=8)
        assert "check the ids there" in str(alone.value)


def test_labels_only_after_the_first_jsonl_block_stop_the_run(tmp_path, monkeypatch):
    import packtools.io.json as pj

    # 4 KiB blocks instead of 16 MiB: the same code path as the finding's 900,000 lines, in 2,010
    monkeypatch.setattr(pj.iter_json_lines, "__defaults__", (0, None, 1 << 12))
    rows = [{"input_ids": [1, 2, 3]}] * 2000 + [{"input_ids": [4, 5], "labels": [-100, 5]}] * 10
    src = jsonl(tmp_path / "late.jsonl", rows)
    with pytest.raises(PackingError, match=r"late\.jsonl' line 2001 has the column 'labels'"):
        pack_files(src, str(tmp_path / "out"), max_length=8)
    # choosing the columns cannot list a key the first block lacks, so it is refused too (no suggested fix
    # drops data unlisted)
    with pytest.raises(PackingError, match="has the column 'labels'"):
        pack_files(src, str(tmp_path / "out"), max_length=8, columns=("input_ids",))
    assert not (tmp_path / "out").exists()
    # control: labels from the first line on are kept
    src = jsonl(tmp_path / "early.jsonl", [{**r, "labels": r["input_ids"]} for r in rows])
    assert pack_files(src, str(tmp_path / "out"), max_length=8).stats["columns"] == ["input_ids", "labels"]


def test_labels_only_from_json_object_64_on_stop_the_run(tmp_path):
    rows = [{"input_ids": [1, 2, 3]}] * 70 + [{"input_ids": [4, 5], "labels": [-100, 5]}] * 30
    src = tmp_path / "arr.json"
    src.write_text(json.dumps(rows))
    with pytest.raises(PackingError, match=r"arr\.json' object 70 has the column 'labels'"):
        pack_files(str(src), str(tmp_path / "out"), max_length=8)
    src.write_text(json.dumps([{**r, "labels": r["input_ids"]} for r in rows]))  # control
    assert pack_files(str(src), str(tmp_path / "out"), max_length=8).stats["columns"] == [
        "input_ids",
        "labels",
    ]


# -- S5: a chat message without a role ------------------------------------------------------------------------
def test_a_message_without_a_role_is_refused(tmp_path, tok_dir):
    bad = [{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    src = jsonl(tmp_path / "chat.jsonl", bad)
    with pytest.raises(PackingError, match="every message with a role"):
        pack_files(src, str(tmp_path / "out"), max_length=64, tokenizer=tok_dir)
    good = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    src = jsonl(tmp_path / "chat.jsonl", good)  # control
    assert pack_files(src, str(tmp_path / "out"), max_length=64, tokenizer=tok_dir).stats["rows_in"] == 1


def test_an_empty_conversational_completion_is_named_not_blamed_on_the_template(tmp_path, tok_dir):
    """U6: a preference pair whose chosen conversation is [] says so (the template is fine)."""
    prompt = [{"role": "user", "content": "hi"}]
    reply = [{"role": "assistant", "content": "yo"}]
    bad = [{"prompt": prompt, "chosen": [], "rejected": reply}]
    src = jsonl(tmp_path / "pref.jsonl", bad)
    with pytest.raises(PackingError, match="column 'chosen' is an empty conversation") as info:
        pack_files(src, str(tmp_path / "out"), max_length=64, tokenizer=tok_dir)
    assert "renders the prompt differently" not in str(info.value)
    good = [{"prompt": prompt, "chosen": reply, "rejected": reply}]
    src = jsonl(tmp_path / "pref.jsonl", good)  # control: the same template packs a non-empty pair
    assert pack_files(src, str(tmp_path / "out"), max_length=64, tokenizer=tok_dir).stats["rows_in"] == 1


# -- S6-S9: what a folder holds ---------------------------------------------------------------------------------
def test_every_file_in_a_folder_is_read_or_listed(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    jsonl(d / "a.jsonl", [{"input_ids": [1, 2]}])
    pq.write_table(pa.table({"input_ids": [[3, 4]]}), str(d / "b.parquet"))
    (d / "notes.txt").write_text("n")
    (d / "c.csv").write_text("input_ids\n")
    jsonl(d / ".hidden.jsonl", [{"input_ids": [9]}])
    out = str(tmp_path / "out")
    assert main(["pack", str(d), "--out", out, "--max-length", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert (
        "not read: 3 path(s)" in err and "notes.txt (not a data file (.txt))" in err and "hidden file" in err
    )
    listed = {os.path.basename(s["path"]): s["reason"] for s in manifest(out)["inputs_skipped"]}
    assert sorted(listed) == [".hidden.jsonl", "c.csv", "notes.txt"]
    assert manifest(out)["stats"]["rows_in"] == 2
    # a compressed shard stops the run (a folder of mixed shards would lose it)
    jsonl(d / "d.jsonl", [{"input_ids": [5]}])
    os.system(f"gzip {d / 'd.jsonl'}")
    assert main(["pack", str(d), "--out", out, "--max-length", "8", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "d.jsonl.gz' is compressed (.gz)" in err and "decompress it" in err


def test_symlinked_sub_folders_are_followed_and_loops_listed(tmp_path):
    d, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    jsonl(d / "a.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": [4]}])
    jsonl(elsewhere / "b.jsonl", [{"input_ids": [5]}])
    os.symlink(elsewhere, d / "sub")
    os.symlink(d, d / "loop")
    res = pack_files(str(d), str(tmp_path / "out"), max_length=8)
    assert res.stats["rows_in"] == 4  # 3 + 1: the symlinked folder is read
    reasons = [s["reason"] for s in res.manifest["inputs_skipped"]]
    assert any("a symlink to a folder already read" in r for r in reasons)


def test_duplicates_by_real_path_are_read_once_and_listed(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    a = jsonl(d / "a.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": [4]}])
    os.symlink(a, tmp_path / "b.jsonl")
    for inputs in ([a, a], [a, str(d)], [a, str(tmp_path / "b.jsonl")]):
        res = pack_files(inputs, str(tmp_path / "out"), max_length=8)
        assert res.stats["rows_in"] == 3, inputs  # one way: read once (a symlink packed it twice before)
        assert [s["reason"] for s in res.manifest["inputs_skipped"]] == [
            f"the same file as {a!r} (read once)"
        ]


def test_metadata_json_in_a_data_folder_is_not_a_document(tmp_path, tok_dir):
    d = tmp_path / "in"
    d.mkdir()
    jsonl(d / "a.jsonl", [{"text": "hello world"}])
    (d / "meta.json").write_text(json.dumps({"text": "DATASET CARD: do not train on me", "license": "cc"}))
    res = pack_files(str(d), str(tmp_path / "out"), max_length=64, tokenizer=tok_dir)
    assert res.stats["rows_in"] == 1
    assert res.manifest["inputs_skipped"][0]["reason"].startswith("a metadata file, not data")
    # named as an input, it is read (the rule is about folders)
    res = pack_files(
        [str(d / "a.jsonl"), str(d / "meta.json")], str(tmp_path / "o2"), max_length=64, tokenizer=tok_dir
    )
    assert res.stats["rows_in"] == 2


def test_a_folder_of_save_to_disk_splits_says_pass_one_split(tmp_path):
    """U9."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    ds.save_to_disk(str(tmp_path / "in" / "train"))
    ds.save_to_disk(str(tmp_path / "in" / "test"))
    with pytest.raises(PackingError, match="pass that folder .one split. as the input"):
        pack_files(str(tmp_path / "in"), str(tmp_path / "out"), max_length=8)
    assert (
        pack_files(str(tmp_path / "in" / "train"), str(tmp_path / "out"), max_length=8).stats["rows_in"] == 2
    )


# -- S13: the fix an error suggests must not merge --------------------------------------------------------------
def test_packed_input_is_refused_whatever_columns_are_chosen(tmp_path):
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), src)
    packed = pack_files(src, str(tmp_path / "packed"), max_length=8).out
    for columns in (None, ("input_ids",)):
        with pytest.raises(PackingError, match="already packed") as info:
            pack_files(packed, str(tmp_path / "again"), max_length=8, columns=columns)
        assert "columns=[" not in str(info.value)  # the suggestion that merged sequences is gone
        assert "packtools.core.unpack" in str(info.value)
    # following the suggestion that is left keeps every sequence apart
    from packtools.core import unpack
    from packtools.io.files import read_table

    shard = next(n for n in sorted(os.listdir(packed)) if n.endswith(".arrow"))
    pq.write_table(unpack(read_table(os.path.join(packed, shard))), str(tmp_path / "unpacked.parquet"))
    again = pack_files(str(tmp_path / "unpacked.parquet"), str(tmp_path / "again"), max_length=8)
    assert again.stats["rows_in"] == 3 and again.stats["sequences_packed"] == 3


# -- U1, U3 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "  \n\n", "[]"])
def test_an_empty_input_says_it_holds_no_rows(tmp_path, content):
    src = tmp_path / ("a.json" if content == "[]" else "a.jsonl")
    src.write_text(content)
    with pytest.raises(PackingError, match="holds no rows"):
        pack_files(str(src), str(tmp_path / "out"), max_length=8)


@pytest.mark.parametrize(
    "bad, said",
    [
        ('{"input_ids": null, "labels": [1]}', "column 'input_ids' is null"),
        ('{"input_ids": [1, null], "labels": [1, 2]}', "column 'input_ids' contains a null value"),
        ('{"input_ids": [1, 2, 3], "labels": [1, 2]}', "differ in length at input"),
    ],
)
@pytest.mark.parametrize("part_bytes", [1 << 26, 2000])  # one part, or parts that start past line 1
def test_a_bad_json_line_is_named_by_its_own_line_number(tmp_path, capsys, bad, said, part_bytes):
    """A null (or misaligned) row was named "line B (block start) ... row R", B its block's first line: the
    error names the file's line B + R itself."""
    lines = [json.dumps({"input_ids": [i, i + 1], "labels": [i, i + 1]}) for i in range(300)]
    lines[236] = bad  # line 237 of the file
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackingError) as err:
        pack_files(str(src), str(tmp_path / "out"), max_length=8, part_bytes=part_bytes)
    assert f"input {str(src)!r} line 237" in str(err.value) and said in str(err.value), err.value
    assert "block start" not in str(err.value) and "row 236" not in str(err.value)
    # the CLI says the same line
    assert main(["pack", str(src), "--out", str(tmp_path / "cli"), "--max-length", "8", "--quiet"]) != 0
    assert "line 237" in capsys.readouterr().err


@pytest.mark.parametrize("part_bytes", [1 << 26, 2000])
def test_a_bad_json_line_after_blank_lines_is_named_by_its_own_line(tmp_path, part_bytes):
    """The reader skips blank lines (and lines of spaces), so row R of a block is not line B + R once one is
    skipped: a null on line 243 behind 6 blank lines was named "line 237".  The row's own line is named."""
    lines = [json.dumps({"input_ids": [i, i + 1]}) for i in range(300)]
    for at in (10, 11, 150, 200, 230, 231):
        lines.insert(at, "" if at % 2 else "  ")
    bad = next(i for i, line in enumerate(lines) if line.startswith('{"input_ids": [236,'))
    lines[bad] = '{"input_ids": [1, null]}'
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackingError) as err:
        pack_files(str(src), str(tmp_path / "out"), max_length=8, part_bytes=part_bytes)
    assert f"input {str(src)!r} line {bad + 1}:" in str(err.value), err.value
    assert bad + 1 == 243


def test_an_empty_shard_beside_others_is_noted_and_an_input_of_no_rows_is_refused(tmp_path, capsys):
    """An empty JSON lines shard stopped a run while an empty Parquet shard was accepted, and an input of only
    empty Parquet files packed 0 rows with status 0: now an empty shard among others is left out, in either
    format, with a note naming it, and an input of no rows at all is refused, in either format."""
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4
    for kind in ("jsonl", "parquet"):
        d = tmp_path / kind
        d.mkdir()
        for i in range(3):
            src = d / f"s{i}.{kind}"
            if kind == "jsonl":
                jsonl(src, rows if i != 1 else [])
            else:
                table = pa.Table.from_pylist(rows)
                pq.write_table(table if i != 1 else table.slice(0, 0), str(src))
        got = pack_files(str(d), str(tmp_path / f"out-{kind}"), max_length=8)
        assert got.stats["rows_in"] == 8
        assert any("held no rows" in n and f"s1.{kind}" in n for n in got.notes), got.notes
        assert (
            main(["pack", str(d), "--out", str(tmp_path / f"cli-{kind}"), "--max-length", "8", "--quiet"])
            == 0
        )
        assert f"s1.{kind}" in capsys.readouterr().err
        # only the empty shard: refused, naming it
        only = d / f"s1.{kind}"
        with pytest.raises(PackingError, match=r"the input holds no rows: .*s1\." + kind):
            pack_files(str(only), str(tmp_path / f"none-{kind}"), max_length=8)
        assert not os.path.exists(tmp_path / f"none-{kind}")


def test_profile_refuses_an_input_of_only_empty_files_as_pack_does(tmp_path, tok_dir, capsys):
    """profile on Parquet files of 0 rows (tokenized, read by offsets; or text, staged) reported "the dataset
    holds no tokens" with status 0 where pack refuses an input with no rows; now it refuses the same way, and
    notes an empty file among others as pack does."""
    from packtools import profile_files

    for name, table in (
        ("tokenized", pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))})),
        ("text", pa.table({"text": pa.array([], pa.string())})),
    ):
        d = tmp_path / name
        d.mkdir()
        pq.write_table(table, str(d / "s0.parquet"))
        pq.write_table(table, str(d / "s1.parquet"))
        tok = [] if name == "tokenized" else ["--tokenizer", tok_dir]
        assert main(["profile", str(d), *tok]) == 1
        err = capsys.readouterr().err
        assert "the input holds no rows" in err and "s0.parquet" in err, err
        with pytest.raises(PackingError, match="the input holds no rows"):
            profile_files(str(d), tokenizer=tok_dir if tok else None)
    pq.write_table(pa.table({"text": ["hello there", "yes"]}), str(tmp_path / "text" / "s2.parquet"))
    got = profile_files(str(tmp_path / "text"), tokenizer=tok_dir)
    assert got.profile.count == 2
    assert any("held no rows" in n and "s0.parquet" in n for n in got.notes), got.notes


def test_preference_profile_drops_what_pack_drops(tmp_path, tok_dir, capsys):
    """The preference profile's "bfd drops" counted ``sum(max(0, 2p + c + r - max_length))`` per pair, but
    pack truncates a pair by its own rule (the prompt, held twice, loses whole tokens; completions are cut to
    fit), so it drops more (e.g. 139 where the profile said 135).  The profile now keeps what pack keeps."""
    import random

    from packtools import profile_files

    rng = random.Random(0)
    words = "hello there how are you doing today yes no maybe cat dog".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    rows = [{"prompt": text(rng.randint(1, 30)), "chosen": text(rng.randint(1, 30)),
             "rejected": text(rng.randint(1, 30))} for _ in range(200)]  # fmt: skip
    src = jsonl(tmp_path / "pref.jsonl", rows)
    prof = profile_files(src, tokenizer=tok_dir, format="preference").profile
    odd = 0
    for m in (128, 256, 320):
        got = pack_files(src, str(tmp_path / f"out{m}"), max_length=m, tokenizer=tok_dir, format="preference")
        assert prof.total_tokens == got.stats["tokens_in"]
        assert prof.total_tokens - prof.tokens_kept(m) == got.stats["tokens_dropped"], m
        overflow = int(np.maximum(prof.lengths - m, 0).sum())
        odd += got.stats["tokens_dropped"] != overflow
    assert odd  # the data has pairs that pack cuts past the overflow (the old count was wrong there)
    assert main(["profile", src, "--tokenizer", tok_dir, "--format", "preference"]) == 0
    table = capsys.readouterr().out
    line = next(x for x in table.splitlines() if "tokens kept by bfd" in x)
    m, dropped = int(line.split()[-7]), int(line.split()[-5].replace(",", ""))
    assert dropped == prof.total_tokens - prof.tokens_kept(m)


def test_ids_beyond_int64_in_json_say_so(tmp_path):
    src = jsonl(tmp_path / "big.jsonl", [{"input_ids": [1, 30000000000000000000]}])
    with pytest.raises(PackingError, match="beyond the int64 range"):
        pack_files(src, str(tmp_path / "out"), max_length=8)


# -- U7, U10, U14 ---------------------------------------------------------------------------------------------
def test_an_empty_preference_pair_names_the_file_not_a_flag(tmp_path, tok_dir, capsys):
    src = jsonl(
        tmp_path / "pref.jsonl",
        [{"prompt": "hi", "chosen": "yes", "rejected": "no"}, {"prompt": "", "chosen": "", "rejected": ""}],
    )
    out = str(tmp_path / "out")
    assert (
        main(["pack", src, "--out", out, "--max-length", "64", "--tokenizer", tok_dir, "--no-eos", "--quiet"])
        == 1
    )
    err = capsys.readouterr().err
    assert "(--dataset)" not in err and "pref.jsonl' pair 1: the chosen completion would be empty" in err


def test_out_file_with_a_jsonl_input_says_give_a_folder(tmp_path, capsys):
    src = jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2]}])
    assert main(["pack", src, "--out", str(tmp_path / "y.arrow"), "--max-length", "8"]) == 1
    err = capsys.readouterr().err
    assert "(--out)" in err and "give --out a folder" in err
    assert main(["pack", src, "--out", str(tmp_path / "y"), "--max-length", "8", "--quiet"]) == 0  # control


def test_a_held_out_is_refused_before_the_tokenizer_loads(tmp_path, tok_dir, monkeypatch):
    """U14: the refusal names the holder and comes before the slow steps."""
    import packtools.pipeline.stage as stage
    from packtools.io.lock import OutputLock

    src = jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    loaded = []
    real = stage.preload_tokenizer
    monkeypatch.setattr(stage, "preload_tokenizer", lambda *a, **k: loaded.append(a) or real(*a, **k))
    lock = OutputLock(str(tmp_path / ".out.packtools.lock"))
    lock.acquire()
    try:
        with pytest.raises(PackingError, match=rf"another packtools run \(pid {os.getpid()} on host"):
            pack_files(src, str(tmp_path / "out"), max_length=16, tokenizer=tok_dir)
        assert loaded == []
    finally:
        lock.release()
    pack_files(src, str(tmp_path / "out"), max_length=16, tokenizer=tok_dir)  # control: free, it runs
    assert loaded


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_by_name_not_called_an_empty_folder(tmp_path):
    """A FIFO named as the input (``<(zcat x.gz)`` or ``mkfifo``) was reported as a folder holding no data file;
    one inside a data folder would have been opened as a data file. Both are refused naming the pipe and the fix;
    negative control: a regular file beside it packs."""
    fifo = str(tmp_path / "stream.jsonl")
    os.mkfifo(fifo)
    with pytest.raises(PackingError, match=r"is not a regular file or folder.*write the stream to a file"):
        pack_files(fifo, str(tmp_path / "out"), max_length=8)
    d = tmp_path / "in"
    d.mkdir()
    jsonl(d / "a.jsonl", [{"input_ids": [1, 2]}])
    assert pack_files(str(d), str(tmp_path / "out"), max_length=8).stats["rows_in"] == 1
    os.mkfifo(d / "b.jsonl")
    with pytest.raises(PackingError, match=r"b\.jsonl' is not a regular file"):
        pack_files(str(d), str(tmp_path / "out2"), max_length=8)
