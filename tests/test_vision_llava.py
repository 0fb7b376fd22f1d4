"""LLaVA and InternVL (1-D rotary positions, a fixed run of image tokens per image or tile) trained packed through
Trainer + prepare_trainer + MultimodalCollator equal the samples run one by one (loss and every gradient, sdpa and
eager, CPU fp32); the packed rows come from ``pack_dataset``.  Refused on main (neither was verified there).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _hf_models import plain_sgd_options

from packtools import pack_dataset, prepare_trainer
from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

IMAGE = 300
PER_IMAGE = 4  # LLaVA: (28 / 14)**2 patches, the CLS token dropped ("default"); InternVL: (56 / 14)**2 / 2**2
SIDE = {"llava": 28, "internvl": 56}


def tiny_internvl(impl: str):
    vision = transformers.InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[56, 56],
        patch_size=[14, 14],
    )  # fmt: skip
    text = dict(
        model_type="qwen2", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    config = transformers.InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, image_seq_length=PER_IMAGE,
        attn_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.InternVLForConditionalGeneration(config).float()


def tiny(family: str, impl: str):
    return tiny_llava(impl) if family == "llava" else tiny_internvl(impl)


def tiny_llava(impl: str, tower: str = "clip", **extra):
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
        patch_size=14, projection_dim=32,
    )  # fmt: skip
    text = dict(
        model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=(transformers.CLIPVisionConfig if tower == "clip" else transformers.SiglipVisionConfig)(**vision),
        text_config=text, image_token_id=IMAGE,
        image_seq_length=PER_IMAGE, attn_implementation=impl, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).float()


def samples(seed: int = 0, side: int = 28, per: int = PER_IMAGE) -> list[dict]:
    """Samples with 1, 0, 2, 1 and 0 images (image runs within the text) of 9 to 24 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for images, words in ((1, 5), (0, 9), (2, 4), (1, 11), (0, 6)):
        ids = rng.integers(3, 290, words).tolist()
        for _ in range(images):
            ids += [IMAGE] * per + rng.integers(3, 290, 3).tolist()
        row = {"input_ids": ids}
        if images:
            row["pixel_values"] = rng.standard_normal((images, 3, side, side)).astype(np.float32).tolist()
        out.append(row)
    return out


def one_by_one(model, rows: list[dict]) -> tuple[float, dict]:
    model.zero_grad()
    labelled = []
    for s in rows:
        ids = torch.tensor([s["input_ids"]])
        labelled.append((ids, ids.masked_fill(ids == IMAGE, -100), s.get("pixel_values")))
    total = sum(int((labels[0, 1:] != -100).sum()) for _, labels, _ in labelled)
    loss = 0.0
    for ids, labels, pixels in labelled:
        extra = {} if pixels is None else {"pixel_values": torch.tensor(pixels)}
        out = model(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=total, **extra)
        out.loss.backward()
        loss += float(out.loss.detach())
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llava", "internvl"])
def test_packed_training_step_equals_one_by_one(family, impl, tmp_path):
    trainer_step_equals_one_by_one(tiny(family, impl), samples(side=SIDE[family]), tmp_path)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_with_a_siglip_tower_trains_packed_exactly(strategy, tmp_path):
    # SigLIP has no class token: "default" (first token dropped) gives 2 * 2 - 1 tokens an image, "full" 2 * 2.
    # The spec counted CLIP's (4 and 5) and refused the processor's rows.
    model = tiny_llava("sdpa", "siglip", vision_feature_select_strategy=strategy)
    per = 3 if strategy == "default" else 4
    assert MropeSpec.from_config(model.config).image_tokens == per
    trainer_step_equals_one_by_one(model, samples(per=per), tmp_path)


def test_llava_through_sft_trainer_keeps_its_images(tmp_path):
    # TRL's SFTTrainer keeps only input_ids, labels and seq_lengths of a prepared dataset (remove_unused_columns,
    # the default): pixel_values were dropped and the collator refused every row ("re-process the row");
    # prepare_trainer keeps the image columns now, and the step equals the samples one by one
    trainer_step_equals_one_by_one(tiny_llava("sdpa"), samples(), tmp_path, sft=True)


def trainer_step_equals_one_by_one(
    model,
    rows: list[dict],
    tmp_path,
    sft: bool = False,
    *,
    max_length: int = 48,
    alone=None,
    tower="vision_tower",
    segmented_sdpa: bool = True,
):
    """One Trainer (or TRL SFTTrainer) step through ``pack_dataset``, ``prepare_trainer`` and ``MultimodalCollator``
    equals ``alone(model, rows)`` (each sample run by itself; this file's ``one_by_one`` by default), vision tower
    (parameters named with ``tower``) included; the other vision-language test files call it with their own.
    Returns the packed dataset and the reference gradients for their own checks."""
    reference = copy.deepcopy(model)
    packed = pack_dataset(datasets.Dataset.from_list(rows), max_length)
    assert len(packed) < len(rows)  # documents with images share rows
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=len(packed), max_steps=1, optim="sgd",
        **plain_sgd_options(),
    )  # fmt: skip
    collator = MultimodalCollator(model, 0)
    if sft:
        trl = pytest.importorskip("trl")
        from _hf_models import word_tokenizer

        from packtools.integrations.trainers.sft import packed_sft_config

        args = packed_sft_config(**options, bf16=False, max_length=None, padding_free=False)
        assert args.remove_unused_columns
        trainer = trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=packed,
            processing_class=word_tokenizer(),
            data_collator=collator,
        )
        trainer = prepare_trainer(trainer, segmented_sdpa=segmented_sdpa)
    else:
        args = transformers.TrainingArguments(**options)
        trainer = prepare_trainer(
            transformers.Trainer(model, args, train_dataset=packed, data_collator=collator),
            segmented_sdpa=segmented_sdpa,
        )
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = trainer.train()
    ref_loss, ref_grads = (alone or one_by_one)(reference, rows)
    assert abs(result.training_loss - ref_loss) < 1e-5
    diffs = [float((before[k] - p.detach() - g).abs().max()) for k, p in model.named_parameters() if (g := ref_grads.get(k)) is not None]  # fmt: skip
    assert len(diffs) == len(ref_grads) and max(diffs) < 1e-5
    learned = [k for k in ref_grads if tower in k]
    assert learned and any(float(ref_grads[k].abs().max()) > 0 for k in learned)  # the vision tower learns
    return packed, ref_grads


