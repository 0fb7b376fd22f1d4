"""LLaVA-NeXT and LLaVA-OneVision (any-resolution images: a base tile and a grid of tiles chosen from each image's
original size, so a different number of tokens each) trained packed through Trainer + prepare_trainer +
MultimodalCollator equal the samples run one by one (loss and every gradient, sdpa and eager, CPU fp32); the
packed rows come from ``pack_dataset``.  The token count packtools computes from the config
(``packtools.batches.mrope.anyres_image_tokens``) is checked against each model's processor, whose expanded
prompts hold that many ``<image>`` tokens.  Refused by name on main.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from test_vision_llava import trainer_step_equals_one_by_one as llava_step

from packtools import pack_dataset
from packtools.batches.mrope import MropeSpec, anyres_image_tokens, anyres_tiles
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

IMAGE, VIDEO = 299, 298  # the tiny models' image and video tokens (vocabulary of 300)
GRID = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]


def tiny_config(kind: str, impl: str = "sdpa", patch: int = 14, aspect: str = "anyres_max_9"):
    text = dict(
        model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
        patch_size=patch,
    )  # fmt: skip
    if kind == "llava_next":
        config = transformers.LlavaNextConfig(
            text_config=text, vision_config={**vision, "model_type": "clip_vision_model"}, image_token_index=IMAGE,
            image_grid_pinpoints=GRID, vision_feature_layer=-1,
        )  # fmt: skip
    else:
        config = transformers.LlavaOnevisionConfig(
            text_config=text, vision_config={**vision, "model_type": "siglip_vision_model"},
            image_token_index=IMAGE, video_token_index=VIDEO, image_grid_pinpoints=GRID, vision_feature_layer=-1,
            vision_aspect_ratio=aspect,
        )  # fmt: skip
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = impl
    return config


def tiny(kind: str, impl: str = "sdpa", **config):
    torch.manual_seed(0)
    cls = (
        transformers.LlavaNextForConditionalGeneration
        if kind == "llava_next"
        else transformers.LlavaOnevisionForConditionalGeneration
    )
    return cls(tiny_config(kind, impl, **config)).float()


def processor(kind: str, patch: int, aspect: str = "anyres_max_9"):
    """The model's own processor, built offline: a word tokenizer with ``<image>``, the PIL image processor."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("PIL")
    vocab = {"<pad>": 0, "<eos>": 1, "<image>": 2, "<video>": 3, "hi": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
    )
    sizes = dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=GRID)
    if kind == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        return transformers.LlavaNextProcessor(
            image_processor=LlavaNextImageProcessorPil(**sizes), tokenizer=tokenizer, patch_size=patch,
            vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token="<image>",
        )  # fmt: skip
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    # transformers 5.25 cannot build LlavaOnevisionProcessor without torchvision (its video processor); its image
    # processor and its own prompt expansion (replace_image_token, an image's "<image>" * count) run on this one
    cls = transformers.LlavaOnevisionProcessor
    proc = types.SimpleNamespace(
        image_processor=LlavaOnevisionImageProcessorPil(**sizes), num_image_tokens=(28 // patch) ** 2,
        vision_feature_select_strategy="full", image_token="<image>", vision_aspect_ratio=aspect,
    )  # fmt: skip
    for name in ("replace_image_token", "_get_number_of_features", "_get_unpadded_features"):
        setattr(proc, name, types.MethodType(getattr(cls, name), proc))

    def expand(text, images, return_tensors):
        inputs = proc.image_processor(images, return_tensors=return_tensors)
        count = sum(
            proc.replace_image_token(inputs, j).count("<image>") for j in range(len(inputs["image_sizes"]))
        )
        return {**inputs, "input_ids": np.full((1, count), 2)}

    return expand


@pytest.mark.parametrize(
    ("kind", "patch", "aspect"),
    [
        ("llava_next", 14, None),
        ("llava_next", 7, None),
        ("llava_onevision", 14, "anyres_max_9"),
        ("llava_onevision", 7, "anyres_max_9"),
        ("llava_onevision", 7, "anyres_max_1"),  # pooled past one tile's features
        ("llava_onevision", 4, "anyres_max_2"),
    ],
)
def test_image_tokens_from_the_config_equal_the_processors_expanded_prompt(kind, patch, aspect):
    from PIL import Image

    extra = {} if aspect is None else {"aspect": aspect}
    grid = MropeSpec.from_config(tiny_config(kind, patch=patch, **extra)).anyres
    proc = processor(kind, patch, **extra)
    rng = np.random.default_rng(patch)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 200, (40, 2))] + [
        (28, 28),
        (1, 150),
        (150, 1),
        (84, 28),
    ]
    pooled = 0  # images whose features OneVision pools (vision_aspect_ratio)
    for h, w in sizes:
        image = Image.fromarray(np.zeros((h, w, 3), np.uint8))
        out = proc(text=["hi <image> hi"], images=[image], return_tensors="np")
        assert int((out["input_ids"] == 2).sum()) == anyres_image_tokens(grid, h, w), (h, w)
        assert out["image_sizes"].tolist() == [[h, w]]
        assert out["pixel_values"].shape[1] == anyres_tiles(grid, h, w), (h, w)
        unpooled = anyres_image_tokens(dataclasses.replace(grid, max_tiles=None), h, w)
        pooled += anyres_image_tokens(grid, h, w) < unpooled
    assert (pooled > 0) == (aspect in ("anyres_max_1", "anyres_max_2")), pooled  # the pooling is exercised
    if kind == "llava_onevision":  # a sample of several images: each its base tile and a newline
        images = [Image.fromarray(np.zeros((h, w, 3), np.uint8)) for h, w in sizes[:3]]
        out = proc(text=["hi <image> hi <image> <image>"], images=[images], return_tensors="np")
        assert int((out["input_ids"] == 2).sum()) == 3 * anyres_image_tokens(grid, 9, 9, tiled=False)
        assert out["pixel_values"].shape[1] == 1 and out["batch_num_images"].tolist() == [3]


