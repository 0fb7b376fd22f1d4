"""LengthProfile, the tradeoff table and the recommendation against independent NumPy / pure-Python numbers."""

import math
import os
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import packtools
from packtools import PackingError, profile_lengths
from packtools.cli.main import main
from packtools.profiling import LengthProfile
from packtools.profiling.tradeoffs import FIELDS


def lognormal_lengths(rng, n=3000, empty=0.02):
    lens = np.clip(rng.lognormal(4.5, 1.1, n), 1, 20000).astype(np.int64)
    lens[rng.random(n) < empty] = 0
    return lens


def list_table(lengths, dtype=None):
    lengths = np.asarray(lengths, np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    values = np.arange(offsets[-1], dtype=np.int32) % 1000
    dtype = dtype or pa.int32()
    return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, dtype))})


# -- statistics ---------------------------------------------------------------------------------------
def test_statistics_match_numpy(rng):
    lens = lognormal_lengths(rng)
    p = LengthProfile(lens, name="x")
    assert p.count == lens.size
    assert p.total_tokens == int(lens.sum())
    assert p.empty == int((lens == 0).sum()) > 0
    assert (p.min, p.max) == (int(lens.min()), int(lens.max()))
    assert p.mean == pytest.approx(lens.mean(), rel=1e-12)
    np.testing.assert_array_equal(p.lengths, lens)
    assert lens.flags.writeable and not p.lengths.flags.writeable  # the caller's array is not frozen
    for q in (50, 90, 95, 99, 99.9):
        # inverted CDF in exact arithmetic (np.percentile's float rank can be off by one at q * n / 100 = k)
        expected = int(np.sort(lens)[math.ceil(Fraction(str(q)) * lens.size / 100) - 1])
        assert p.percentiles[f"p{q:g}"] == expected == p.percentile(q)
        # the definition: at least q% are <= the value, fewer than q% are below it
        assert (lens <= expected).mean() * 100 >= q - 1e-9
        assert (lens < expected).mean() * 100 < q


def test_histogram_is_log_spaced_and_counts_nonempty(rng):
    lens = lognormal_lengths(rng)
    p = LengthProfile(lens)
    edges = p.hist_edges
    assert edges[0] == 1 and edges[-1] == lens.max() + 1
    assert np.all(np.diff(edges) > 0) and edges.dtype.kind == "i"
    ratios = edges[1:] / edges[:-1]
    assert ratios[edges[:-1] >= 20].max() < 1.4  # evenly spaced on a log axis once bins are wider than 1
    counts, _ = np.histogram(lens[lens > 0], bins=edges)
    np.testing.assert_array_equal(p.hist_counts, counts)
    assert p.hist_counts.sum() == p.count - p.empty


def test_huge_lengths_use_the_sorting_path():
    lens = np.array([3, 2**40, 7, 0, 7])
    p = LengthProfile(lens)
    assert p.total_tokens == int(lens.sum()) and p.max == 2**40 and p.percentiles["p50"] == 7
    assert p.tokens_kept(5) == 3 + 5 + 0 + 5 + 5
    assert p.hist_counts.sum() == 4


def test_empty_profile():
    p = LengthProfile(np.zeros(0, np.int64))
    assert (p.count, p.total_tokens, p.max, p.mean) == (0, 0, 0, 0.0)
    assert p.recommend().max_length == 64
    assert p.tokens_kept_share(10) == 1.0


def test_bad_lengths_are_refused():
    with pytest.raises(PackingError, match="negative"):
        LengthProfile([3, -1])
    with pytest.raises(PackingError, match="integers"):
        LengthProfile([1.5, 2.0])
    with pytest.raises(PackingError, match="percentile"):
        LengthProfile([1, 2]).percentile(0)


# -- tradeoffs ----------------------------------------------------------------------------------------
def padded_reference(lens, m, bs):
    """Pure Python: batches in dataset order, each padded to its longest cut sequence."""
    real = padded = 0
    squares = 0
    batches = 0
    for i in range(0, len(lens), bs):
        cut = [min(int(x), m) for x in lens[i : i + bs]]
        batches += 1
        real += sum(cut)
        padded += len(cut) * max(cut)
        squares += len(cut) * max(cut) ** 2
    return batches, (1 - real / padded if padded else 0.0), squares


