"""PackPlan checks its invariants when built or loaded: a corrupted plan raises, it never gathers wrong tokens."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packtools
from packtools import PackingError, PackPlan
from packtools.core.plan_file import PLAN_FORMAT

FIELDS = ("seg_source", "seg_start", "seg_length", "row_offsets", "source_lengths")


def rebuild(p: PackPlan, **changes) -> PackPlan:
    parts = {name: getattr(p, name).copy() for name in FIELDS}
    parts.update(changes)
    return PackPlan(
        changes.pop("max_length", p.max_length),
        changes.pop("strategy", p.strategy),
        *(parts[n] for n in FIELDS),
    )


lengths_st = st.lists(st.integers(0, 40), min_size=2, max_size=60)
strategy_st = st.sampled_from(["bfd", "bfd_split", "wrapped"])


def valid_plan(lengths, max_length, strategy):
    p = packtools.plan(lengths, max_length, strategy)
    if p.num_segments < 2:
        return None
    return p


CORRUPTIONS = [
    "shift_start",
    "grow_segment",
    "source_out_of_range",
    "negative_source",
    "empty_segment",
    "duplicate_segment",
    "overlong_row",
    "offsets_not_zero",
    "offsets_short",
    "shrink_source",
]


def corrupt(p: PackPlan, kind: str, i: int) -> dict:
    """Array changes that break one invariant of ``p`` at segment ``i``."""
    src, start, length = p.seg_source.copy(), p.seg_start.copy(), p.seg_length.copy()
    offsets, lens = p.row_offsets.copy(), p.source_lengths.copy()
    if kind == "shift_start":  # the segment now reads past its sequence's end (or into the next chunk)
        start[i] += lens[src[i]] - start[i] - length[i] + 1
        return {"seg_start": start}
    if kind == "grow_segment":
        length[i] += lens[src[i]] + 1
        return {"seg_length": length}
    if kind == "source_out_of_range":
        src[i] = lens.shape[0] + i
        return {"seg_source": src}
    if kind == "negative_source":
        src[i] = -1
        return {"seg_source": src}
    if kind == "empty_segment":
        length[i] = 0
        return {"seg_length": length}
    if kind == "duplicate_segment":  # segment i copied over segment j: the same tokens twice
        j = (i + 1) % len(src)
        src[j], start[j], length[j] = src[i], start[i], length[i]
        return {"seg_source": src, "seg_start": start, "seg_length": length}
    if kind == "overlong_row":  # all segments in one row
        return {"row_offsets": np.array([0, len(src)])} if length.sum() > p.max_length else None
    if kind == "offsets_not_zero":
        offsets[0] = 1
        return {"row_offsets": offsets}
    if kind == "offsets_short":
        return {"row_offsets": offsets[:-1] if offsets.shape[0] > 2 else np.array([0])}
    if kind == "shrink_source":  # the data it was planned for is shorter now
        lens[src[i]] = start[i] + length[i] - 1
        return {"source_lengths": lens}
    raise AssertionError(kind)


@settings(max_examples=300, deadline=None)
@given(
    lengths=lengths_st,
    max_length=st.integers(1, 64),
    strategy=strategy_st,
    kind=st.sampled_from(CORRUPTIONS),
    pick=st.integers(0, 10_000),
)
def test_random_corruption_always_raises(lengths, max_length, strategy, kind, pick):
    p = valid_plan(lengths, max_length, strategy)
    if p is None:
        return
    change = corrupt(p, kind, pick % p.num_segments)
    if change is None:
        return
    with pytest.raises(PackingError, match="invalid PackPlan|PackPlan"):
        rebuild(p, **change)


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, max_length=st.integers(1, 64), strategy=strategy_st, seed=st.integers(0, 99))
def test_valid_plans_pass(lengths, max_length, strategy, seed):
    p = packtools.plan(lengths, max_length, strategy)
    p.check_complete()
    rebuild(p).check_complete()
    p.shuffled(seed).check_complete()
    if p.num_rows:
        p.slice_rows(0, (p.num_rows + 1) // 2)  # a partial plan is valid, only not complete


def test_messages_name_the_broken_invariant():
    p = packtools.plan([5, 2, 3, 1], 4)
    lens = p.source_lengths.copy()
    lens[0] = 2
    with pytest.raises(PackingError, match=r"segment 0 reads tokens 0:4 of sequence 0, which has 2 tokens"):
        rebuild(p, source_lengths=lens)
    with pytest.raises(PackingError, match=r"row 0 holds 10 tokens, more than max_length=4"):
        rebuild(p, row_offsets=np.array([0, 4]))
    start = p.seg_start.copy()
    start[1] = 1
    start_len = p.seg_length.copy()
    start_len[1] = 1
    with pytest.raises(PackingError, match="breaks the 'bfd' rule"):
        rebuild(p, seg_start=start, seg_length=start_len)


def test_a_partial_plan_is_refused_on_load(tmp_path):
    p = packtools.plan([5, 2, 3, 1], 4, "bfd_split")
    part = p.slice_rows(0, 2)
    part.save(tmp_path / "part.npz")
    with pytest.raises(PackingError, match="partial"):
        PackPlan.load(tmp_path / "part.npz")
    assert PackPlan.load(tmp_path / "part.npz", complete=False).num_rows == 2


def test_corrupted_file_is_refused_before_any_gather(tmp_path):
    p = packtools.plan([5, 2, 3, 1], 4)
    path = tmp_path / "plan.npz"
    p.save(path)
    with np.load(path) as z:
        arrays = dict(z)
    arrays["seg_start"][0] += 1  # shifted segment
    np.savez(path, **arrays)
    table = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    with pytest.raises(PackingError, match="invalid PackPlan"):
        packtools.pack_table(table, 4, plan=PackPlan.load(path))


@pytest.mark.parametrize("version", [0, PLAN_FORMAT + 1])
def test_other_format_versions_are_refused(tmp_path, version):
    p = packtools.plan([5, 2, 3, 1], 4)
    path = tmp_path / "plan.npz"
    p.save(path)
    with np.load(path) as z:
        arrays = dict(z)
    if version == 0:
        del arrays["format"]  # files of packtools 0.1 had no version
    else:
        arrays["format"] = np.int64(version)
    np.savez(path, **arrays)
    word = "older" if version == 0 else "newer"
    with pytest.raises(PackingError, match=f"plan format {version}, from an? {word} packtools"):
        PackPlan.load(path)