def samples(kind: str, seed: int = 0, one_by_one: bool = False) -> list[dict]:
    """Samples as the processor gives them: 1, 0, 2, 1 and 0 images of different sizes, pixel_values
    (images, tiles, 3, 28, 28) padded to the sample's most tiles, image_sizes, OneVision's batch_num_images
    (``one_by_one``: a sample's images given to OneVision's processor one by one, [1, 1], each tiled)."""
    grid = MropeSpec.from_config(tiny_config(kind)).anyres
    rng = np.random.default_rng(seed)
    out = []
    for sizes, words in (([(30, 70)], 5), ([], 9), ([(56, 56), (20, 90)], 4), ([(90, 20)], 11), ([], 6)):
        tiled = len(sizes) == 1 or kind == "llava_next" or one_by_one
        ids = rng.integers(3, 290, words).tolist()
        for h, w in sizes:
            ids += [IMAGE] * anyres_image_tokens(grid, h, w, tiled) + rng.integers(3, 290, 3).tolist()
        row = {"input_ids": ids}
        if sizes:
            most = max(anyres_tiles(grid, h, w, tiled) for h, w in sizes)
            pixels = rng.standard_normal((len(sizes), most, 3, 28, 28)).astype(np.float32)
            for j, (h, w) in enumerate(sizes):  # the processor pads a sample's images to its most tiles
                pixels[j, anyres_tiles(grid, h, w, tiled) :] = 0
            row.update(pixel_values=pixels.tolist(), image_sizes=[list(s) for s in sizes])
            if kind == "llava_onevision":
                row["batch_num_images"] = [1] * len(sizes) if one_by_one else [len(sizes)]
        out.append(row)
    return out


def one_by_one(model, rows: list[dict]) -> tuple[float, dict]:
    model.zero_grad()
    total = sum(int((np.asarray(s["input_ids"][1:]) != IMAGE).sum()) for s in rows)
    loss = 0.0
    for s in rows:
        ids = torch.tensor([s["input_ids"]])
        extra = {k: torch.tensor(s[k]) for k in ("pixel_values", "image_sizes", "batch_num_images") if k in s}
        out = model(
            input_ids=ids, labels=ids.masked_fill(ids == IMAGE, -100), use_cache=False, num_items_in_batch=total,
            **extra,
        )  # fmt: skip
        out.loss.backward()
        loss += float(out.loss.detach())
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def trainer_step_equals_one_by_one(model, rows: list[dict], tmp_path, sft: bool = False) -> None:
    """``tests/test_vision_llava.py``'s step, with this file's rows, lengths and reference."""
    packed, grads = llava_step(
        model, rows, tmp_path, sft, max_length=160, alone=one_by_one, tower="vision_tower"
    )
    assert len(packed) < len(rows)  # documents with images share rows
    assert sum(len(r["image_sizes"] or []) for r in packed) == 4
    assert float(grads["model.image_newline"].abs().max()) > 0  # newline tokens placed and learned


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_packed_training_step_equals_one_by_one(kind, impl, tmp_path):
    trainer_step_equals_one_by_one(tiny(kind, impl), samples(kind), tmp_path)