def check_row(row, lens, m, bs):
    lens = np.asarray(lens, np.int64)
    n, total = lens.size, int(lens.sum())
    cut = np.minimum(lens, m)
    base = sum(int(x) ** 2 for x in lens) or 1
    assert row.max_length == m
    assert row.truncated == pytest.approx((lens > m).mean() if n else 0.0)
    assert row.dropped == pytest.approx(np.maximum(lens - m, 0).sum() / total if total else 0.0)
    assert row.kept == pytest.approx(1 - row.dropped)
    # rows: the planner's own numbers, and independent bounds / closed forms
    for strategy in ("bfd", "bfd_split", "wrapped"):
        assert getattr(row, f"{strategy}_rows") == packtools.plan(lens, m, strategy).num_rows
    kept = int(cut.sum())
    assert row.bfd_rows >= -(-kept // m)
    assert row.bfd_split_rows >= -(-total // m)
    assert row.wrapped_rows == -(-total // m)
    if row.bfd_rows:
        assert row.bfd_fill == pytest.approx(kept / (row.bfd_rows * m))
        assert row.bfd_split_fill == pytest.approx(total / (row.bfd_split_rows * m))
        assert row.wrapped_fill == pytest.approx(total / (row.wrapped_rows * m))
    batches, padding, padded_sq = padded_reference(lens, m, bs)
    assert row.padded_batches == batches
    assert row.padding == pytest.approx(padding, abs=1e-12)
    # attention: sum of squared block lengths relative to sum(l**2)
    bfd_sq = sum(min(int(x), m) ** 2 for x in lens)
    split_sq = sum((int(x) // m) * m * m + (int(x) % m) ** 2 for x in lens)
    wrapped_sq = (total // m) * m * m + (total % m) ** 2
    assert row.attn_bfd == pytest.approx(bfd_sq / base, rel=1e-12)
    assert row.attn_bfd_split == pytest.approx(split_sq / base, rel=1e-12)
    assert row.attn_wrapped == pytest.approx(wrapped_sq / base, rel=1e-12)
    assert row.attn_padded == pytest.approx(padded_sq / base, rel=1e-12)


def test_tradeoffs_match_numpy_and_planner(rng):
    lens = lognormal_lengths(rng)
    p = LengthProfile(lens)
    table = p.tradeoffs([1000, 64, 16, 100, 64], batch_size=8)
    assert [r.max_length for r in table] == [16, 64, 100, 1000]  # sorted, deduplicated
    for row in table:
        check_row(row, lens, row.max_length, 8)
    assert table[-1].attn_bfd <= 1.0


@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=40),
    st.integers(1, 60),
    st.integers(1, 9),
)
def test_tradeoffs_match_reference_on_random_inputs(lens, m, bs):
    row = LengthProfile(np.array(lens, np.int64)).tradeoffs([m], batch_size=bs)[0]
    check_row(row, lens, m, bs)


def test_padding_depends_on_dataset_order():
    lens = [1, 100, 1, 100]
    assert LengthProfile(lens).tradeoffs([128], batch_size=2)[0].padding == pytest.approx(1 - 202 / 400)
    assert LengthProfile([1, 1, 100, 100]).tradeoffs([128], batch_size=2)[0].padding == 0.0
    assert LengthProfile([1, 1, 100, 100]).tradeoffs([64], batch_size=3)[0].padding == pytest.approx(
        1 - 130 / (3 * 64 + 64)
    )


def test_tradeoff_table_renderings(rng):
    p = LengthProfile(lognormal_lengths(rng), name="ds")
    table = p.tradeoffs([128, 4096], batch_size=4)
    dicts = table.to_dicts()
    assert [tuple(d) for d in dicts] == [FIELDS] * 2
    assert dicts[0]["bfd_rows"] == table[0].bfd_rows and len(table) == 2
    text = table.to_text()
    lines = text.splitlines()
    assert "padded, batch 4" in lines[0] and "attention cost" in lines[0]
    assert len(lines) == 5 and f"{table[0].bfd_rows:,}" in lines[3] and "4,096" in lines[4]
    md = table.to_markdown().splitlines()
    assert md[0].startswith("| max_length |") and "bfd rows" in md[0] and len(md) == 4
    assert all(line.count("|") == md[0].count("|") for line in md)
    html = table.to_html()
    assert html.count("<tr>") == 4 and f"{100 * table[1].bfd_fill:.2f}%" in html


def test_default_candidates_cover_the_longest(rng):
    p = LengthProfile(lognormal_lengths(rng))
    cands = p.default_candidates()
    assert cands == sorted(cands) and all(c & (c - 1) == 0 for c in cands)
    assert cands[-1] >= p.max and cands[-2] < p.max
    assert cands[0] <= max(64, p.percentiles["p50"])
    assert len(p.tradeoffs()) == len(cands)


def test_tradeoff_arguments_are_checked():
    p = LengthProfile([1, 2])
    with pytest.raises(PackingError, match="candidates"):
        p.tradeoffs([0])
    with pytest.raises(PackingError, match="empty"):
        p.tradeoffs([])
    with pytest.raises(PackingError, match="batch_size"):
        p.tradeoffs([4], batch_size=0)


# -- recommend ---------------------------------------------------------------------------------------
def brute_recommend(lens, keep, multiple):
    total = int(np.sum(lens))
    need = math.ceil(Fraction(str(keep)) * total)
    m = multiple
    while int(np.minimum(lens, m).sum()) < need:
        m += multiple
    return m


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99, 0.999, 1.0])
@pytest.mark.parametrize("multiple", [1, 64, 100])
def test_recommend_is_the_smallest_multiple_that_keeps_enough(rng, keep, multiple):
    lens = lognormal_lengths(rng, n=2000)
    rec = LengthProfile(lens).recommend(keep_tokens=keep, multiple_of=multiple)
    expected = brute_recommend(lens, keep, multiple)
    assert rec.max_length == expected and rec.max_length % multiple == 0
    kept = np.minimum(lens, expected).sum() / lens.sum()
    assert rec.tokens_kept_share == pytest.approx(kept) and kept >= keep - 1e-12
    assert rec.truncated_share == pytest.approx((lens > expected).mean())
    assert f"max_length={expected} " in rec.reason and str(rec) == rec.reason
    if expected > multiple:
        assert f" {expected - multiple} would keep" in rec.reason


def test_recommend_words():
    short = LengthProfile([10, 20, 30]).recommend()
    assert short.max_length == 64 and "bfd and bfd_split are identical" in short.reason
    long = LengthProfile([100] * 98 + [1000, 3000]).recommend(keep_tokens=0.9)
    assert long.max_length == 1664 and "bfd_split" in long.reason and "3,000 tokens" in long.reason
    assert LengthProfile([100] * 98 + [1000, 3000]).recommend(keep_tokens=1.0).max_length == 3008


@pytest.mark.parametrize(
    "kwargs", [{"keep_tokens": 0}, {"keep_tokens": 1.5}, {"multiple_of": 0}, {"multiple_of": 2.5}]
)
def test_recommend_arguments_are_checked(kwargs):
    with pytest.raises(PackingError):
        LengthProfile([1, 2]).recommend(**kwargs)


# -- sources ------------------------------------------------------------------------------------------
def test_sources_arrays_and_arrow(rng):
    lens = lognormal_lengths(rng, n=500)
    table = list_table(lens)
    expected = lens.tolist()
    assert profile_lengths(lens).lengths.tolist() == expected
    assert profile_lengths(expected).lengths.tolist() == expected
    assert profile_lengths(pa.array(lens)).lengths.tolist() == expected
    assert profile_lengths(table).lengths.tolist() == expected
    col = table.column("input_ids")
    assert profile_lengths(col).lengths.tolist() == expected
    assert profile_lengths(col.chunk(0)).lengths.tolist() == expected
    chunked = pa.chunked_array([col.chunk(0).slice(0, 200), col.chunk(0).slice(200)])
    assert profile_lengths(chunked).lengths.tolist() == expected
    sliced = col.chunk(0).slice(123, 77)  # non-zero array offset
    assert profile_lengths(sliced).lengths.tolist() == expected[123:200]
    large = col.cast(pa.large_list(pa.int64()))
    assert profile_lengths(large).lengths.tolist() == expected
    batch = table.to_batches()[0]
    assert profile_lengths(batch).lengths.tolist() == expected


def test_null_rows_count_as_empty():
    arr = pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))
    p = profile_lengths(arr)
    assert p.lengths.tolist() == [2, 0, 1] and p.empty == 1