def test_llava_batch_positions_restart_and_images_follow_in_row_order():
    model = tiny_llava("sdpa")
    rows = samples()[:3]
    row = {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
        "pixel_values": sum((s.get("pixel_values", []) for s in rows), []),
    }
    batch = MultimodalCollator(model, 0, return_tensors="np")([row])
    expected = np.concatenate([np.arange(len(s["input_ids"])) for s in rows])
    assert batch["position_ids"].tolist() == [expected.tolist()]
    assert batch["pixel_values"].shape == (3, 3, 28, 28) and "image_grid_thw" not in batch
    assert np.all(batch["labels"][0][np.asarray(row["input_ids"]) == IMAGE] == -100)


def test_llava_rows_whose_images_do_not_match_their_tokens_are_refused():
    spec = MropeSpec.from_config(tiny_llava("sdpa").config)
    assert (spec.flat, spec.image_tokens, spec.image_shape) == (True, PER_IMAGE, (3, 28, 28))
    collate = MultimodalCollator(spec, 0)
    rows = samples()[:3]
    row = {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
        "pixel_values": rows[0]["pixel_values"],  # 1 image for 3 runs
    }
    with pytest.raises(PackingError, match="holds 1 image"):
        collate([row])
    cut = dict(
        rows[0], input_ids=rows[0]["input_ids"][:-5], seq_lengths=[7]
    )  # 2 of the image's 4 tokens left
    with pytest.raises(PackingError, match="runs of"):
        collate([cut])
    with pytest.raises(PackingError, match="image_grid_thw"):
        collate([dict(rows[0], seq_lengths=[12], image_grid_thw=[[1, 2, 2]])])


def test_a_hand_built_llava_spec_takes_images_of_any_size_but_checks_their_count():
    # image_shape None (a spec built by hand, like patch_width) is not checked: every image was refused before.
    collate = MultimodalCollator(MropeSpec("llava", IMAGE, None, 1, image_tokens=2), 0, return_tensors="np")
    row = {
        "input_ids": [5, IMAGE, IMAGE, 6],
        "seq_lengths": [4],
        "pixel_values": np.ones((1, 3, 8, 8), np.float32),
    }
    assert collate([row])["pixel_values"].shape == (1, 3, 8, 8)
    with pytest.raises(PackingError, match="holds 2 image"):
        collate([dict(row, pixel_values=np.ones((2, 3, 8, 8), np.float32))])
    with pytest.raises(PackingError, match="float images"):
        collate([dict(row, pixel_values=np.ones((1, 192), np.float32))])


def test_internvl_spec_counts_tokens_after_the_pixel_shuffle():
    spec = MropeSpec.from_config(tiny_internvl("sdpa").config)
    assert (spec.flat, spec.image_tokens, spec.image_shape) == (True, PER_IMAGE, (3, 56, 56))


def test_llava_with_another_vision_tower_or_strategy_is_refused():
    from types import SimpleNamespace

    def config(tower: str, strategy: str) -> SimpleNamespace:
        vision = SimpleNamespace(model_type=tower, image_size=28, patch_size=14)
        return SimpleNamespace(
            model_type="llava",
            vision_config=vision,
            image_token_id=IMAGE,
            vision_feature_select_strategy=strategy,
        )

    assert (
        MropeSpec.from_config(config("siglip_vision_model", "full")).image_tokens == PER_IMAGE
    )  # no class token
    assert MropeSpec.from_config(config("siglip_vision_model", "default")).image_tokens == PER_IMAGE - 1
    assert MropeSpec.from_config(config("clip_vision_model", "full")).image_tokens == PER_IMAGE + 1
    with pytest.raises(PackingError, match="vision_feature_select_strategy"):
        MropeSpec.from_config(config("clip_vision_model", "other"))
    with pytest.raises(PackingError, match="pixtral"):  # images of any size: a token count per image
        MropeSpec.from_config(config("pixtral", "default"))


def test_pack_dataset_refuses_patch_rows_that_lost_their_image_grid():
    # Qwen-VL rows (pixel_values one patch a line) whose image_grid_thw column was dropped packed without a word:
    # rows without the grid are taken as LLaVA-style images since vlm47, and only the collator refused them.
    patches = [
        {"input_ids": [5, IMAGE, 6], "pixel_values": np.ones((4, 24), np.float32).tolist()},
        {"input_ids": [7, 8]},
    ]
    with pytest.raises(PackingError, match=r"2-D values per sample but there is no 'image_grid_thw'"):
        pack_dataset(datasets.Dataset.from_list(patches), 16)
    images = samples()  # LLaVA-style rows (4-D per sample) still pack, their images whole
    packed = pack_dataset(datasets.Dataset.from_list(images), 48)
    assert sum(len(r["pixel_values"]) for r in packed) == sum(len(s.get("pixel_values", [])) for s in images)
