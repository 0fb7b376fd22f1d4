"""pack_table / unpack / truncate_table on Arrow tables of every layout."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import packtools
from packtools.core.reference import reference_pack

seqs_st = st.lists(st.lists(st.integers(0, 1000), max_size=30), max_size=40)


def make_table(seqs, large=False, chunks=1, slice_from=0):
    """A table with aligned int32 / int64 / float32 list columns, optionally chunked and sliced."""
    ltype = pa.large_list if large else pa.list_

    def column(dtype, fn):
        data = [[fn(v) for v in s] for s in seqs]
        arr = pa.array(data, type=ltype(dtype))
        if chunks <= 1 or len(data) < 2:
            return pa.chunked_array([arr])
        cuts = np.linspace(0, len(data), chunks + 1).astype(int)
        return pa.chunked_array([arr.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])], type=arr.type)

    table = pa.table(
        {
            "input_ids": column(pa.int32(), int),
            "labels": column(pa.int64(), lambda v: -v),
            "weights": column(pa.float32(), lambda v: v / 2),
        }
    )
    return table.slice(slice_from) if slice_from else table


@pytest.mark.parametrize("layout", ["plain", "large", "chunked", "sliced", "sliced_chunked"])
@given(seqs=seqs_st, max_length=st.integers(1, 20), strategy=st.sampled_from(packtools.core.STRATEGIES))
def test_pack_table_equals_reference(layout, seqs, max_length, strategy):
    skip = 3 if "sliced" in layout else 0
    table = make_table(
        [[7, 7, 7]] * skip + seqs,
        large=layout == "large",
        chunks=3 if "chunked" in layout else 1,
        slice_from=skip,
    )
    out = packtools.pack_table(table, max_length, strategy)
    tokens, seq_lengths = reference_pack(seqs, max_length, strategy)
    d = out.to_pydict()
    assert d["input_ids"] == tokens
    assert d["labels"] == [[-v for v in row] for row in tokens]
    assert d["weights"] == [[v / 2 for v in row] for row in tokens]
    if strategy == "wrapped":
        assert out.column_names == ["input_ids", "labels", "weights"]
    else:
        assert d["seq_lengths"] == seq_lengths
        assert out.schema.field("seq_lengths").type == pa.list_(pa.int32())
    expected_type = pa.large_list if layout == "large" else pa.list_
    assert out.schema.field("input_ids").type == expected_type(pa.int32())
    assert out.schema.field("labels").type == expected_type(pa.int64())


@given(seqs=seqs_st, max_length=st.integers(1, 20), strategy=st.sampled_from(packtools.core.STRATEGIES))
def test_unpack_with_plan_recovers_sequences(seqs, max_length, strategy):
    table = make_table(seqs, chunks=2)
    p = packtools.plan([len(s) for s in seqs], max_length, strategy)
    packed = packtools.pack_table(table, max_length, strategy, plan=p)
    back = packtools.core.unpack(packed, plan=p).to_pydict()
    keep = max_length if strategy == "bfd" else None
    assert back["input_ids"] == [s[:keep] for s in seqs]
    assert back["labels"] == [[-v for v in s[:keep]] for s in seqs]


@given(seqs=seqs_st, max_length=st.integers(1, 20), strategy=st.sampled_from(["bfd", "bfd_split"]))
def test_unpack_without_plan_gives_segments(seqs, max_length, strategy):
    packed = packtools.pack_table(make_table(seqs), max_length, strategy)
    back = packtools.core.unpack(packed).to_pydict()
    flat = [t for row in packed.column("input_ids").to_pylist() for t in row]
    lengths = [n for row in packed.column("seq_lengths").to_pylist() for n in row]
    segments, pos = [], 0
    for n in lengths:
        segments.append(flat[pos : pos + n])
        pos += n
    assert back["input_ids"] == segments
    # Every kept sequence (or chunk) is one of the segments, whole.
    keep = max_length if strategy == "bfd" else None
    if strategy == "bfd":
        assert sorted(map(tuple, back["input_ids"])) == sorted(tuple(s[:keep]) for s in seqs if s)


def test_shuffle_is_deterministic_permutation():
    seqs = [[i] * (i % 7 + 1) for i in range(200)]
    table = make_table(seqs)
    base = packtools.pack_table(table, 16).to_pydict()
    a = packtools.pack_table(table, 16, shuffle=True, seed=1).to_pydict()
    b = packtools.pack_table(table, 16, shuffle=True, seed=1).to_pydict()
    assert a == b
    assert a["input_ids"] != base["input_ids"]
    pairs = lambda d: sorted(zip(map(tuple, d["input_ids"]), map(tuple, d["seq_lengths"])))  # noqa: E731
    assert pairs(a) == pairs(base)


def test_named_columns_leave_others_out():
    table = pa.table({"input_ids": [[1, 2], [3]], "id": ["a", "b"], "labels": [[1, 2], [3]]})
    out = packtools.pack_table(table, 4, columns=["input_ids"])
    assert out.column_names == ["input_ids", "seq_lengths"]
    assert out.to_pydict()["input_ids"] == [[1, 2, 3]]


def test_total_past_int32_switches_to_large_list(monkeypatch):
    # Materializing 2**31 tokens is too big for a unit test: lower the threshold the builder consults.
    import packtools.core.arrow

    monkeypatch.setattr(packtools.core.arrow, "INT32_MAX", 10)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14]]
    out = packtools.pack_table(make_table(seqs), 8)
    assert out.schema.field("input_ids").type == pa.large_list(pa.int32())
    assert out.to_pydict()["input_ids"] == reference_pack(seqs, 8, "bfd")[0]
    small = packtools.pack_table(make_table(seqs[:1]), 8)
    assert small.schema.field("input_ids").type == pa.list_(pa.int32())


# -- errors -------------------------------------------------------------------------------------------


def test_error_non_list_column():
    table = pa.table({"input_ids": [[1, 2], [3]], "source": ["a", "b"]})
    with pytest.raises(packtools.PackingError, match=r"\['source'\] are not list columns.*columns=\["):
        packtools.pack_table(table, 4)
    with pytest.raises(packtools.PackingError, match=r"column 'source' has type string"):
        packtools.pack_table(table, 4, columns=["input_ids", "source"])


def test_error_misaligned_columns():
    table = pa.table({"input_ids": [[1, 2], [3, 4, 5]], "labels": [[1, 2], [3, 4]]})
    with pytest.raises(
        packtools.PackingError, match=r"'input_ids' and 'labels' differ in length at row 1 \(3 vs 2"
    ):
        packtools.pack_table(table, 4)


def test_error_nulls():
    table = pa.table({"input_ids": pa.array([[1], None, [2]], pa.list_(pa.int32()))})
    with pytest.raises(packtools.PackingError, match=r"column 'input_ids' row 1 is null"):
        packtools.pack_table(table, 4)
    table = pa.table({"input_ids": pa.array([[1], [2, 3], [4, None]], pa.list_(pa.int32()))})
    with pytest.raises(packtools.PackingError, match=r"row 2 contains a null value"):
        packtools.pack_table(table, 4)


def test_error_arguments():
    table = pa.table({"input_ids": [[1, 2]]})
    with pytest.raises(packtools.PackingError, match="max_length must be >= 1"):
        packtools.pack_table(table, 0)
    with pytest.raises(packtools.PackingError, match="one of bfd, bfd_split, wrapped"):
        packtools.pack_table(table, 4, "first_fit")
    with pytest.raises(packtools.PackingError, match=r"\['nope'\] are not in the table"):
        packtools.pack_table(table, 4, columns=["nope"])
    with pytest.raises(packtools.PackingError, match="made for other lengths"):
        packtools.pack_table(table, 4, plan=packtools.plan([3], 4))
    with pytest.raises(packtools.PackingError, match="lists of string"):
        packtools.pack_table(pa.table({"x": [["a"]]}), 4)


def test_error_column_named_twice():
    """A column named twice in ``columns=`` was packed twice: pack_table returned a table with two
    'input_ids' columns and pack_dataset failed with Arrow's KeyError; now one PackingError names it."""
    table = pa.table({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3]]})
    with pytest.raises(packtools.PackingError, match=r"names 'input_ids' more than once") as err:
        packtools.pack_table(table, 4, columns=["input_ids", "labels", "input_ids"])
    assert err.value.param == "columns"
    datasets = pytest.importorskip("datasets")
    with pytest.raises(packtools.PackingError, match=r"names 'input_ids' more than once"):
        packtools.pack_dataset(datasets.Dataset(table), 4, columns=["input_ids", "input_ids"])
    from packtools.pipeline.config import PipelineConfig

    with pytest.raises(packtools.PackingError, match=r"names 'labels' more than once"):
        PipelineConfig(max_length=4, columns=("input_ids", "labels", "labels"))
    assert PipelineConfig(max_length=4, columns=("input_ids", "labels")).columns == ("input_ids", "labels")


