"""Per-document mRoPE positions (packtools.batches.mrope) against the models' own get_rope_index."""

from __future__ import annotations

import numpy as np
import pytest
from _vl_models import FAMILIES, IMAGE, MERGE, VIDEO, image_sample, mixed_samples, tiny_vl, torch

from packtools.batches.mrope import MropeSpec, document_positions, row_positions
from packtools.errors import PackingError


def _model_positions(model, sample: dict) -> np.ndarray:
    ids = torch.tensor([sample["input_ids"]])
    grid = torch.as_tensor(sample["image_grid_thw"]) if "image_grid_thw" in sample else None
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=grid)
    return pos[:, 0].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_document_of_a_packed_row_gets_the_models_own_positions(family):
    model = tiny_vl(family)
    spec = MropeSpec.from_config(model.config)
    samples = mixed_samples(1) + [image_sample(np.random.default_rng(5), [(1, 8, 2), (1, 2, 8)], text=1)]
    ids = np.concatenate([s["input_ids"] for s in samples])
    grids = np.concatenate([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])
    per_doc = [len(s.get("image_grid_thw", ())) for s in samples]
    lengths = [len(s["input_ids"]) for s in samples]
    packed = row_positions(ids, lengths, per_doc, grids, spec)
    three = row_positions(ids, lengths, per_doc, grids, spec, text_row=False)
    assert packed.shape == (4, ids.shape[0]) and np.array_equal(packed[1:], three)
    start = 0
    for s, n in zip(samples, lengths):
        own = _model_positions(model, s) if "image_grid_thw" in s else np.tile(np.arange(n), (3, 1))
        assert np.array_equal(packed[1:, start : start + n], own)
        assert np.array_equal(document_positions(s["input_ids"], s.get("image_grid_thw"), spec), own)
        assert np.array_equal(packed[0, start : start + n], np.arange(n))
        start += n
    # The whole row run through the model's get_rope_index is not per document (what must never be fed).
    whole = _model_positions(model, {"input_ids": ids.tolist(), "image_grid_thw": grids})
    assert not np.array_equal(whole, packed[1:])


def test_spec_from_config_and_refusals():
    spec = MropeSpec("qwen2_5_vl", image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE)
    with pytest.raises(PackingError, match="video"):
        document_positions([1, VIDEO, 2], None, spec)
    with pytest.raises(PackingError, match="runs of"):  # 2 image tokens, grid says 4
        document_positions([1, IMAGE, IMAGE, 2], [[1, 4, 4]], spec)
    with pytest.raises(PackingError, match="runs of"):  # two images with no text between them
        document_positions([1] + [IMAGE] * 2, [[1, 2, 2], [1, 2, 2]], spec)
    with pytest.raises(PackingError, match="runs of"):  # image tokens without a grid
        document_positions([1, IMAGE, 2], None, spec)
    with pytest.raises(PackingError, match="not verified"):
        MropeSpec("mistral3", IMAGE, None, 2)
    with pytest.raises(PackingError, match="AnyresGrid"):  # llava_next is verified, with its tiling
        MropeSpec("llava_next", IMAGE, None, 1, image_tokens=4)
    with pytest.raises(PackingError, match="image_tokens"):  # llava is verified, with its tokens per image
        MropeSpec("llava", IMAGE, None, 1)

    class Cfg:
        model_type = "gemma3"
        image_token_id = 5

    with pytest.raises(PackingError, match="gemma3"):
        MropeSpec.from_config(Cfg())
