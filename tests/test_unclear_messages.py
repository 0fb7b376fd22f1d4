"""Messages of adversarial 2026-12c's "Unclear" list that named the wrong fix or read badly: a UTF-16 JSON-lines
file is said to be UTF-16, with the iconv line that converts it (not Latin-1's); an input that changed while
packing no longer ends its message with a double period."""

from __future__ import annotations

import json

import pytest

from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.io.discover import discover
from packtools.io.files import iter_part, split_file

ROWS = "".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(3))


@pytest.mark.parametrize(
    ("encoding", "name"), [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE")]
)
def test_utf16_json_lines_name_their_encoding_and_the_right_iconv(tmp_path, capsys, encoding, name):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(ROWS.encode(encoding))
    assert main(["pack", str(path), "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"looks {name}-encoded" in err and f"iconv -f {name} -t UTF-8 IN > OUT" in err, err
    assert "latin1" not in err


def test_a_latin1_file_still_gets_the_latin1_hint(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin1"))
    assert main(["pack", str(path), "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"]) == 1
    assert "iconv -f latin1 -t utf-8" in capsys.readouterr().err


def test_input_changed_message_has_one_period(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{bad\n')
    (part,) = split_file(discover([str(path)])[0])
    with path.open("a") as fh:  # a writer appends while the run reads
        fh.write('{"input_ids": [3]}\n')
    with pytest.raises(PackingError, match="changed while packing") as err:
        list(iter_part(part))
    assert ".." not in str(err.value), str(err.value)
    assert str(err.value).count("Run again once nothing writes to it") == 1


def test_a_float_side_column_names_the_columns_flag(tmp_path, capsys):
    """A list<double> side column (a score per row) is refused, since JSON reads ids beyond int64 as floats;
    the message named only the cast, not how to leave a column that holds no ids out of the pack."""
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "score": [0.5]}) + "\n")
    )
    assert main(["pack", str(path), "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "column 'score' has type list<item: double>" in err
    assert "--columns input_ids,labels" in err, err
    argv = ["pack", str(path), "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"]
    assert main([*argv, "--columns", "input_ids,labels"]) == 0


def test_num_proc_below_one_is_refused(tmp_path, capsys):
    """--num-proc 0 (or -2) packed in this process without a word; the other counts (--workers) are refused."""
    path = tmp_path / "rows.jsonl"
    path.write_text(ROWS)
    for n in ("0", "-2"):
        argv = [
            "pack",
            str(path),
            "--out",
            str(tmp_path / "out"),
            "--max-length",
            "8",
            "--quiet",
            "--num-proc",
            n,
        ]
        assert main(argv) == 1
        assert "error (--num-proc)" in capsys.readouterr().err
