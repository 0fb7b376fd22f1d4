"""guard_model checks a packed forward's images against each document's image tokens, as MultimodalCollator does.

A loop of one's own that builds its packed batch with a collator of its own: the models match images to image
tokens by order and check only the totals, so two images' sizes (LLaVA-NeXT / OneVision ``image_sizes``) or grids
(Qwen-VL ``image_grid_thw``) swapped, or an Idefics3 / SmolVLM tile's ``<image>`` tokens moved into another
document, ran with no error, giving features to the wrong document.  Each case below runs unguarded (the silence),
is refused by the guard by name, and the collator's own batch passes (the negative control).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from packtools.batches.vision import MultimodalCollator  # noqa: E402
from packtools.errors import PackingError  # noqa: E402
from packtools.integrations.trainers.guard import guard_model  # noqa: E402


def _guarded_refuses(model, batch: dict, bad: dict, match: str) -> None:
    """``bad`` runs through the unguarded model (no error: silent), the guarded model refuses it with ``match``
    and runs the collator's ``batch``."""
    with torch.no_grad():
        model(**bad)  # silent without the guard
        guard_model(model, check_isolation=False)
        model(**batch)  # the collator's batch passes
        with pytest.raises(PackingError, match=match) as err:
            model(**bad)
    assert "MultimodalCollator(model, pad_token_id)" in str(err.value)


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_guard_refuses_two_images_sizes_swapped(kind):
    from test_vision_llava_anyres import packed_row, tiny

    model = tiny(kind).eval()
    # documents of an image of 30 x 70 pixels (14 tokens), none, and one of 90 x 20 (22 tokens): 4 tiles each
    batch = MultimodalCollator(model, 0)([packed_row(kind, (0, 1, 3))])
    batch.pop("labels")
    sizes = batch["image_sizes"]
    assert sizes.tolist() == [[30, 70], [90, 20]]
    swapped = dict(batch, image_sizes=sizes[[1, 0]])
    _guarded_refuses(model, batch, swapped, r"document 0: its image tokens .* \(image_sizes\)")


def test_guard_refuses_a_onevision_batch_whose_image_counts_are_wrong():
    # batch_num_images decides which image is tiled (its token count): [1, 2] read as [2, 1] moves the tiling
    # (the model then fails on its own totals, "Image features and image tokens do not match"; refused by name first)
    from test_vision_llava_anyres import packed_row, tiny

    model = tiny("llava_onevision").eval()
    batch = MultimodalCollator(model, 0)([packed_row("llava_onevision")])
    batch.pop("labels")
    assert batch["batch_num_images"].tolist() == [1, 2]
    with torch.no_grad():
        guard_model(model, check_isolation=False)
        model(**batch)
        with pytest.raises(PackingError, match="image tokens"):
            model(**dict(batch, batch_num_images=torch.tensor([2, 1])))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_guard_refuses_two_images_grids_swapped(family):
    from _vl_models import mixed_samples, tiny_vl
    from test_vision_train import packed_rows

    model = tiny_vl(family, "sdpa").eval()
    batch = MultimodalCollator(model, 0)(packed_rows(mixed_samples(3))[:1])
    batch.pop("labels")
    grid = batch["image_grid_thw"]
    assert grid[0].prod() != grid[1].prod()  # document 0's image and document 2's first: other token counts
    swapped = dict(batch, image_grid_thw=grid[[1, 0, *range(2, grid.shape[0])]])
    _guarded_refuses(model, batch, swapped, r"document 0: its image tokens .* image_grid_thw")


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_guard_refuses_a_tiles_tokens_moved_into_another_document(family):
    from test_vision_idefics3 import FAKE, IMAGE, packed_row, samples, tiny

    model = tiny(family, "sdpa").eval()
    batch = MultimodalCollator(model, 0)([packed_row(samples()[:3])])
    batch.pop("labels")
    ids = batch["input_ids"][0].clone()
    doc2 = int((batch["position_ids"][0] == 0).nonzero()[2])  # document 2's first token
    last = int((ids[:doc2] == IMAGE).nonzero()[-1])  # document 0's tile loses its last <image> token ...
    fake = doc2 + int((ids[doc2:] == FAKE).nonzero()[1])  # ... and document 2's second tile gains one
    assert ids[fake - 1] == IMAGE and ids[fake + 1] != IMAGE
    ids[last], ids[fake] = 5, IMAGE
    moved = dict(batch, input_ids=ids[None])
    _guarded_refuses(model, batch, moved, r"document \d: its image tokens .* runs of \[\d\] tokens")


@pytest.mark.parametrize("family", ["llava_onevision", "idefics3"])
def test_image_companion_columns_are_never_left_out_beside_their_pixels(family):
    # image_sizes, batch_num_images, pixel_attention_mask listed in leave_out: no collator drops them while it keeps
    # the pixels. PaddingFreeCollator refuses the row by its pixel_values (even listed), MultimodalCollator carries
    # them for the types that read them whatever leave_out says (the other types' collators refuse their pixels)
    from packtools import PaddingFreeCollator
    from packtools.constants import ANYRES_COLUMNS, PIXEL_MASK

    if family == "llava_onevision":
        from test_vision_llava_anyres import packed_row, tiny

        model, row, companions = tiny(family), packed_row(family), list(ANYRES_COLUMNS)
    else:
        from test_vision_idefics3 import packed_row, samples, tiny

        model, row, companions = tiny(family, "sdpa"), packed_row(samples()[:3]), [PIXEL_MASK]
    with pytest.raises(PackingError, match=r"image column\(s\) \['pixel_values'\].*even with leave_out"):
        PaddingFreeCollator(0, leave_out=[*companions, "pixel_values"])([row])
    batch = MultimodalCollator(model, 0, leave_out=companions)([row])
    assert set(companions) <= set(batch) and "pixel_values" in batch