def test_onevision_images_processed_one_by_one_are_each_tiled(tmp_path):
    # a sample's two images given to the processor as a flat list: batch_num_images [1, 1], each image tiled (its
    # own count); the collator passes the rows' entries, so the model tiles them as the processor did
    trainer_step_equals_one_by_one(
        tiny("llava_onevision"), samples("llava_onevision", one_by_one=True), tmp_path
    )


def test_llava_next_through_sft_trainer_keeps_image_sizes(tmp_path):
    # SFTTrainer's remove_unused_columns keeps input_ids, labels, seq_lengths: image_sizes and the pixels are kept
    trainer_step_equals_one_by_one(tiny("llava_next"), samples("llava_next"), tmp_path, sft=True)


def packed_row(kind: str, chosen=(0, 1, 2)) -> dict:
    rows = [samples(kind)[i] for i in chosen]
    row = {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
    }
    images = [s for s in rows if "image_sizes" in s]
    row["pixel_values"] = [image for s in images for image in s["pixel_values"]]
    row["image_sizes"] = sum((s["image_sizes"] for s in images), [])
    if kind == "llava_onevision":
        row["batch_num_images"] = sum((s["batch_num_images"] for s in images), [])
    return row


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_batch_pads_tiles_to_the_most_and_keeps_images_in_order(kind):
    grid = MropeSpec.from_config(tiny_config(kind)).anyres
    row = packed_row(kind)
    batch = MultimodalCollator(tiny_config(kind), 0, return_tensors="np")([row])
    tiled = [True, True, True] if kind == "llava_next" else [True, False, False]
    need = [anyres_tiles(grid, h, w, t) for (h, w), t in zip(row["image_sizes"], tiled)]
    assert batch["pixel_values"].shape == (3, max(need), 3, 28, 28)
    for j, n in enumerate(need):
        assert np.array_equal(batch["pixel_values"][j, :n], np.asarray(row["pixel_values"][j])[:n])
        assert not batch["pixel_values"][j, n:].any()
    assert batch["image_sizes"].tolist() == row["image_sizes"]
    assert ("batch_num_images" in batch) == (kind == "llava_onevision")
    if kind == "llava_onevision":
        assert batch["batch_num_images"].tolist() == [1, 2]
    assert np.all(batch["labels"][0][np.asarray(row["input_ids"]) == IMAGE] == -100)
    starts = np.cumsum([0, *row["seq_lengths"][:-1]])
    assert batch["position_ids"][0, starts].tolist() == [0, 0, 0]


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_rows_whose_image_tokens_do_not_match_their_sizes_are_refused(kind):
    collate = MultimodalCollator(tiny_config(kind), 0)
    row = packed_row(kind)
    # one image token too few in the first document: the model would place features on other tokens (or fail)
    cut = dict(row, input_ids=row["input_ids"][:5] + row["input_ids"][6:], seq_lengths=[row["seq_lengths"][0] - 1, *row["seq_lengths"][1:]])  # fmt: skip
    with pytest.raises(PackingError, match=r"row 0, document 0: its image tokens .* form runs of"):
        collate([cut])
    # the same tokens with another image's size: a different count, refused by row
    swapped = dict(row, image_sizes=[[56, 56], *row["image_sizes"][1:]])
    with pytest.raises(PackingError, match=r"row 0, document 0.*image_sizes"):
        collate([swapped])
    # image_sizes missing (a trainer's remove_unused_columns, a dataset without it): refused by name
    bare = {k: v for k, v in row.items() if k != "image_sizes"}
    with pytest.raises(PackingError, match=r"row 0 has \d+ image tokens but no 'image_sizes'"):
        collate([bare])
    # fewer tiles than the image's size needs
    short = dict(row, pixel_values=[np.asarray(row["pixel_values"][0])[:1], *row["pixel_values"][1:]])
    with pytest.raises(PackingError, match=r"image 0 .* has 1 tile"):
        collate([short])
    # an image without its pixels
    with pytest.raises(PackingError, match="holds 2 image"):
        collate([dict(row, pixel_values=row["pixel_values"][1:])])


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_an_image_whose_tokens_are_split_by_text_is_refused(kind):
    # its run of tokens cut in two by a text token (the count unchanged) collated with no error: the model put the
    # image's features around the text token, its rows of features shifted by one
    row = packed_row(kind, chosen=(0,))
    ids = list(row["input_ids"])
    first = ids.index(IMAGE)
    cut = dict(row, input_ids=ids[: first + 3] + [7] + ids[first + 3 :], seq_lengths=[len(ids) + 1])
    with pytest.raises(PackingError, match=r"row 0, document 0: its image tokens .* runs of \[3, "):
        MultimodalCollator(tiny_config(kind), 0)([cut])
    # two images with no text between them (one run) still pass: each ends where the run does
    rows = samples(kind)
    both = rows[2]
    ids = list(both["input_ids"])
    last = len(ids) - 1 - ids[::-1].index(IMAGE)  # the second image's run ends at `last`; its 3 words follow
    start = last
    while ids[start - 1] == IMAGE:
        start -= 1
    adjacent = ids[: start - 3] + ids[start:]  # the 3 words between the two images dropped
    row = {k: v for k, v in both.items()}
    row.update(input_ids=adjacent, seq_lengths=[len(adjacent)])
    assert MultimodalCollator(tiny_config(kind), 0)([row])["image_sizes"].tolist() == both["image_sizes"]


