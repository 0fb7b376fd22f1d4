"""One label builder: rows as dicts, PackedRows and PackedView give the same labels on the same rows.

Each case (``completion_mask``, ``assistant_masks``, both, neither, own ``labels``) is checked against labels
written out by hand from the rule (tokens where every mask is 1, -100 at every sequence start), on all three
paths; the negative controls show the rows are such that a builder applying a wrong mask set would be caught.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packtools import PackingError
from packtools.batches.collate import PaddingFreeCollator
from packtools.batches.labels import ignore_starts, labels_of, mask_keys, masked_labels
from packtools.batches.loader import ArrowCollator, PackedRows
from packtools.batches.view import PackedView
from packtools.core.plan import plan

IDS = [[11, 12, 13, 14], [21, 22, 23], [31, 32], [41, 42, 43, 44, 45]]
COMPLETION = [[0, 0, 1, 1], [0, 1, 1], [1, 1], [0, 0, 0, 1, 1]]
ASSISTANT = [[1, 1, 1, 0], [1, 1, 0], [0, 1], [1, 1, 1, 1, 0]]
CASES = {
    "neither": (),
    "completion_mask": ("completion_mask",),
    "assistant_masks": ("assistant_masks",),
    "both": ("completion_mask", "assistant_masks"),
}
MASKS = {"completion_mask": COMPLETION, "assistant_masks": ASSISTANT}


def _source(keys, own_labels=False):
    data = {"input_ids": IDS, **{k: MASKS[k] for k in keys}}
    if own_labels:
        data["labels"] = [[t if t % 2 else -100 for t in row] for row in IDS]
    return pa.table({k: pa.array(v, pa.list_(pa.int32())) for k, v in data.items()})


def _expected(table, view, applied):
    """Labels of the view's packed rows, written out from the rule, row by row and segment by segment."""
    out = []
    src = table.to_pydict()
    p = view.plan
    for r in range(len(view)):
        for s in range(p.row_offsets[r], p.row_offsets[r + 1]):
            row, start, length = int(p.seg_source[s]), int(p.seg_start[s]), int(p.seg_length[s])
            for j in range(start, start + length):
                if "labels" in src:
                    value = src["labels"][row][j]
                else:
                    keep = all(src[k][row][j] == 1 for k in applied)
                    value = src["input_ids"][row][j] if keep else -100
                out.append(-100 if j == start else value)
    return out


def _three_paths(table, collator, order):
    view = PackedView(table, plan([len(r) for r in IDS], max_length=6))
    packed = view.materialize()
    from_dicts = collator([{k: np.asarray(v) for k, v in view[i].items()} for i in order])
    from_rows = ArrowCollator(PackedRows(packed), collator)(order)
    from_view = ArrowCollator(view, collator)(view.__getitems__(order))
    return view, [b["labels"][0].tolist() for b in (from_dicts, from_rows, from_view)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_paths_same_labels(case):
    table = _source(CASES[case])
    collator = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    view, (a, b, c) = _three_paths(table, collator, [2, 0])  # a batch in another order than the rows
    assert a == b == c
    view, (full, b, c) = _three_paths(table, collator, list(range(len(view))))
    assert full == b == c == _expected(table, view, CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_paths_same_labels_with_own_labels(case):
    """A ``labels`` column wins over every mask on all three paths."""
    table = _source(CASES[case], own_labels=True)
    collator = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    view = PackedView(table, plan([4, 3, 2, 5], max_length=6))
    everything = list(range(len(view)))
    _, (a, b, c) = _three_paths(table, collator, everything)
    assert a == b == c == _expected(table, view, ())


@pytest.mark.parametrize(
    ("completion_only_loss", "assistant_only_loss"), [(True, False), (False, True), (False, False)]
)
def test_switches_pick_the_same_masks_on_every_path(completion_only_loss, assistant_only_loss):
    table = _source(CASES["both"])
    collator = PaddingFreeCollator(
        pad_token_id=0,
        return_tensors="np",
        completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss,
    )
    view = PackedView(table, plan([4, 3, 2, 5], max_length=6))
    _, (a, b, c) = _three_paths(table, collator, list(range(len(view))))
    applied = mask_keys(completion_only_loss, assistant_only_loss)
    assert a == b == c == _expected(table, view, applied)


def test_negative_control_each_mask_set_gives_other_labels():
    """The rows are chosen so that every wrong mask set (one dropped, the other applied, none) changes the
    labels: a builder that applied the wrong masks could not pass the tests above."""
    table = _source(CASES["both"])
    view = PackedView(table, plan([4, 3, 2, 5], max_length=6))
    outcomes = {case: tuple(_expected(table, view, keys)) for case, keys in CASES.items()}
    assert len(set(outcomes.values())) == len(CASES)
    collator = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    _, (got, _, _) = _three_paths(table, collator, list(range(len(view))))
    assert [case for case, labels in outcomes.items() if list(labels) == got] == ["both"]


def test_negative_control_broken_builder_is_caught(monkeypatch):
    """A builder that drops the second mask, patched into one path at a time, makes that path disagree."""
    import packtools.batches.arrow_rows as arrow_rows
    import packtools.batches.flatten as flatten

    def first_mask_only(input_ids, labels, masks):
        return masked_labels(input_ids, labels, list(masks)[:1])

    table = _source(CASES["both"])
    collator = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    everything = list(range(len(PackedView(table, plan([4, 3, 2, 5], max_length=6)))))
    with monkeypatch.context() as m:
        m.setattr(flatten, "masked_labels", first_mask_only)
        _, (a, b, c) = _three_paths(table, collator, everything)
        assert a != b == c
    with monkeypatch.context() as m:
        m.setattr(arrow_rows, "labels_of", lambda ids, own, masks: labels_of(ids, own, list(masks)[:1]))
        _, (a, b, c) = _three_paths(table, collator, everything)
        assert a != b == c
    _, (a, b, c) = _three_paths(table, collator, everything)
    assert a == b == c


def test_builder_rules():
    ids = np.array([5, 6, 7, 8], np.int64)
    m1, m2 = np.array([0, 1, 1, 1]), np.array([1, 1, 0, 1], bool)
    assert masked_labels(ids, None, []) is None
    assert labels_of(ids, None, []).tolist() == [5, 6, 7, 8] and labels_of(ids, None, []) is not ids
    assert masked_labels(ids, None, iter([m1, m2])).tolist() == [-100, 6, -100, 8]
    own = np.array([1, 2, 3, 4])
    assert masked_labels(ids, own, [m1]) is own  # own labels: masks not applied
    assert ids.tolist() == [5, 6, 7, 8]  # never written in place
    assert ignore_starts(own.copy(), [0, 3]).tolist() == [-100, 2, 3, -100]
    assert mask_keys() == ("completion_mask", "assistant_masks") and mask_keys(False, False) == ()


def test_masks_misaligned_refused_on_dict_rows():
    collator = PaddingFreeCollator(pad_token_id=0, return_tensors="np")
    with pytest.raises(PackingError, match="'completion_mask' has shape"):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": [3], "completion_mask": [1, 1]}])
