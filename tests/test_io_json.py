"""JSON input read in blocks: every row once and in order, whatever the block size; lines numbered right."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from packtools.errors import PackingError
from packtools.io.discover import discover
from packtools.io.files import iter_part, split_file
from packtools.io.json import LineBase, iter_json_array, iter_json_lines, line_ranges

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
rows_st = st.lists(st.fixed_dictionaries({"text": texts, "n": st.integers(-5, 5)}), min_size=1, max_size=40)


@given(rows=rows_st, block=st.integers(1, 200), part=st.integers(1, 300))
def test_lines_in_blocks_and_byte_ranges_read_every_row_once(tmp_path_factory, rows, block, part):
    path = str(tmp_path_factory.mktemp("j") / "rows.jsonl")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    got = []
    for start, stop in line_ranges(path, part):
        base = LineBase(path, start).value
        for k, table in iter_json_lines(path, start, stop, block_bytes=block):
            assert base + k == len(got) + 1  # the block's first row is on this line
            got += table.to_pylist()
    assert got == rows


@given(rows=rows_st, read=st.integers(1, 64), block_rows=st.integers(1, 7))
def test_a_json_array_streams_object_by_object(tmp_path_factory, rows, read, block_rows):
    path = str(tmp_path_factory.mktemp("a") / "rows.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1, ensure_ascii=False)
    got = [r for _, t in iter_json_array(path, block_rows, read_bytes=read) for r in t.to_pylist()]
    assert got == rows


def test_parts_of_a_file_give_its_rows_in_order(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"i": i, "pad": "x" * (i % 13)}) + "\n" for i in range(500)))
    [file] = discover([str(path)])
    parts = split_file(file, part_bytes=700)
    assert len(parts) > 5
    seen = [r["i"] for p in parts for _, t in iter_part(p, batch_rows=7) for r in t.to_pylist()]
    assert seen == list(range(500))
    where = [w(0) for _, (w, _) in zip(range(3), iter_part(parts[2], batch_rows=7))]
    first_i = next(iter_part(parts[2], batch_rows=7))[1].column("i")[0].as_py()
    assert where[0].endswith(f"line {first_i + 1}")


def test_errors_and_odd_files(tmp_path):
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b'{"a": 1}\r\n\r\n{"a": 2}\r\n')
    assert [r for _, t in iter_json_lines(str(crlf)) for r in t.to_pylist()] == [{"a": 1}, {"a": 2}]
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf[{"a": "]"}, {"a": ","}]')
    assert [r for _, t in iter_json_array(str(bom)) for r in t.to_pylist()] == [{"a": "]"}, {"a": ","}]
    cut = tmp_path / "cut.json"
    cut.write_text('[{"a": 1},\n{"a": 2}')
    with pytest.raises(PackingError, match="cut.json' line 2.*not closed"):
        list(iter_json_array(str(cut)))
    nocomma = tmp_path / "nocomma.json"
    nocomma.write_text('[{"a": 1}\n{"a": 2}]')
    with pytest.raises(PackingError, match="line 2: expected ',' or ']'"):
        list(iter_json_array(str(nocomma)))
    scalars = tmp_path / "scalars.jsonl"
    scalars.write_text('{"a": 1}\n3\n')
    with pytest.raises(PackingError, match="line 2: each JSON line must be an object"):
        list(iter_json_lines(str(scalars)))


def test_an_array_wrapped_in_one_key(tmp_path):
    rows = [{"text": f"r{i}", "n": i} for i in range(25)]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": rows}, indent=2))
    [file] = discover([str(wrapped)])
    assert [r for _, t in iter_part(split_file(file)[0], batch_rows=4) for r in t.to_pylist()] == rows
    lines = tmp_path / "lines.json"  # JSON lines whose first object holds a list are still JSON lines
    lines.write_text("".join(json.dumps({"data": [i]}) + "\n" for i in range(3)))
    [file] = discover([str(lines)])
    assert [r for _, t in iter_part(split_file(file)[0]) for r in t.to_pylist()] == [
        {"data": [i]} for i in range(3)
    ]


def test_json_that_python_reads_but_arrow_refuses_names_the_line_and_the_fix(tmp_path):
    """U4, U5: a lone surrogate escape, and a key that is a list in one row and a string in another."""
    from packtools import pack_files
    from packtools.errors import PackingError

    src = tmp_path / "u4.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [3], "note": "\\ud800"}\n')
    with pytest.raises(PackingError, match=r"u4\.jsonl' line 3: .*lone UTF-16 surrogate escape"):
        pack_files(str(src), str(tmp_path / "out"), max_length=8)
    src = tmp_path / "u5.jsonl"
    src.write_text('{"input_ids": [1], "meta": [1]}\n{"input_ids": [2], "meta": "x"}\n')
    with pytest.raises(PackingError, match=r"u5\.jsonl' line 2: .*different types in different rows"):
        pack_files(str(src), str(tmp_path / "out"), max_length=8)
    src.write_text('{"input_ids": [1], "meta": [1]}\n{"input_ids": [2], "meta": [2]}\n')  # control
    assert pack_files(str(src), str(tmp_path / "out"), max_length=8).stats["rows_in"] == 2


@pytest.mark.parametrize(
    "data, line, column",
    [
        (b'{"te\xffxt": "ab"}\n', 1, 5),  # in a field name
        (b'{"messages": [{"role": "u", "content": "a\xffb"}]}\n', 1, 42),  # in a nested string
        (b'{"messages": [{"ro\xffle": "u"}]}\n', 1, 19),  # in a nested field name (not in Arrow's check)
        (b'{"text": "ok \xc3\xa9"}\n{"text": "bad \xc3"}\n', 2, 15),  # a cut sequence after valid non-ASCII
    ],
)
def test_bytes_that_are_not_utf8_are_found_wherever_they_are(tmp_path, data, line, column):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    with pytest.raises(PackingError, match=rf"line {line}: bytes .* at column {column} are not UTF-8"):
        list(iter_json_lines(str(path)))


def test_a_real_replacement_character_is_text_not_an_error(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"te\ufffdxt": "gr\u00fc\ufffd"}\n', encoding="utf-8")
    assert [r for _, t in iter_json_lines(str(path)) for r in t.to_pylist()] == [
        {"te\ufffdxt": "gr\u00fc\ufffd"}
    ]


# --- blocks read into one reused buffer (io.json._Blocks) ---


def _blocks_read_afresh(data: bytes, block: int) -> list[bytes]:
    """The blocks as reading each afresh gives them: ``block`` bytes from the previous cut, cut after their last
    newline; with no newline, ``block`` more bytes until there is one or the end."""
    out, pos = [], 0
    while pos < len(data):
        want = block
        while pos + want < len(data) and b"\n" not in data[pos : pos + want]:
            want += block
        window = data[pos : pos + want]
        cut = len(window) if pos + want >= len(data) else window.rfind(b"\n") + 1
        out.append(window[:cut])
        pos += cut
    return out


@example(data=b"\n" + b"a" * 30 + b"\n" + b"a" * 50, block=20)  # the moved tail overlaps its old place
@given(
    data=st.binary(max_size=300).map(lambda b: bytes(b"a\n\r "[x % 4] for x in b)), block=st.integers(1, 40)
)
def test_the_reused_buffer_gives_the_blocks_that_reading_afresh_gives(tmp_path_factory, data, block):
    from packtools.io.json import _Blocks

    path = tmp_path_factory.mktemp("b") / "raw"
    path.write_bytes(data)
    got = []
    with open(path, "rb", buffering=0) as fh:
        blocks = _Blocks(fh, len(data), block)
        while (b := blocks.next()) is not None:
            buf, end = b
            got.append(bytes(buf[:end]))
            blocks.keep_tail(end)
    assert got == _blocks_read_afresh(data, block)


line_st = st.one_of(
    st.fixed_dictionaries({"text": texts, "n": st.integers(-5, 5)}).map(lambda r: ("row", r)),
    st.sampled_from(["", " ", "\t", "\r"]).map(lambda s: ("blank", s)),
)


@given(
    lines=st.lists(line_st, min_size=1, max_size=30),
    crlf=st.booleans(),
    last_newline=st.booleans(),
    block=st.integers(1, 120),
)
def test_blank_lines_crlf_and_a_last_line_without_newline_in_any_block(
    tmp_path_factory, lines, crlf, last_newline, block
):
    """Every row once, the line number of each block's first row right, whatever cuts the blocks."""
    end = "\r\n" if crlf else "\n"
    texts_ = [json.dumps(v, ensure_ascii=False) if kind == "row" else v for kind, v in lines]
    body = end.join(texts_) + (end if last_newline else "")
    path = str(tmp_path_factory.mktemp("l") / "rows.jsonl")
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(body)
    row_lines = [i + 1 for i, (kind, _) in enumerate(lines) if kind == "row"]
    got, firsts = [], []
    for k, table in iter_json_lines(path, block_bytes=block):
        firsts.append(1 + k)
        got += table.to_pylist()
    assert got == [v for kind, v in lines if kind == "row"]
    # each block's first row: one of the rows' lines, in order (blank lines before it skipped)
    assert all(f in row_lines for f in firsts) and firsts == sorted(firsts)
    starts = [row_lines[i] for i in range(len(row_lines)) if row_lines[i] in firsts]
    assert starts == firsts


