"""Every fault of ``packtools pack`` is one clear line on stderr, exit status 1, and nothing left behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import build_tokenizer

import packtools.pipeline.gather as gather
from packtools.cli.main import main

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def fails(argv: list[str], capsys) -> str:
    """Run the CLI, check it failed with one line and no traceback; return that line."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return str(path)


def test_bad_tokenizer_folders(tmp_path, capsys):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    out = str(tmp_path / "out")
    err = fails(["pack", src, "--out", out, "--tokenizer", str(tmp_path / "nonexistent")], capsys)
    assert "(--tokenizer)" in err and "nonexistent' does not exist" in err and "save_pretrained" in err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    err = fails(["pack", src, "--out", out, "--tokenizer", str(tmp_path / "model")], capsys)
    assert "holds no tokenizer files" in err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    err = fails(["pack", src, "--out", out, "--tokenizer", str(tmp_path / "broken")], capsys)
    assert "cannot load a tokenizer from it" in err
    assert sorted(os.listdir(tmp_path)) == ["broken", "in.jsonl", "model"]


@pytest.mark.parametrize("column, rows", [
    ("text", [{"text": "a b"}, {"txt": "c d"}]),  # the key left out of the row
    ("text", [{"text": "a b"}, {"text": None}]),  # an explicit null
    ("completion", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}]),
])  # fmt: skip
def test_a_row_missing_its_text_column_is_named_missing_not_a_type(tmp_path, tok_dir, capsys, column, rows):
    """Arrow reads a key a JSON row leaves out as null: the refusal said "column 'text' is NoneType, not a
    string", naming a Python type the user never wrote (newcomer's JSONL with a misspelled key)."""
    src = jsonl(tmp_path / "in.jsonl", rows)
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--tokenizer", tok_dir], capsys)
    assert f"in.jsonl' line 2: column '{column}' is missing or null" in err and "NoneType" not in err


def test_bad_json_names_file_and_real_line(tmp_path, tok_dir, capsys):
    rows = [{"text": f"row {i}"} for i in range(600)]
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[500] = '{"text": "row 500" "oops": 1}'  # line 501
    src.write_text("\n".join(lines) + "\n")
    argv = ["pack", str(src), "--out", str(tmp_path / "out"), "--tokenizer", tok_dir]
    err = fails(argv, capsys)
    assert "bad.jsonl' line 501 column 20: malformed JSON" in err
    lines[500] = json.dumps({"text": "caf\u00e9"})
    src.write_bytes(("\n".join(lines) + "\n").encode().replace(b"caf\\u00e9", b"caf\xe9"))
    err = fails(argv, capsys)
    assert "bad.jsonl' line 501" in err and "not UTF-8" in err and "iconv" in err
    array = tmp_path / "arr.json"
    array.write_text("[\n" + ",\n".join(lines[:3]) + ",\n{oops}\n]")
    err = fails(["pack", str(array), "--out", str(tmp_path / "out"), "--tokenizer", tok_dir], capsys)
    assert "arr.json' line 5" in err and "malformed JSON" in err
    assert sorted(os.listdir(tmp_path)) == ["arr.json", "bad.jsonl"]


def test_chat_template_error_names_file_and_row(tmp_path, capsys):
    template = (
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    tok = build_tokenizer(str(tmp_path / "tok"), chat_template=template)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
    src = jsonl(
        tmp_path / "chat.jsonl", [{"messages": conv}] * 7 + [{"messages": bad}] + [{"messages": conv}]
    )
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--tokenizer", tok], capsys)
    assert "chat.jsonl' line 8" in err and "chat template" in err and "no boom here" in err
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]


def test_outputs_that_are_not_ours_are_refused(tmp_path, capsys):
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]]}), src)
    (tmp_path / "file").write_text("keep")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.txt").write_text("keep")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "theirs.parquet")
    before = {
        p: p.read_bytes()
        for p in (tmp_path / "file", tmp_path / "folder" / "x.txt", tmp_path / "theirs.parquet")
    }
    assert "is a file, not a packtools output" in fails(
        ["pack", src, "--out", str(tmp_path / "file")], capsys
    )
    assert "is not a packtools output" in fails(["pack", src, "--out", str(tmp_path / "folder")], capsys)
    err = fails(["pack", src, "--out", str(tmp_path / "theirs.parquet")], capsys)
    assert "not written by packtools pack" in err
    assert all(p.read_bytes() == b for p, b in before.items())
    ours = str(tmp_path / "ours.parquet")  # a file packtools wrote may be replaced
    assert main(["pack", src, "--out", ours, "--max-length", "4"]) == 0
    assert main(["pack", src, "--out", ours, "--max-length", "2"]) == 0
    capsys.readouterr()
    inside = fails(["pack", str(tmp_path), "--out", str(tmp_path / "packed")], capsys)
    assert "inside the input folder" in inside


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["pack", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("packtools pack: error")


def _big_input(tmp_path) -> str:
    src = str(tmp_path / "in.parquet")
    ids = pa.array([list(range(i % 500, i % 500 + 200)) for i in range(3000)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), src)
    return src


@pytest.mark.parametrize(
    "code, words", [(errno.ENOSPC, "no space left on the device"), (errno.EROFS, "cannot write")]
)
def test_write_errors_are_one_line(tmp_path, capsys, monkeypatch, code, words):
    src = _big_input(tmp_path)

    def failing(path, table):
        raise OSError(code, os.strerror(code), path)

    monkeypatch.setattr(gather, "write_shard", failing)
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--max-length", "256"], capsys)
    assert words in err and "(--out)" in err
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]


