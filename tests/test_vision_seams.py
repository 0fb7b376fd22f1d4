"""Vision-language seams that dropped data silently (review of issues 30 and 33): every column reaches the
model or stops the run, on the multimodal collator, the Arrow loader, ``pack --processor`` and the offline
vision pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError

SPEC = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)


def _row(**extra):
    row = {
        "input_ids": [1, 9, 2, 3, 4],
        "seq_lengths": [3, 2],
        "image_grid_thw": [[1, 2, 2]],
        "pixel_values": np.zeros((4, 6), np.float32),
    }
    return {**row, **extra}


@pytest.mark.parametrize("column", ["pixel_values_videos", "video_grid_thw", "second_per_grid_ts"])
def test_multimodal_collator_refuses_video_columns_by_name(column):
    collator = MultimodalCollator(SPEC, 0, return_tensors="np")
    with pytest.raises(PackingError, match=rf"video column\(s\) \['{column}'\]"):
        collator([_row(**{column: [[1.0]]})])
    # listed in leave_out, a video is still refused: its tokens would train without its frames
    with pytest.raises(PackingError, match="video column"):
        collator.replace(leave_out=[column])([_row(**{column: [[1.0]]})])


def test_multimodal_collator_refuses_video_tokens_by_name():
    with pytest.raises(PackingError, match=r"row 0: document 0 holds video tokens \(id 8\)"):
        MultimodalCollator(SPEC, 0, return_tensors="np")([_row(input_ids=[1, 8, 2, 3, 9], seq_lengths=[5])])


def test_multimodal_collator_refuses_a_column_it_does_not_carry():
    collator = MultimodalCollator(SPEC, 0, return_tensors="np")
    with pytest.raises(PackingError, match=r"\['id'\], which MultimodalCollator.*leave_out=\['id'\]") as err:
        collator([_row(id=7)])
    assert err.value.param == "leave_out"
    told = collator.replace(leave_out=["id"])
    assert told.options()["leave_out"] == frozenset({"id"})
    got, plain = told([_row(id=7)]), collator([_row()])
    assert set(got) == set(plain) and all(np.array_equal(got[k], plain[k]) for k in got)


# -- the Arrow loader: PackedRows / ArrowCollator ------------------------------------------------------------


def test_packed_rows_refuses_image_columns_and_names_the_multimodal_collator():
    import pyarrow as pa

    from packtools import PaddingFreeCollator
    from packtools.batches.loader import ArrowCollator, PackedRows

    table = pa.table(
        {
            "input_ids": [[1, 9, 2, 3, 4]],
            "seq_lengths": [[3, 2]],
            "pixel_values": [[[0.0] * 6] * 4],
            "image_grid_thw": [[[1, 2, 2]]],
        }
    )
    with pytest.raises(
        PackingError, match=r"image column\(s\) \['image_grid_thw', 'pixel_values'\].*Multimodal"
    ):
        PackedRows(table)
    # an ordinary extra column: refused by name unless left out, then the batch is that of the token columns
    ids = table.select(["input_ids", "seq_lengths"]).append_column("id", pa.array([7]))
    with pytest.raises(PackingError, match=r"\['id'\].*PackedRows\(\.\.\., leave_out=\['id'\]\)") as err:
        PackedRows(ids)
    assert err.value.param == "leave_out"
    collator = PaddingFreeCollator(0, return_tensors="np")
    got = ArrowCollator(PackedRows(ids, leave_out=["id"]), collator)([0])
    want = collator([{"input_ids": [1, 9, 2, 3, 4], "seq_lengths": [3, 2]}])
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)


def test_packed_rows_refuses_a_padding_attention_mask():
    import pyarrow as pa

    from packtools.batches.loader import PackedRows

    PackedRows(pa.table({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}))
    with pytest.raises(PackingError, match="'attention_mask' has values other than 1"):
        PackedRows(pa.table({"input_ids": [[1, 2], [3, 0]], "attention_mask": [[1, 1], [1, 0]]}))


def test_arrow_collator_refuses_a_view_column_the_batch_does_not_carry():
    import pyarrow as pa

    from packtools import PaddingFreeCollator
    from packtools.batches.loader import ArrowCollator
    from packtools.batches.view import PackedView

    table = pa.table({"input_ids": [[1, 2], [3, 4, 5]], "token_type_ids": [[0, 0], [1, 1, 1]]})
    view = PackedView.from_table(table, 8)
    with pytest.raises(PackingError, match=r"\['token_type_ids'\].*leave_out=\['token_type_ids'\]"):
        ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np"))
    told = ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np", leave_out=["token_type_ids"]))
    plain = PackedView.from_table(table.select(["input_ids"]), 8)
    got, want = told(view.__getitems__([0])), ArrowCollator(plain, told.collator)(plain.__getitems__([0]))
    assert all(np.array_equal(got[k], want[k]) for k in want)
