"""Idefics3 and SmolVLM (images split into tiles, each a fixed run of tokens between row/column tokens, read with a
``pixel_attention_mask``) trained packed equal the samples run one by one: first the model's own forward over a
packed row (positions restarting, every tile in document order under one batch entry, the masks carried), then a
Trainer step through ``pack_dataset`` + ``prepare_trainer`` + ``MultimodalCollator`` (loss and every gradient, sdpa
and eager, CPU fp32).  Both types were refused by name on main ("not measured")."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_vision_llava import trainer_step_equals_one_by_one as llava_step

from packtools import pack_dataset
from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

IMAGE, FAKE, GLOBAL = 100, 90, 91  # <image>, <fake_token_around_image>, <global-img>
SIDE, PATCH = (
    8,
    2,
)  # tiles of 8 x 8 pixels, 2-pixel patches, scale_factor 2: (8 / 2)**2 / 2**2 = 4 tokens a tile
PER_TILE = 4
FAMILIES = {
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
}


def tiny(family: str, impl: str):
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    text = dict(
        model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=100.0, pad_token_id=0,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
        patch_size=PATCH,
    )  # fmt: skip
    config = config_cls(text_config=text, vision_config=vision, image_token_id=IMAGE, scale_factor=2)
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = "sdpa" if impl == "packtools_sdpa" else impl
    torch.manual_seed(0)
    model = model_cls(config).float()
    if impl == "packtools_sdpa":  # both towers; the vision tower's calls carry no cu_seq_lens
        from packtools.integrations.attention.segmented import register

        model.set_attn_implementation(register())
    return model


def sample(rng, tiles: list[int], words: int, padded: bool = False) -> dict:
    """A processed sample: ``words`` text tokens, then per image its tiles as the processor lays them (each tile
    ``<fake><row/col or global> <image>*4``; an image of n > 1 tiles is n - 1 split tiles and the global one),
    ``pixel_values`` ``(tiles, 3, 8, 8)`` and ``pixel_attention_mask`` ``(tiles, 8, 8)``; ``padded``: its first
    tile's last two pixel columns are padding (zero, masked out), as the processor pads a smaller tile."""
    ids = rng.integers(3, 80, words).tolist()
    count = 0
    for n in tiles:
        for t in range(n):
            ids += [FAKE, GLOBAL if t == n - 1 else 40 + t] + [IMAGE] * PER_TILE
        ids += [FAKE] + rng.integers(3, 80, 2).tolist()
        count += n
    row: dict = {"input_ids": ids}
    if count:
        pixels = rng.standard_normal((count, 3, SIDE, SIDE)).astype(np.float32)
        mask = np.ones((count, SIDE, SIDE), np.int64)
        if padded:
            pixels[0, :, :, -2:] = 0
            mask[0, :, -2:] = 0
        row["pixel_values"], row["pixel_attention_mask"] = pixels.tolist(), mask.tolist()
    return row


def samples(seed: int = 0) -> list[dict]:
    """Samples with images of 1 tile, none, an image of 3 tiles (one padded) and one of 1, 2 tiles, none."""
    rng = np.random.default_rng(seed)
    shapes = [([1], 5, False), ([], 9, False), ([3, 1], 4, True), ([2], 6, False), ([], 7, False)]
    return [sample(rng, tiles, words, padded) for tiles, words, padded in shapes]


def alone_inputs(row: dict) -> dict:
    ids = torch.tensor([row["input_ids"]])
    extra = {}
    if "pixel_values" in row:
        extra = {
            "pixel_values": torch.tensor(row["pixel_values"])[None],
            "pixel_attention_mask": torch.tensor(row["pixel_attention_mask"])[None],
        }
    return {"input_ids": ids, **extra}


