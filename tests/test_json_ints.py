"""Tokenized JSON lines read by the Numba scan (packtools.io.json_ints) give exactly Arrow's table, and every
block outside the scan's strict shape is left to Arrow (its types, its errors)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtools.errors import PackingError
from packtools.io.json import iter_json_lines
from packtools.io.json_ints import int_list_keys, read_int_lists


def arrow(data: bytes) -> pa.Table:
    options = pj.ReadOptions(block_size=len(data) + 1, use_threads=False)
    return pj.read_json(pa.BufferReader(data), read_options=options)


ints = st.integers(-(10**18) + 1, 10**18 - 1)
rows = st.lists(
    st.tuples(st.lists(ints, min_size=0, max_size=8), st.lists(ints, min_size=0, max_size=8)),
    min_size=1,
    max_size=30,
)
spaces = st.sampled_from(["", " ", "  ", "\t", " \t "])


@settings(max_examples=150, deadline=None)
@given(rows, spaces, spaces, st.booleans())
def test_the_scan_reads_what_arrow_reads(lines, sep, pad, final_newline):
    text = "\n".join(
        f'{pad}{{"input_ids":{sep}[{sep}{f"{sep},{sep}".join(map(str, a))}{sep}],{sep}"labels"{sep}:{sep}'
        f"[{', '.join(map(str, b))}]{sep}}}{pad}"
        for a, b in lines
    ) + ("\n" if final_newline else "")
    data = text.encode()
    got = read_int_lists(data, ["input_ids", "labels"])
    counts = [sum(len(r[i]) for r in lines) for i in (0, 1)]
    if not all(
        counts
    ):  # a column without a single value: Arrow types it list<null>, so Arrow reads the block
        assert got is None
        return
    assert got is not None
    assert got.equals(arrow(data)), (got, arrow(data))


@pytest.mark.parametrize(
    "line",
    [
        b'{"input_ids": [1, 2.5]}',  # a float
        b'{"input_ids": [1, 2e3]}',
        b'{"input_ids": [01]}',  # a leading zero (not JSON)
        b'{"input_ids": [1, null]}',
        b'{"input_ids": null}',
        b'{"input_ids": [1], "other": [2]}',  # a key the first line lacks
        b'{"labels": [1]}',  # another key
        b'{"input_ids": ["1"]}',
        b'{"input_ids": [1234567890123456789]}',  # 19 digits: Arrow decides
        b'{"input_ids": [1,]}',
        b'{"input_ids": [-]}',
        b'{"input_ids": [1]} x',
        b'{"input_ids": [1]',
        b"",  # a blank line
        '{"input_ids": [1], "é": [2]}'.encode(),
        b'{"input_ids" : [1], "input_ids": [2]}',
    ],
)
def test_any_other_shape_is_left_to_arrow(line):
    data = b'{"input_ids": [5, 6]}\n' + line + b'\n{"input_ids": [7]}\n'
    assert read_int_lists(data, ["input_ids"]) is None


def test_keys_are_taken_only_from_a_line_of_integer_lists():
    assert int_list_keys(b'\n  {"input_ids": [1], "labels": [-100]}\n') == ["input_ids", "labels"]
    assert int_list_keys(b'{"text": "a"}\n') is None
    assert int_list_keys(b'{"input_ids": [1, true]}\n') is None  # bools are not token ids
    assert int_list_keys(b'{"input_ids": [1.0]}\n') is None
    assert int_list_keys(b'{"prompt": [1]}\n') is None  # chat columns keep their own reading
    assert int_list_keys(b'{"a\\"b": [1]}\n') is None
    assert int_list_keys(b"[1, 2]\n") is None


def test_iter_json_lines_mixes_scanned_and_arrow_blocks_with_the_right_line_numbers(tmp_path):
    rng = np.random.default_rng(0)
    lines = [
        json.dumps({"input_ids": rng.integers(0, 1000, rng.integers(1, 20)).tolist()}) for _ in range(300)
    ]
    lines[150] = json.dumps({"input_ids": [1.0, 2.0]})  # a float block: Arrow (and it types it double)
    path = os.path.join(tmp_path, "t.jsonl")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    blocks = list(iter_json_lines(path, block_bytes=2000))
    assert sum(t.num_rows for _, t in blocks) == 300
    got = [row for _, t in blocks for row in t.column("input_ids").to_pylist()]
    assert got == [json.loads(ln)["input_ids"] for ln in lines]
    starts = np.cumsum([0] + [t.num_rows for _, t in blocks[:-1]])
    assert [k for k, _ in blocks] == starts.tolist()  # no blank lines: block k = its first row
    types = {str(t.column("input_ids").type) for _, t in blocks}
    assert types == {"list<item: int64>", "list<item: double>"}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 999), max_size=6), st.sampled_from(["", " ", "\t\r"])),
        min_size=1,
        max_size=40,
    ),
    st.integers(8, 120),
    st.integers(1, 400),
    st.sets(st.integers(0, 39), max_size=3),
)
def test_scanned_blocks_in_byte_ranges_read_every_row_once_on_its_line(
    tmp_path_factory, rows, block, part, blank
):
    from packtools.io.json import LineBase, line_ranges

    path = str(tmp_path_factory.mktemp("t") / "t.jsonl")
    lines, want = [], []
    for i, (ids, pad) in enumerate(rows):
        if i in blank:  # a blank line: its block goes to Arrow, and lines are no longer rows
            lines.append(pad)
        lines.append(json.dumps({"input_ids": ids}) + pad)
        want.append((len(lines), ids))
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    got = []
    for start, stop in line_ranges(path, part):
        base = LineBase(path, start).value
        for k, table in iter_json_lines(path, start, stop, block_bytes=block):
            if table.num_rows:
                assert base + k <= want[len(got)][0]  # the block starts at or before its first row's line
                if not any(not ln.strip() for ln in lines):
                    assert base + k == want[len(got)][0]
            got += table.column("input_ids").to_pylist()
    assert got == [ids for _, ids in want]


def test_a_malformed_line_after_scanned_blocks_is_still_named(tmp_path):
    path = os.path.join(tmp_path, "t.jsonl")
    with open(path, "w") as fh:
        fh.write("".join(json.dumps({"input_ids": [i, i + 1]}) + "\n" for i in range(200)))
        fh.write('{"input_ids": [1, 2,]}\n')
    with pytest.raises(PackingError, match="line 201"):
        list(iter_json_lines(path, block_bytes=1000))


def test_packing_scanned_json_lines_equals_packing_the_same_rows_from_parquet(tmp_path):
    import pyarrow.parquet as pq

    from packtools.pipeline.run import pack_files

    rng = np.random.default_rng(1)
    rows = [rng.integers(-100, 50_000, rng.integers(1, 40)).tolist() for _ in range(500)]
    # negative ids are refused; the labels keep the scan's negatives
    ids = [[abs(v) for v in r] for r in rows]
    src = os.path.join(tmp_path, "t.jsonl")
    with open(src, "w") as fh:
        fh.write("".join(json.dumps({"input_ids": i, "labels": r}) + "\n" for i, r in zip(ids, rows)))
    pq.write_table(pa.table({"input_ids": ids, "labels": rows}).cast(
        pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    ), os.path.join(tmp_path, "t.parquet"))  # fmt: skip
    got = pack_files(src, os.path.join(tmp_path, "a"), max_length=64)
    want = pack_files(os.path.join(tmp_path, "t.parquet"), os.path.join(tmp_path, "b"), max_length=64)
    assert got.stats["rows_out"] == want.stats["rows_out"]
    assert got.stats["tokens_in"] == want.stats["tokens_in"] == sum(map(len, rows))

    def shards(folder):
        names = sorted(f for f in os.listdir(folder) if f.endswith(".arrow"))
        tables = [pa.ipc.open_stream(os.path.join(folder, n)).read_all() for n in names]
        return pa.concat_tables(tables).to_pydict()

    assert shards(got.out) == shards(want.out)
    # the run reports where its time went, phase by phase (busy seconds, never negative)
    assert set(got.timings["stage_phases_s"]) == {"read", "encode", "write", "flush"}
    assert set(got.timings["write_phases_s"]) == {"gather", "write", "flush"}
    assert min(got.timings["stage_phases_s"].values()) >= 0.0


def test_the_scan_does_not_import_pandas():
    """pyarrow's conversion of NumPy arrays imports pandas (0.25 CPU seconds of a run); the scan's table is built
    without it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from packtools.io.json_ints import read_int_lists\n"
        "t = read_int_lists(b'{\"input_ids\": [1, 2]}\\n{\"input_ids\": [3]}\\n', ['input_ids'])\n"
        "assert t.column('input_ids').to_pylist() == [[1, 2], [3]], t\n"
        "print('pandas' in sys.modules)\n"
        "import numpy as np, pyarrow as pa\n"
        "pa.array(np.arange(3))\n"  # the control: pyarrow's own NumPy conversion does import it
        "print('pandas' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "True"], done.stderr