def test_any_resolution_rows_reaching_a_tile_or_llava_collator_are_refused_by_name():
    # a packed row's images of different tile counts failed in numpy ("inhomogeneous shape"), naming no row
    from test_vision_idefics3 import tiny as tiny_tiles
    from test_vision_llava import tiny_llava

    row = packed_row("llava_next")
    for model in (tiny_tiles("smolvlm", "sdpa"), tiny_llava("sdpa")):
        with pytest.raises(PackingError, match="row 0: 'pixel_values' holds images of different shapes"):
            MultimodalCollator(model, 0, leave_out=["image_sizes"])([row])


def test_onevision_needs_batch_num_images_and_refuses_videos():
    collate = MultimodalCollator(tiny_config("llava_onevision"), 0)
    row = packed_row("llava_onevision")
    with pytest.raises(PackingError, match="batch_num_images"):
        collate([{k: v for k, v in row.items() if k != "batch_num_images"}])
    # a sample of two images counted as two samples of one: each would be tiled, another count -> refused
    with pytest.raises(PackingError, match="batch_num_images"):
        collate([dict(row, batch_num_images=[1, 1, 1])])
    with pytest.raises(PackingError, match=r"video tokens \(id 298\)"):
        collate([dict(row, input_ids=[VIDEO, *row["input_ids"][1:]])])
    with pytest.raises(PackingError, match="video column"):
        collate([dict(row, pixel_values_videos=[[0.0]])])


def test_other_towers_strategies_and_grids_are_refused():
    config = tiny_config("llava_next")
    config.vision_feature_select_strategy = "full"  # CLIP's class token kept: a tile is not side² features
    with pytest.raises(PackingError, match="vision_feature_select_strategy 'full'"):
        MropeSpec.from_config(config)
    config = tiny_config("llava_next")
    config.image_grid_pinpoints = [[28, 30]]
    with pytest.raises(PackingError, match="image_grid_pinpoints"):
        MropeSpec.from_config(config)
    config = tiny_config("llava_onevision")
    config.vision_aspect_ratio = "anyres"
    with pytest.raises(PackingError, match="vision_aspect_ratio"):
        MropeSpec.from_config(config)


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_guarded_loop_of_ones_own_equals_one_by_one(kind):
    # guard_model refused these types' image inputs by name (unverified); a guarded forward of the collator's batch
    # now runs, and each document's logits equal the document alone through the model's own path
    from packtools.integrations.trainers.guard import guard_model

    model = tiny(kind).eval()
    rows = [samples(kind)[i] for i in (0, 1, 2)]
    with torch.no_grad():
        alone = [
            model(
                input_ids=torch.tensor([s["input_ids"]]), use_cache=False,
                **{k: torch.tensor(s[k]) for k in ("pixel_values", "image_sizes", "batch_num_images") if k in s},
            ).logits[0]
            for s in rows
        ]  # fmt: skip
        guard_model(model)
        batch = MultimodalCollator(model, 0)([packed_row(kind)])
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    at = 0
    for s, a in zip(rows, alone):
        assert float((packed[at : at + len(s["input_ids"])] - a).abs().max()) <= 1e-5
        at += len(s["input_ids"])


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_the_isolation_probe_passes(kind):
    # the probe packs samples of one image, none and two (OneVision's two untiled), each of its own size
    from packtools.integrations.multimodal.models import check_vision_isolation

    model = tiny(kind)
    report = check_vision_isolation(model, MultimodalCollator(model, 0))
    assert not report.leaks and "image_sizes" in report.keys
    assert ("batch_num_images" in report.keys) == (kind == "llava_onevision")


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_guard_model_refuses_a_packed_forward_without_image_sizes(kind):
    # a collator of one's own that drops image_sizes: the model failed inside its image path with a TypeError
    from packtools.integrations.trainers.guard import guard_model

    model = tiny(kind).eval()
    batch = MultimodalCollator(model, 0)([packed_row(kind)])
    batch.pop("labels")
    guard_model(model)
    with torch.no_grad():
        model(**batch)  # the collator's batch passes
        with pytest.raises(PackingError, match="pixel_values but no image_sizes"):
            model(**{k: v for k, v in batch.items() if k != "image_sizes"})