@pytest.mark.parametrize("impl", ["sdpa", "eager", "packtools_sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_models_own_forward_over_a_packed_row_equals_each_document_alone(family, impl):
    # the measurement behind verifying the types: positions restarting, tiles concatenated in document order
    # under one batch entry, masks carried; logits and every gradient equal the documents alone
    model = tiny(family, impl)
    assert model.model.image_seq_len == PER_TILE
    rows = samples()

    def loss_of(logits):  # a loss touching every logit
        return (logits.logsumexp(-1) - logits[:, 3]).sum() + (logits * logits).mean()

    model.zero_grad()
    alone = []
    for row in rows:
        logits = model(**alone_inputs(row), use_cache=False).logits[0]
        loss_of(logits).backward()
        alone.append(logits.detach())
    ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    batch = MultimodalCollator(model, 0)([{
        "input_ids": sum((r["input_ids"] for r in rows), []),
        "seq_lengths": [len(r["input_ids"]) for r in rows],
        "pixel_values": sum((r.get("pixel_values", []) for r in rows), []),
        "pixel_attention_mask": sum((r.get("pixel_attention_mask", []) for r in rows), []),
    }])  # fmt: skip
    assert batch["pixel_values"].shape == (1, 7, 3, SIDE, SIDE)
    assert batch["pixel_attention_mask"].shape == (1, 7, SIDE, SIDE)
    batch.pop("labels")
    packed = model(**batch).logits[0]
    spans = np.cumsum([0] + [len(r["input_ids"]) for r in rows])
    sum(loss_of(packed[a:b]) for a, b in zip(spans[:-1], spans[1:])).backward()
    for (a, b), one in zip(zip(spans[:-1], spans[1:]), alone):
        assert float((packed[a:b].detach() - one).abs().max()) < 1e-5
    assert set(ref) == {k for k, p in model.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref.values())
    assert (
        max(float((p.grad - ref[k]).abs().max()) for k, p in model.named_parameters() if k in ref)
        < 1e-6 * scale
    )
    with (
        torch.no_grad()
    ):  # negative controls: the masks left out, or positions not restarting, change the logits
        unmasked = model(**{k: v for k, v in batch.items() if k != "pixel_attention_mask"}).logits[0]
        whole = model(**{**batch, "position_ids": torch.arange(int(spans[-1]))[None]}).logits[0]
    assert float((unmasked[spans[2] : spans[3]] - alone[2]).abs().max()) > 1e-3  # the padded tile's document
    if impl != "packtools_sdpa":  # which reads the documents from cu_seq_lens (rotary offsets then cancel)
        assert float((whole[spans[1] :] - torch.cat(alone[1:])).abs().max()) > 1e-2


@pytest.mark.parametrize(
    "impl, segmented, used",
    [
        # loaded on sdpa, prepare_trainer switches both towers to packtools_sdpa, as it does text models and Gemma 3
        # (main left these types on sdpa)
        ("sdpa", True, "packtools_sdpa"),
        ("sdpa", False, "sdpa"),
        ("eager", True, "eager"),
    ],
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_training_step_equals_one_by_one(family, impl, segmented, used, tmp_path):
    from packtools.integrations.attention.backends import attention_implementation

    model = tiny(family, impl)
    trainer_step_equals_one_by_one(model, samples(), tmp_path, segmented_sdpa=segmented)
    assert attention_implementation(model) == used
    assert model.config.vision_config._attn_implementation == used  # the vision tower too


def test_smolvlm_through_sft_trainer_keeps_its_tiles_and_masks(tmp_path):
    # TRL's SFTTrainer keeps only input_ids, labels and seq_lengths (remove_unused_columns): prepare_trainer keeps
    # pixel_values and pixel_attention_mask too
    trainer_step_equals_one_by_one(tiny("smolvlm", "sdpa"), samples(), tmp_path, sft=True)


def one_by_one(model, rows: list[dict]) -> tuple[float, dict]:
    model.zero_grad()
    labelled = [(alone_inputs(r), None) for r in rows]
    for inputs, _ in labelled:
        inputs["labels"] = inputs["input_ids"].masked_fill(inputs["input_ids"] == IMAGE, -100)
    total = sum(int((inputs["labels"][0, 1:] != -100).sum()) for inputs, _ in labelled)
    loss = 0.0
    for inputs, _ in labelled:
        out = model(**inputs, use_cache=False, num_items_in_batch=total)
        out.loss.backward()
        loss += float(out.loss.detach())
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def trainer_step_equals_one_by_one(
    model, rows: list[dict], tmp_path, sft: bool = False, segmented_sdpa: bool = True
) -> None:
    """``tests/test_vision_llava.py``'s step, with this file's rows, lengths and reference."""
    packed, _ = llava_step(
        model, rows, tmp_path, sft, max_length=80, alone=one_by_one, tower="vision_model",
        segmented_sdpa=segmented_sdpa,
    )  # fmt: skip
    assert len(packed) < len(rows) and "pixel_attention_mask" in packed.column_names
    assert sum(len(r["pixel_attention_mask"] or []) for r in packed) == 7  # every tile's mask, whole


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_spec_counts_a_tiles_tokens_as_the_model_does(family):
    model = tiny(family, "sdpa")
    spec = MropeSpec.from_config(model.config)
    assert (spec.flat, spec.tiles, spec.image_tokens, spec.image_shape) == (
        True,
        True,
        PER_TILE,
        (3, SIDE, SIDE),
    )
    # SmolVLM-256M's sizes: 512-pixel tiles of 16-pixel patches, scale_factor 4: 64 tokens a tile
    config = copy.deepcopy(model.config)
    config.vision_config.image_size, config.vision_config.patch_size, config.scale_factor = 512, 16, 4
    assert MropeSpec.from_config(config).image_tokens == 64
    config.scale_factor = 3  # 32 patches a side is not whole 3 x 3 squares
    with pytest.raises(PackingError, match="scale_factor"):
        MropeSpec.from_config(config)


def packed_row(rows: list[dict]) -> dict:
    return {
        "input_ids": sum((r["input_ids"] for r in rows), []),
        "seq_lengths": [len(r["input_ids"]) for r in rows],
        "pixel_values": sum((r.get("pixel_values", []) for r in rows), []),
        "pixel_attention_mask": sum((r.get("pixel_attention_mask", []) for r in rows), []),
    }


def test_rows_whose_placeholders_or_masks_do_not_match_their_tiles_are_refused():
    collate = MultimodalCollator(tiny("smolvlm", "sdpa"), 0)
    rows = samples()[:3]
    row = packed_row(rows)
    assert collate([row])["pixel_values"].shape == (1, 5, 3, SIDE, SIDE)  # 1 + 0 + 3 + 1 tiles
    # one tile's placeholders short: a run of 3, not 4
    cut = list(row["input_ids"])
    del cut[cut.index(IMAGE)]
    with pytest.raises(PackingError, match=r"row 0, document 0: its image tokens .* runs of \[3\]"):
        collate([dict(row, input_ids=cut, seq_lengths=[row["seq_lengths"][0] - 1, *row["seq_lengths"][1:]])])
    # a tile more than the placeholders announce (the tiles would shift onto other documents' tokens)
    extra = dict(row, pixel_values=row["pixel_values"] + row["pixel_values"][:1])
    extra["pixel_attention_mask"] = row["pixel_attention_mask"] + row["pixel_attention_mask"][:1]
    # (as a processor called on several samples pads each to the most tiles: it says so)
    with pytest.raises(PackingError, match="holds 6 image.*input_ids hold 5.*process one sample at a time"):
        collate([extra])
    # the masks missing, one short, masked whole, or a tile of zeros (the model would drop it as padding)
    with pytest.raises(PackingError, match="no 'pixel_attention_mask'.*Keep the processor's"):
        collate([{k: v for k, v in row.items() if k != "pixel_attention_mask"}])
    with pytest.raises(PackingError, match="'pixel_attention_mask' has shape"):
        collate([dict(row, pixel_attention_mask=row["pixel_attention_mask"][:3])])
    blank = np.asarray(row["pixel_attention_mask"]).copy()
    blank[1] = 0
    with pytest.raises(PackingError, match=r"tile\(s\) \[1\] fully masked"):
        collate([dict(row, pixel_attention_mask=blank)])
    zero = np.asarray(row["pixel_values"], np.float32).copy()
    zero[2] = 0
    with pytest.raises(PackingError, match=r"tile\(s\) \[2\] all zeros"):
        collate([dict(row, pixel_values=zero)])
    # tiles of another size (another model's processor)
    with pytest.raises(PackingError, match=r"float images of shape \(images, \(3, 8, 8\)\)"):
        collate([dict(row, pixel_values=np.ones((5, 3, 16, 16), np.float32))])
    # a text-only row with a mask
    with pytest.raises(PackingError, match="'pixel_attention_mask' but no images"):
        collate([dict(samples()[1], seq_lengths=[9], pixel_attention_mask=[[[1]]])])


def test_a_pixel_attention_mask_reaching_another_types_collator_is_refused():
    from test_vision_llava import tiny_llava

    with pytest.raises(PackingError, match="pixel_attention_mask"):
        MultimodalCollator(tiny_llava("sdpa"), 0)([{"input_ids": [5, 6], "pixel_attention_mask": [[[1]]]}])


def test_pack_dataset_refuses_a_sample_whose_masks_do_not_match_its_tiles():
    # packed, a row's masks are matched to its tiles by order alone: a sample with a mask too few and the next
    # with one too many would give every later tile another tile's mask
    rows = samples()
    rows[0]["pixel_attention_mask"] = []
    rows[2]["pixel_attention_mask"] = rows[2]["pixel_attention_mask"] + rows[2]["pixel_attention_mask"][:1]
    with pytest.raises(
        PackingError, match="row 0: 'pixel_attention_mask' holds 0 masks but 'pixel_values' holds 1"
    ):
        pack_dataset(datasets.Dataset.from_list(rows), 80)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_isolation_probe_passes(family):
    from packtools.integrations.multimodal.models import check_vision_isolation

    model = tiny(family, "sdpa")
    report = check_vision_isolation(model, MultimodalCollator(model, 0))
    assert not report.leaks and "pixel_attention_mask" in report.keys


def test_guard_model_refuses_a_packed_forward_without_the_tile_masks():
    # a collator of one's own that drops pixel_attention_mask: the model reads a padded tile's zeros as image
    from packtools.integrations.trainers.guard import guard_model

    model = tiny("idefics3", "sdpa")
    batch = MultimodalCollator(model, 0)([packed_row(samples()[:3])])
    batch.pop("labels")
    guard_model(model)
    model(**batch)  # the collator's batch passes
    with pytest.raises(PackingError, match="no pixel_attention_mask"):
        model(**{k: v for k, v in batch.items() if k != "pixel_attention_mask"})


def test_the_switch_to_packtools_sdpa_is_undone_by_unprepare(tmp_path):
    # prepare_trainer records the switch of both towers: unprepare puts the whole model back on sdpa
    from packtools import prepare_trainer
    from packtools.integrations import unprepare
    from packtools.integrations.attention.backends import attention_implementation, switches_to_segmented_sdpa

    model = tiny("smolvlm", "sdpa")
    assert switches_to_segmented_sdpa(model) and not switches_to_segmented_sdpa(tiny("smolvlm", "eager"))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[]
    )
    packed = pack_dataset(datasets.Dataset.from_list(samples()), 80)
    trainer = prepare_trainer(
        transformers.Trainer(model, args, train_dataset=packed, data_collator=MultimodalCollator(model, 0))
    )
    assert (
        attention_implementation(model) == model.config.vision_config._attn_implementation == "packtools_sdpa"
    )
    unprepare(trainer)
    assert attention_implementation(model) == model.config.vision_config._attn_implementation == "sdpa"