def test_source_errors():
    table = pa.table({"input_ids": [[1]], "text": ["a"]})
    with pytest.raises(PackingError, match="no column 'labels'.*input_ids"):
        profile_lengths(table, column="labels")
    with pytest.raises(PackingError, match="not a list"):
        profile_lengths(table, column="text")
    with pytest.raises(PackingError, match="cannot profile a dict"):
        profile_lengths({"a": 1})
    with pytest.raises(PackingError, match="list column"):
        profile_lengths(pa.array(["a"]))


def test_files_parquet_arrow_and_directories(tmp_path, rng, monkeypatch):
    lens = lognormal_lengths(rng, n=4000)
    table = list_table(lens).append_column("other", pa.array(np.arange(lens.size)))
    pq.write_table(table.slice(0, 2500), tmp_path / "a.parquet", row_group_size=700)
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table.slice(2500, 1000), max_chunksize=300)
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.slice(3500))  # the datasets cache format: an IPC stream
    import packtools.profiling.profile as prof

    monkeypatch.setattr(prof, "BATCH_TOKENS", 5000)  # many small parquet batches
    p = profile_lengths(tmp_path / "a.parquet")
    assert p.lengths.tolist() == lens[:2500].tolist() and p.name == "a.parquet"
    assert profile_lengths(str(tmp_path / "b.arrow")).lengths.tolist() == lens[2500:3500].tolist()
    assert profile_lengths(str(tmp_path / "c.arrow")).lengths.tolist() == lens[3500:].tolist()
    both = profile_lengths([tmp_path / "a.parquet", tmp_path / "b.arrow"], name="ab")
    assert both.lengths.tolist() == lens[:3500].tolist() and both.name == "ab"
    whole = profile_lengths(tmp_path)
    assert whole.lengths.tolist() == lens.tolist() and whole.name == "3 files"
    with pytest.raises(FileNotFoundError):
        profile_lengths(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(PackingError, match="unknown file type"):
        profile_lengths(tmp_path / "x.csv")
    with pytest.raises(PackingError, match="no column 'labels'"):
        profile_lengths(tmp_path / "a.parquet", column="labels")
    with pytest.raises(PackingError, match="not a list"):
        profile_lengths(tmp_path / "b.arrow", column="other")


def test_datasets_dataset_in_dataset_order(rng):
    datasets = pytest.importorskip("datasets")
    lens = lognormal_lengths(rng, n=300)
    ds = datasets.Dataset(list_table(lens))
    assert profile_lengths(ds).lengths.tolist() == lens.tolist()
    shuffled = ds.shuffle(seed=3).select(range(100))
    expected = [len(x) for x in shuffled["input_ids"]]
    assert profile_lengths(shuffled).lengths.tolist() == expected
    with pytest.raises(PackingError, match="one split"):
        profile_lengths(datasets.DatasetDict({"train": ds}))
    with pytest.raises(PackingError, match="IterableDataset"):
        profile_lengths(ds.to_iterable_dataset())


def test_import_stays_light():
    import subprocess
    import sys

    code = "import sys, packtools.profiling.profile; print(sorted(m for m in ('matplotlib', 'datasets', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- CLI, text only (plots and HTML: tests/test_plot.py) --------------------------------------------
def test_cli_profile_file(tmp_path, rng, capsys):
    lens = lognormal_lengths(rng, n=1000)
    pq.write_table(list_table(lens), tmp_path / "d.parquet")
    assert (
        main(["profile", str(tmp_path / "d.parquet"), "--candidates", "128,1024", "--max-length", "300"]) == 0
    )
    out = capsys.readouterr().out
    p = LengthProfile(lens)
    assert f"d.parquet: {lens.size:,} sequences, {int(lens.sum()):,} tokens" in out
    assert f"p99={p.percentiles['p99']:,}" in out
    table = p.tradeoffs([128, 300, 1024])
    assert table.to_text() in out  # the chosen max_length joins the candidates
    assert p.recommend().reason in out


def test_cli_profile_keep_sequences(tmp_path, capsys):
    """--keep-sequences: the bfd_split rule, where one huge sequence would make the token rule useless."""
    lengths = [50] * 95 + [200] * 4 + [100_000]
    pq.write_table(list_table(lengths), tmp_path / "d.parquet")
    assert main(["profile", str(tmp_path / "d.parquet"), "--keep-sequences", "0.99"]) == 0
    out = capsys.readouterr().out
    rec = LengthProfile(lengths).recommend(keep_sequences=0.99)
    assert rec.max_length == 256 and f"recommended: {rec.reason}" in out
    with pytest.raises(SystemExit):  # one rule at a time
        main(["profile", str(tmp_path / "d.parquet"), "--keep-sequences", "0.99", "--keep-tokens", "0.9"])
    assert main(["profile", str(tmp_path / "d.parquet"), "--keep-sequences", "1.5"]) == 1
    err = capsys.readouterr().err
    assert "--keep-sequences 1.5" in err and "keep_sequences=" not in err


def test_cli_profile_errors(tmp_path, capsys):
    assert main(["profile", str(tmp_path / "nope.parquet")]) == 1
    assert "does not exist" in capsys.readouterr().err
    pq.write_table(list_table([1, 2]), tmp_path / "d.parquet")
    assert main(["profile", str(tmp_path / "d.parquet"), "--column", "labels"]) == 1
    assert "no column 'labels'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--candidates", "12,x"])