def test_tables_kept_across_reads_keep_their_values(tmp_path):
    """A consumer that keeps every table (strings, nested chat cells, token-id lists) sees the values of its rows
    after the buffer was reused for later blocks: no table points into the buffer."""
    from packtools.io.json_cells import cells

    chat = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " + "é" * (i % 17)},
                {"role": "assistant", "content": f"a{i}", "n": i},
            ],
            "text": f"row {i} " + "x" * (i % 50),
            "when": f"2020-01-0{i % 9 + 1}",
        }
        for i in range(300)
    ]
    chat.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tables = [t for _, t in iter_json_lines(str(chat), block_bytes=2000)]
    assert len(tables) > 20  # the buffer was reused many times
    assert [m for t in tables for m in cells(t, "messages")] == [r["messages"] for r in rows]
    assert [x for t in tables for x in t.column("text").to_pylist()] == [r["text"] for r in rows]
    ids = tmp_path / "ids.jsonl"
    id_rows = [
        {"input_ids": list(range(i, i + i % 40 + 1)), "labels": [-100] * (i % 40 + 1)} for i in range(300)
    ]
    ids.write_text("".join(json.dumps(r) + "\n" for r in id_rows))
    tables = [t for _, t in iter_json_lines(str(ids), block_bytes=3000)]
    assert len(tables) > 20
    assert [r for t in tables for r in t.to_pylist()] == id_rows


def test_a_line_longer_than_a_block_and_errors_in_later_blocks_name_their_line(tmp_path):
    long = {"text": "y" * 5000}
    rows = [{"text": "a"}, long, {"text": "b"}, long, long, {"text": "c"}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r for _, t in iter_json_lines(str(path), block_bytes=64) for r in t.to_pylist()] == rows
    good = "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(40)) + json.dumps(long) + "\n"
    bad = tmp_path / "bad.jsonl"  # malformed JSON on line 42, past many reuses of the buffer and a long line
    bad.write_text(good + '{"text": "r",}\n{"text": "z"}\n')
    with pytest.raises(PackingError, match=r"bad\.jsonl' line 42 column 14: malformed JSON"):
        list(iter_json_lines(str(bad), block_bytes=50))
    latin = tmp_path / "latin.jsonl"  # not UTF-8 on line 43
    latin.write_bytes(good.encode() + b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(PackingError, match=r"latin\.jsonl' line 43: bytes .* at column 14 are not UTF-8"):
        list(iter_json_lines(str(latin), block_bytes=50))