def test_pipeline_columns_as_one_string_is_one_column(tmp_path):
    """``pack_files(..., columns="input_ids")`` was read letter by letter ("columns=['i', 'n', 'p', ...] are not
    in ..."), while ``pack_table`` takes one name as a string; now both do."""
    import pyarrow.parquet as pq

    from packtools.pipeline.config import PipelineConfig

    assert PipelineConfig(max_length=4, columns="input_ids").columns == ("input_ids",)
    assert PipelineConfig(max_length=4, columns=["input_ids"]).columns == ("input_ids",)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3]]}), src)
    stats = packtools.pack_files(str(src), str(tmp_path / "o"), 4, columns="input_ids").stats
    assert stats["columns"] == ["input_ids"] and stats["columns_left_out"] == ["labels"]


def test_truncate_table():
    table = make_table([[1, 2, 3, 4], [5], []], chunks=2)
    out = packtools.core.truncate_table(table, 2).to_pydict()
    assert out["input_ids"] == [[1, 2], [5], []]
    assert out["labels"] == [[-1, -2], [-5], []]
    out = packtools.core.truncate_table(table, 2, columns=["labels"]).to_pydict()
    assert out["input_ids"] == [[1, 2, 3, 4], [5], []]


def test_unpack_refuses_a_plan_that_did_not_make_the_rows():
    seqs = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    table = make_table(seqs)
    p = packtools.plan([3, 3, 3, 1], 3)
    refused = 0
    for seed in range(6):
        shuffled = p.shuffled(seed)
        packed = packtools.pack_table(table, 3, plan=shuffled)
        assert packtools.core.unpack(packed, plan=shuffled).to_pydict()["input_ids"] == seqs
        # A plan only knows lengths: it is refused when the row or sequence lengths differ.
        if not np.array_equal(shuffled.seg_length, p.seg_length):
            with pytest.raises(packtools.PackingError, match="did not make these rows"):
                packtools.core.unpack(packed, plan=p)
            refused += 1
    assert refused > 0
    t = make_table([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]])
    split = packtools.pack_table(t, 4, "bfd_split")
    with pytest.raises(packtools.PackingError, match="did not make these rows"):
        packtools.core.unpack(split, plan=packtools.plan([5, 2, 3, 1], 4, "bfd"))


