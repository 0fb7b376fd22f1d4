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
