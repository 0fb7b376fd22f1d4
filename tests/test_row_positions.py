"""A row's own ``position_ids`` and nested ``input_ids`` reach ``PaddingFreeCollator`` (and ``PackedRows``) or stop it.

The collator rebuilds ``position_ids`` from ``seq_lengths`` (a row without them is one sequence).  A row whose
own positions say something else (two sequences in an unpacked row, positions contradicting ``seq_lengths``)
used to be merged or re-split without a word (review 2026-12c C5, adversarial notes); it is refused by name.
Positions that agree pass.  Ragged nested ``input_ids`` gave numpy's traceback; the error names the row and
column.  ``ContextParallelCollator`` refuses the inner collator's static-shape options it cannot keep (C6).
"""

import numpy as np
import pytest

from packtools import PaddingFreeCollator
from packtools.batches.loader import PackedRows
from packtools.errors import PackingError

datasets = pytest.importorskip("datasets")

TWO_DOCS = {"input_ids": [11, 12, 13, 21, 22, 23], "position_ids": [0, 1, 2, 0, 1, 2]}


def collate(*rows, **options):
    return PaddingFreeCollator(0, return_tensors="np", **options)(list(rows))


def test_unpacked_row_with_its_own_two_sequences_is_refused():
    # C5: unpacked=True used to give positions 0..5 and one sequence (token 21 trained across the boundary)
    with pytest.raises(PackingError, match=r"row 0: its own 'position_ids' restart at token\(s\) \[0, 3\]"):
        collate(TWO_DOCS, unpacked=True)


def test_positions_contradicting_seq_lengths_are_refused():
    with pytest.raises(PackingError, match=r"its 'seq_lengths' \[4, 2\] give\(s\) 3") as err:
        collate({"input_ids": [9, 9]}, {**TWO_DOCS, "seq_lengths": [4, 2]})
    assert "row 1" in str(err.value) and "remove_columns('position_ids')" in str(err.value)
    with pytest.raises(PackingError, match=r"'position_ids' has 2 values for 3 tokens"):
        collate({"input_ids": [1, 2, 3], "position_ids": [0, 1]}, unpacked=True)


def test_positions_that_agree_pass_and_are_what_the_batch_holds():
    batch = collate({**TWO_DOCS, "seq_lengths": [3, 3]})
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 6]
    assert collate({"input_ids": [5, 6, 7], "position_ids": [0, 1, 2]}, unpacked=True)[
        "position_ids"
    ].tolist() == [[0, 1, 2]]


def test_arrow_rows_check_their_position_ids_once():
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2], TWO_DOCS["input_ids"]], "position_ids": [[0, 1], TWO_DOCS["position_ids"]]}
    )
    with pytest.raises(
        PackingError, match=r"row 1: its own 'position_ids' disagree with one sequence per row"
    ):
        PackedRows(ds)
    with pytest.raises(PackingError, match=r"row 1: its own 'position_ids' disagree with its 'seq_lengths'"):
        PackedRows(ds.add_column("seq_lengths", [[2], [4, 2]]))
    assert len(PackedRows(ds.add_column("seq_lengths", [[2], [3, 3]]))) == 2


def test_ragged_nested_input_ids_name_the_row_and_column():
    with pytest.raises(
        PackingError, match=r"row 1: 'input_ids' is not a flat list of integers .*seq_lengths"
    ):
        collate(
            {"input_ids": [1, 2, 3], "seq_lengths": [3]}, {"input_ids": [[1, 2], [3]], "seq_lengths": [3]}
        )
    with pytest.raises(PackingError, match=r"row 0: 'labels' is not a flat list"):
        collate({"input_ids": [1, 2, 3], "labels": [[1, 2], [3]]}, unpacked=True)
    assert np.asarray(collate({"input_ids": [1, 2, 3]}, unpacked=True)["input_ids"]).shape == (1, 3)


@pytest.mark.parametrize(("option", "value"), [("pad_to_buckets", [32]), ("pad_cu_seq_lens_to", 8)])
def test_cp_collator_refuses_static_shape_options_it_cannot_keep(option, value):
    # review C6: the shard was (1, 18) under pad_to_buckets=[32] (not static), and pad_cu_seq_lens_to failed
    # with a CP layout error that did not name the option
    from packtools.batches import ContextParallelCollator

    with pytest.raises(PackingError, match=rf"inner PaddingFreeCollator has \{{'{option}'") as err:
        ContextParallelCollator(PaddingFreeCollator(0, **{option: value}), 2, 0, return_tensors="np")
    assert err.value.param == "inner"
    shard = ContextParallelCollator(PaddingFreeCollator(0), 2, 0, return_tensors="np")(
        [{"input_ids": list(range(1, 12)), "seq_lengths": [4, 7]}]
    )
    assert shard["input_ids"].shape == (1, 6)