def test_unpack_checks_seq_lengths_row_by_row():
    bad = pa.table({"input_ids": [[1, 2], [3]], "seq_lengths": [[1], [1, 1]]})
    with pytest.raises(
        packtools.PackingError, match="row 0: column 'input_ids' holds 2 values but its seq_lengths sum to 1"
    ):
        packtools.core.unpack(bad)


@pytest.mark.parametrize("name", ["ids{x}", "ids{0}", "ids{row}", "ids{}"])
def test_unpack_names_a_column_with_braces_in_its_refusal(name):
    """The column's name is text of the message, never a placeholder of it (check_row_counts fills ``{}``)."""
    bad = pa.table({name: [[1, 2], [3]], "seq_lengths": [[1], [1, 1]]})
    with pytest.raises(packtools.PackingError) as err:
        packtools.core.unpack(bad)
    assert str(err.value).startswith(f"row 0: column {name!r} holds 2 values but its seq_lengths sum to 1;")


def test_pack_table_with_plan_checks_arguments():
    table = pa.table({"input_ids": [[1, 2], [3]]})
    with pytest.raises(packtools.PackingError, match=r"max_length=5 \(not 2\)"):
        packtools.pack_table(table, 2, plan=packtools.plan([2, 1], 5))
    with pytest.raises(packtools.PackingError, match=r"strategy='bfd' \(not 'wrapped'\)"):
        packtools.pack_table(table, 5, "wrapped", plan=packtools.plan([2, 1], 5))
    with pytest.raises(packtools.PackingError, match="shuffle the plan itself"):
        packtools.pack_table(table, 5, plan=packtools.plan([2, 1], 5), shuffle=True)