def test_a_save_to_disk_folder_is_read_through_its_state_json(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = pa.table({"input_ids": pa.array([[1] * n for n in range(1, 31)], pa.list_(pa.int32()))})
    folder = str(tmp_path / "saved")
    datasets.Dataset(table).save_to_disk(folder, num_shards=2)
    stray = os.path.join(folder, "cache-0123456789abcdef.arrow")  # what a .map() leaves next to the data
    with pa.OSFile(stray, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    assert profile_lengths(folder).lengths.tolist() == list(range(1, 31))
    assert main(["profile", folder]) == 0


def test_recommend_keep_sequences_holds_that_share_whole():
    # one huge sequence holds most tokens: the token rule needs it, the sequence rule does not
    lengths = [50] * 95 + [200] * 4 + [100_000]
    p = LengthProfile(lengths)
    assert p.recommend(keep_tokens=0.99).max_length >= 90_000
    rec = p.recommend(keep_sequences=0.99, multiple_of=64)
    assert rec.max_length == 256 and rec.keep_sequences == 0.99 and rec.keep_tokens is None
    assert rec.truncated_share == 0.01 and "bfd_split cuts the other 1" in rec.reason
    assert p.recommend(keep_sequences=1.0, multiple_of=64).max_length == 100_032
    assert p.recommend(keep_sequences=0.95, multiple_of=1).max_length == 50
    with pytest.raises(PackingError, match="keep_sequences=1.5") as err:
        p.recommend(keep_sequences=1.5)
    assert err.value.param == "keep_sequences"


def test_shared_prompt_savings_counts_tokens_of_both_layouts_and_refuses_an_empty_group():
    """Pairs: ``2P + C + R`` unshared, ``P + C + R + 1`` shared; groups: ``G*P + sum(C)`` against
    ``P + sum(C) + G - 1``; a group with no completion is refused by row as pack_groups refuses it (it was
    counted as a unit of ``P - 1`` tokens, more shared than unshared)."""
    from packtools.profiling.shared import shared_prompt_savings

    pairs = pa.table(
        {"prompt_ids": [[1] * 10, [1] * 3], "chosen_ids": [[2] * 3, [2]], "rejected_ids": [[3] * 2, [3] * 4]}
    )
    s = shared_prompt_savings(pairs)
    assert (s.units, s.completions) == (2, 4)
    assert (s.tokens_unshared, s.tokens_shared) == (25 + 11, 16 + 9)
    groups = pa.table({"prompt_ids": [[1] * 4, [1] * 5], "completion_ids": [[[2, 2], [3]], [[4], [5], [6]]]})
    s = shared_prompt_savings(groups)
    assert (s.units, s.completions, s.tokens_unshared, s.tokens_shared) == (2, 5, 11 + 18, 8 + 10)
    assert s.saved == pytest.approx(1 - 18 / 29)
    empty = pa.table({"prompt_ids": [[1] * 4, [1] * 5], "completion_ids": [[[2, 2], [3]], []]})
    with pytest.raises(PackingError, match="row 1: completion_ids holds no completion"):
        shared_prompt_savings(empty)


def test_sequence_rule_does_not_count_empty_sequences():
    """Empty rows are dropped by pack (nothing to pack): counted as sequences that fit, they made up the
    share, so with half the rows empty "99% whole" held 99.5% of the rows and 99% of the real sequences not."""
    lengths = [0] * 50 + [10] * 49 + [1000]
    rec = LengthProfile(lengths).recommend()
    assert rec.max_length == 1024 and rec.truncated_share == 0
    assert "50 empty sequences are not counted" in rec.reason
    assert LengthProfile([10] * 99 + [1000]).recommend().max_length == 64  # no empty rows: 99 of 100
