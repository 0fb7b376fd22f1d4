"""The planner against the pure-Python reference, and the plan's invariants.

This module also runs under NUMBA_DISABLE_JIT=1 (see test_nojit.py), which checks the kernels' Python semantics.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packtools
from packtools.core.reference import reference_rows

lengths_st = st.lists(st.integers(0, 40), min_size=0, max_size=60)
max_length_st = st.integers(1, 24)
strategy_st = st.sampled_from(packtools.core.STRATEGIES)


def plan_rows(p):
    return [
        [(int(p.seg_source[s]), int(p.seg_start[s]), int(p.seg_length[s])) for s in range(a, b)]
        for a, b in zip(p.row_offsets[:-1], p.row_offsets[1:])
    ]


@given(lengths_st, max_length_st, strategy_st)
def test_plan_equals_reference(lengths, max_length, strategy):
    p = packtools.plan(np.array(lengths, dtype=np.int64), max_length, strategy)
    assert plan_rows(p) == reference_rows(lengths, max_length, strategy)


@given(lengths_st, max_length_st, strategy_st)
def test_plan_invariants(lengths, max_length, strategy):
    lens = np.array(lengths, dtype=np.int64)
    p = packtools.plan(lens, max_length, strategy)
    assert (p.row_lengths <= max_length).all()
    assert (p.row_lengths > 0).all()
    assert (p.seg_length > 0).all()
    assert p.num_empty == int((lens == 0).sum())
    assert p.num_rows >= p.lower_bound
    assert p.row_lengths.sum() == p.tokens_kept
    # Which tokens are kept, per sequence, as covered intervals.
    kept = {}
    for src, start, n in zip(p.seg_source, p.seg_start, p.seg_length):
        kept.setdefault(int(src), []).append((int(start), int(n)))
    for src, length in enumerate(lengths):
        pieces = sorted(kept.get(src, []))
        expected_end = length if strategy != "bfd" else min(length, max_length)
        pos = 0
        for start, n in pieces:
            assert start == pos  # contiguous, no overlap, nothing skipped
            pos += n
        assert pos == expected_end
    if strategy == "wrapped":
        assert (p.row_lengths[:-1] == max_length).all()
        # Stream order: sources never go backwards.
        assert (np.diff(p.seg_source) >= 0).all()
    else:
        # Each row holds segments in placement order: non-increasing lengths.
        for a, b in zip(p.row_offsets[:-1], p.row_offsets[1:]):
            assert (np.diff(p.seg_length[a:b]) <= 0).all()


@given(lengths_st, max_length_st)
def test_bfd_and_bfd_split_identical_when_all_fit(lengths, max_length):
    lens = np.minimum(np.array(lengths, dtype=np.int64), max_length)
    a = packtools.plan(lens, max_length, "bfd")
    b = packtools.plan(lens, max_length, "bfd_split")
    assert plan_rows(a) == plan_rows(b)


def test_edge_cases():
    p = packtools.plan(np.array([0, 0, 0]), 4)
    assert (p.num_rows, p.num_empty, p.tokens_kept, p.fill) == (0, 3, 0, 1.0)
    p = packtools.plan(np.array([], dtype=np.int64), 4, "wrapped")
    assert p.num_rows == 0
    p = packtools.plan([1], 1)
    assert plan_rows(p) == [[(0, 0, 1)]]
    p = packtools.plan([4, 4], 4)
    assert plan_rows(p) == [[(0, 0, 4)], [(1, 0, 4)]]
    p = packtools.plan([3, 2, 1], 1, "bfd")
    assert p.num_rows == 3 and p.tokens_dropped == 3
    p = packtools.plan([3, 2, 1], 1, "bfd_split")
    assert p.num_rows == 6 and p.tokens_dropped == 0
    p = packtools.plan([3, 2, 1], 100)
    assert plan_rows(p) == [[(0, 0, 3), (1, 0, 2), (2, 0, 1)]]


def test_best_fit_prefers_smallest_space_then_oldest():
    # Bins after 7, 6, 6: spaces 3, 4, 4 (bins 1 and 2 reached 4 in that order).
    # A 4 goes to bin 1 (space 4, reached first) rather than bin 0 (space 3, too small) or bin 2.
    p = packtools.plan([7, 6, 6, 4, 3], 10)
    assert plan_rows(p) == [[(0, 0, 7), (4, 0, 3)], [(1, 0, 6), (3, 0, 4)], [(2, 0, 6)]]


def test_lower_bound_and_fill_numbers():
    p = packtools.plan([5, 2, 3, 1], 4)
    assert p.tokens_in == 11 and p.tokens_kept == 10 and p.lower_bound == 3
    assert p.fill == pytest.approx(10 / 12)
    assert p.summary()["rows_over_bound"] == 0


def test_shuffled_keeps_rows(rng):
    lens = rng.integers(0, 50, 300)
    p = packtools.plan(lens, 64)
    q = p.shuffled(seed=3)
    assert sorted(map(tuple, map(tuple, plan_rows(p)))) == sorted(map(tuple, map(tuple, plan_rows(q))))
    assert plan_rows(q) != plan_rows(p)
    assert plan_rows(p.shuffled(seed=3)) == plan_rows(q)


def test_save_load_roundtrip(tmp_path, rng):
    p = packtools.plan(rng.integers(0, 50, 100), 64, "bfd_split")
    path = tmp_path / "plan.npz"
    p.save(path)
    q = packtools.PackPlan.load(path)
    assert plan_rows(q) == plan_rows(p)
    assert (q.max_length, q.strategy, q.num_sequences) == (64, "bfd_split", 100)
    assert [f.name for f in tmp_path.iterdir()] == ["plan.npz"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_length": 0}, "max_length must be >= 1"),
        ({"max_length": 2.5}, "max_length must be a positive int"),
        ({"strategy": "best"}, "bfd, bfd_split, wrapped"),
    ],
)
def test_plan_argument_errors(kwargs, match):
    args = {"lengths": [1, 2], "max_length": 4, "strategy": "bfd"} | kwargs
    with pytest.raises(packtools.PackingError, match=match):
        packtools.plan(**args)


def test_plan_rejects_bad_lengths():
    with pytest.raises(packtools.PackingError, match=r"lengths\[1\] = -2"):
        packtools.plan([3, -2], 4)
    with pytest.raises(packtools.PackingError, match="1-D"):
        packtools.plan([[1, 2]], 4)
    with pytest.raises(packtools.PackingError, match="integers"):
        packtools.plan([1.5], 4)


def test_gather_scattered_copies_like_slices():
    from packtools.core import kernels as k

    rng = np.random.default_rng(0)
    values = rng.integers(-5, 5, 5000).astype(np.int32)
    size = rng.integers(1, 3000, 12)
    start = np.array([rng.integers(0, 5000 - m + 1) for m in size], np.int64)
    dest = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    out = np.empty(int(size.sum()), np.int64)
    k.gather_scattered(values, start, size.astype(np.int64), dest, out)
    np.testing.assert_array_equal(out, np.concatenate([values[a : a + m] for a, m in zip(start, size)]))


def test_view_segments_finds_every_segment_in_its_source():
    from packtools.core import kernels as k

    p = packtools.plan([5, 2, 3, 1, 6], 4, "bfd_split")
    indices = np.array([4, 3, 2, 1, 0], np.int64)  # source sequence s is table row 4 - s
    row_begin = np.array([0, 6, 0, 1, 0], np.int64)  # rows 0-1 in chunk 0, rows 2-4 in chunk 1
    chunk_starts = np.array([0, 2, 5], np.int64)
    chunk_base = np.array([100, 7], np.int64)
    chunk_source = np.array([1, 0], np.int64)
    rows = np.array([2, 0], np.int64)
    begin, size, dest, bounds, seg_lengths = k.view_segments(
        rows, p.row_offsets, p.seg_source, p.seg_start, p.seg_length, True, indices, row_begin, chunk_starts,
        chunk_base, chunk_source, 2,
    )  # fmt: skip
    expected = []  # (source, begin, size, dest) by hand from the definitions
    at = 0
    for r in rows:
        for s in range(p.row_offsets[r], p.row_offsets[r + 1]):
            t = indices[p.seg_source[s]]
            c = 0 if t < 2 else 1
            expected.append(
                (chunk_source[c], chunk_base[c] + row_begin[t] + p.seg_start[s], p.seg_length[s], at)
            )
            at += p.seg_length[s]
    assert seg_lengths.tolist() == [e[2] for e in expected]
    expected.sort(key=lambda e: (e[0], e[1]))
    got = [
        (j, b, m, d)
        for j in range(2)
        for b, m, d in zip(*(x[bounds[j] : bounds[j + 1]] for x in (begin, size, dest)))
    ]
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=12),
    st.data(),
)
def test_append_to_rows_equals_joining_a_one_value_part(rows, data):
    """``ragged.append_to_rows`` (how EOS is appended) against the general row join it replaces, on every mask."""
    from packtools.core import ragged

    r = ragged.from_lists(rows)
    where = np.array(data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows))), bool)
    extra = ragged.from_lengths(where.astype(np.int64), np.full(int(where.sum()), 7, np.int32))
    got = ragged.append_to_rows(r, 7, where)
    want = ragged.join_rows([r, extra])
    assert got.values.dtype == want.values.dtype
    assert ragged.to_lists(got) == ragged.to_lists(want)
    every = ragged.append_to_rows(r, 7)
    assert ragged.to_lists(every) == [row + [7] for row in rows]