def test_pack_dataset_refuses_tiles_without_their_image_sizes():
    rows = samples("llava_next")
    with pytest.raises(PackingError, match=r"5-D values per sample .* no 'image_sizes' column"):
        pack_dataset(
            datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "image_sizes"} for r in rows]),
            160,
        )
    with pytest.raises(PackingError, match=r"leaves out \['image_sizes'\]"):
        pack_dataset(datasets.Dataset.from_list(rows), 160, columns=["input_ids", "pixel_values"])


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_pack_dataset_refuses_a_sample_whose_sizes_do_not_match_its_images(kind):
    # packed, a row's image_sizes are matched to its images by order alone: a sample holding a later sample's image
    # (and that one none) packed into one row collated with no error, the later sample's tokens reading the other's
    rows = samples(kind)
    first = dict(rows[0], pixel_values=rows[0]["pixel_values"] * 2)
    second = {k: v for k, v in rows[0].items() if k != "pixel_values"}
    with pytest.raises(
        PackingError, match=r"row 0: 'image_sizes' holds 1 sizes but 'pixel_values' holds 2 images"
    ):
        pack_dataset(datasets.Dataset.from_list([first, second]), 160)
    if kind == "llava_onevision":  # its counts of images per processor sample likewise
        rows[2]["batch_num_images"] = [1]
        with pytest.raises(
            PackingError, match=r"row 2: 'batch_num_images' counts 1 images but 'pixel_values' holds 2"
        ):
            pack_dataset(datasets.Dataset.from_list(rows), 160)
    rows = samples(kind)  # unchanged rows (samples without images among them) pack
    assert len(pack_dataset(datasets.Dataset.from_list(rows), 160)) < len(rows)


@pytest.mark.parametrize(
    ("kind", "aspect"),
    [
        ("llava_next", "anyres_max_9"),
        ("llava_onevision", "anyres_max_9"),
        ("llava_onevision", "anyres_max_1"),
    ],
)
def test_image_tokens_from_the_config_equal_the_models_features(kind, aspect):
    # the model's own count (its image features, newline tokens and OneVision's pooling included) for many sizes
    model = tiny(kind, aspect=aspect) if kind == "llava_onevision" else tiny(kind)
    grid = MropeSpec.from_config(model.config).anyres
    rng = np.random.default_rng(3)
    pooled = 0
    for h, w in [(int(h), int(w)) for h, w in rng.integers(1, 200, (12, 2))]:
        tiles = torch.randn(1, anyres_tiles(grid, h, w), 3, 28, 28)
        with torch.no_grad():
            features = model.model.get_image_features(
                tiles, torch.tensor([[h, w]]), return_dict=True
            ).pooler_output
        assert features[0].shape[0] == anyres_image_tokens(grid, h, w), (h, w)
        pooled += anyres_image_tokens(grid, h, w) < anyres_image_tokens(
            dataclasses.replace(grid, max_tiles=None), h, w
        )
    assert (pooled > 0) == (aspect == "anyres_max_1")