def test_truncate_refuses_packed_rows():
    packed = packtools.pack_table(pa.table({"input_ids": [[1, 2], [3]]}), 4)
    with pytest.raises(packtools.PackingError, match="Truncate before packing"):
        packtools.core.truncate_table(packed, 1)


def test_float16_is_refused_with_the_fix():
    table = pa.table({"x": pa.array([[1, 2, 3], [4]], pa.list_(pa.float16()))})
    with pytest.raises(packtools.PackingError, match="cast it to float32"):
        packtools.pack_table(table, 3)


def test_huge_max_length():
    p = packtools.plan([1, 2, 0, 3], 2**40)
    assert p.num_rows == 1 and p.seg_length.tolist() == [3, 2, 1] and p.seg_source.tolist() == [3, 1, 0]
    with pytest.raises(packtools.PackingError, match="Use a smaller max_length"):
        packtools.plan([2**28, 2**28], 2**28)


def test_unpack_without_plan_handles_empty_rows():
    table = pa.table({"input_ids": [[1, 2], [], [3]], "seq_lengths": [[2], [], [1]]})
    assert packtools.core.unpack(table).to_pydict() == {"input_ids": [[1, 2], [3]]}
    table = pa.table({"input_ids": [[1, 2], [3], []], "seq_lengths": [[2], [1], []]})
    assert packtools.core.unpack(table).to_pydict() == {"input_ids": [[1, 2], [3]]}


def test_padded_attention_mask_is_refused_with_its_row():
    """An attention_mask with 0s means padded rows: packing them would keep the pads as tokens, silently."""
    t = pa.table(
        {"input_ids": [[1, 2], [3, 4, 5], [6, 0, 0]], "attention_mask": [[1, 1], [1, 1, 1], [1, 0, 0]]}
    )
    with pytest.raises(
        packtools.PackingError, match=r"'attention_mask' has 0s \(first in row 2, position 1\)"
    ):
        packtools.pack_table(t, 4)
    chunked = pa.Table.from_batches(t.to_batches(max_chunksize=1))  # the row is found across chunks
    with pytest.raises(packtools.PackingError, match="first in row 2, position 1"):
        packtools.pack_table(chunked, 4)
    ones = t.slice(0, 2)
    assert packtools.pack_table(ones, 8).to_pydict()["attention_mask"] == [[1, 1, 1, 1, 1]]


def test_pack_table_says_what_its_own_plan_left_out():
    """pack_table with bfd cut sequences longer than max_length and left out rows of no token without a word
    (pack_dataset warns for both); it warns now where it made the plan itself, and not with a caller's plan=."""
    import warnings

    from packtools import pack_table, plan
    from packtools.errors import EmptyRowsWarning, TokensDroppedWarning

    t = pa.table({"input_ids": [list(range(10)), [], [1, 2]]})
    with pytest.warns(
        TokensDroppedWarning, match=r"pack_table: strategy='bfd' at max_length=4 dropped 6 of 12"
    ):
        with pytest.warns(EmptyRowsWarning, match=r"pack_table: 1 of 3 rows hold no token"):
            out = pack_table(t, 4)
    assert out["seq_lengths"].to_pylist() == [[4], [2]]
    with pytest.warns(EmptyRowsWarning):
        pack_table(t, 4, "bfd_split")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_table(t, 4, plan=plan([10, 0, 2], 4))  # the caller has the plan's numbers
        pack_table(pa.table({"input_ids": [[1, 2], [3]]}), 4)