@contextlib.contextmanager
def mounted(folder, options: str):
    """A tmpfs at ``folder`` (root only; skips where mounting is not allowed)."""
    os.makedirs(folder)
    if os.geteuid() != 0:
        pytest.skip("mounting a small or read-only file system needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_real_full_disk(tmp_path, capsys):
    src = _big_input(tmp_path)
    with mounted(tmp_path / "small", "size=512k") as small:
        err = fails(["pack", src, "--out", str(small / "out"), "--max-length", "256"], capsys)
        assert "no space left on the device" in err
        assert os.listdir(small) == []


def test_a_real_read_only_folder(tmp_path, capsys):
    src = _big_input(tmp_path)
    with mounted(tmp_path / "ro", "ro,size=64k") as ro:
        err = fails(["pack", src, "--out", str(ro / "out"), "--max-length", "256"], capsys)
        assert "cannot write in" in err and "(--out)" in err


def test_a_tokenized_attention_mask_is_decided_at_pack_time(tmp_path, capsys):
    """pack packed a tokenized attention_mask column, which PaddingFreeCollator then refuses beside
    seq_lengths (found only at training time); a mask with 0s was refused while writing, naming a row of the
    write block rather than of the input.  Now: all ones -> left out with a note naming the column; a 0 ->
    refused while staging, naming the input's own row/line."""
    pytest.importorskip("torch")
    import datasets

    from packtools import PaddingFreeCollator, pack_files

    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6], [7, 8, 9]], "attention_mask": [[1, 1], [1, 1, 1]]}), ok)
    res = pack_files(str(ok), str(tmp_path / "out"), max_length=8)
    assert any("column 'attention_mask' left out" in n for n in res.notes), res.notes
    assert "attention_mask" in res.stats["columns_left_out"] and "attention_mask" not in res.stats["columns"]
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert ds.column_names == ["input_ids", "seq_lengths"]
    batch = PaddingFreeCollator(0)([ds[0]])  # trains: the collator refused the packed mask
    assert sorted(batch["input_ids"].tolist()[0]) == [5, 6, 7, 8, 9]
    rows = [{"input_ids": [5, 6], "attention_mask": [1, 1]}] * 3 + [
        {"input_ids": [7, 0], "attention_mask": [1, 0]}
    ]
    lines = tmp_path / "in" / "padded.jsonl"
    lines.parent.mkdir()
    (lines.parent / "a.jsonl").write_text(json.dumps(rows[0]) + "\n")
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = fails(["pack", str(lines.parent), "--out", str(tmp_path / "o2"), "--max-length", "8"], capsys)
    assert "padded.jsonl' line 4: column 'attention_mask' is 0 at position 1" in err, err


def test_padded_rows_are_refused_not_packed(tmp_path, capsys):
    """Tokenized rows padded to a fixed length (attention_mask 0s): packing would keep the pads as tokens."""
    src = str(tmp_path / "padded.parquet")
    pq.write_table(
        pa.table({"input_ids": [[5, 6, 0, 0], [7, 8, 9, 0]], "attention_mask": [[1, 1, 0, 0], [1, 1, 1, 0]]}),
        src,
    )
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--max-length", "8"], capsys)
    assert "padded.parquet' row 0: column 'attention_mask' is 0 at position 2" in err and "padding" in err
    assert sorted(os.listdir(tmp_path)) == ["padded.parquet"]
    # The same rows without their padding pack; the all-ones mask is left out.
    ok = str(tmp_path / "stripped.parquet")
    pq.write_table(pa.table({"input_ids": [[5, 6], [7, 8, 9]], "attention_mask": [[1, 1], [1, 1, 1]]}), ok)
    assert main(["pack", ok, "--out", str(tmp_path / "out"), "--max-length", "8"]) == 0


def test_the_mask_check_names_the_row_across_chunks_and_slices():
    """check_mask walks a column chunk by chunk (a memory-mapped file's whole column comes to it, and it copies
    no values): the padded row is named counting the chunks before it, past empty and null rows, in a sliced
    chunk too."""
    import pyarrow as pa

    from packtools.errors import PackingError
    from packtools.pipeline.stage import check_mask

    def named(col):
        with pytest.raises(PackingError) as err:
            check_mask(col, lambda row: f"row {row}")
        return str(err.value).split(": the rows")[0]

    ones = pa.array([[1], [1, 1]], pa.list_(pa.int8()))
    later = pa.array([[1, 1, 1], None, [], [1, 0, 1]], pa.list_(pa.int8()))
    assert named(pa.chunked_array([ones, later])) == "row 5: column 'attention_mask' is 0 at position 1"
    sliced = pa.array([[0], [1, 1, 0], [0]], pa.large_list(pa.int32())).slice(1)
    assert named(pa.chunked_array([sliced])) == "row 0: column 'attention_mask' is 0 at position 2"
    check_mask(pa.chunked_array([ones, ones]), lambda row: f"row {row}")  # all ones: nothing to refuse
