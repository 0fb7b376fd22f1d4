"""TRL's vision format (messages with image parts + images) through a local processor folder, then packed."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import os

import numpy as np
import pytest
from _vl_models import IMAGE, processor_folder, tiny_vl, torch, transformers

from packtools import pack_dataset
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError
from packtools.integrations.attention.mixers import run_mixers_per_document
from packtools.integrations.multimodal.processor import load_vision_processor, process_vision_dataset

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")


def _image(rng, h, w):
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def _rows(tmp_path):
    """Samples with 0, 1 and 3 images given as a path, PNG bytes and a PIL image."""
    rng = np.random.default_rng(0)
    path = os.path.join(tmp_path, "a.png")
    _image(rng, 60, 90).save(path)
    buf = io.BytesIO()
    _image(rng, 56, 56).save(buf, format="PNG")
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    img = {"type": "image"}
    answer = {"role": "assistant", "content": [text("a cat")]}
    return [
        {"messages": [user(img, text("what is this")), answer], "images": [path]},
        {"messages": [user(text("here is a dog")), answer], "images": []},
        {"messages": [user(img, text("and"), img, text("and"), img), answer],
         "images": [buf.getvalue(), path, _image(rng, 112, 56)]},
    ]  # fmt: skip


def _dataset(rows):
    """Rows as a Dataset whose images column is datasets' Image type (paths, bytes and PIL images mixed)."""
    messages = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows]).features["messages"]
    features = datasets.Features({"messages": messages, "images": datasets.List(datasets.Image())})
    return datasets.Dataset.from_dict(
        {"messages": [r["messages"] for r in rows], "images": [r["images"] for r in rows]}, features=features
    )


def test_processor_folder_rows_equal_the_image_processor_and_the_placeholder_rule(tmp_path):
    folder = processor_folder(tmp_path / "proc")
    vp = load_vision_processor(folder)
    assert vp.image_token_id == IMAGE and vp.merge_size == 2
    if (
        importlib.util.find_spec("torchvision") is None
    ):  # transformers 5.25 builds no Qwen-VL processor without it
        assert vp.processor is None and type(vp.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    rows = _rows(tmp_path)
    done = process_vision_dataset(_dataset(rows), folder)
    paths_only = process_vision_dataset(
        datasets.Dataset.from_list(rows[:2]), folder
    )  # a column of path strings
    assert paths_only[:] == done.select([0, 1])[:]
    assert set(done.column_names) == {
        "input_ids",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
        "assistant_masks",
    }
    own = transformers.AutoImageProcessor.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    for raw, got in zip(rows, done):
        ids = np.asarray(got["input_ids"])
        images = [
            Image.open(io.BytesIO(v))
            if isinstance(v, bytes)
            else (Image.open(v) if isinstance(v, str) else v)
            for v in raw["images"]
        ]
        text = tok.apply_chat_template(raw["messages"], tokenize=False)
        single = np.asarray(tok(text)["input_ids"])  # one placeholder per image
        is_img = ids == IMAGE
        starts = np.flatnonzero(is_img & ~np.concatenate([[False], is_img[:-1]]))
        kept = ids[~is_img | np.isin(np.arange(len(ids)), starts)]
        assert np.array_equal(kept, single)  # the text is the template's, each placeholder expanded in place
        if images:
            feats = own(images=images, return_tensors="np")
            assert np.array_equal(np.asarray(got["image_grid_thw"]), feats["image_grid_thw"])
            assert np.array_equal(np.asarray(got["pixel_values"], np.float32), feats["pixel_values"])
            counts = feats["image_grid_thw"].prod(axis=1) // 4
            assert int(is_img.sum()) == int(counts.sum()) and len(starts) == len(images)
        else:
            assert not is_img.any() and len(got["pixel_values"]) == 0
        assert np.array_equal(np.asarray(got["mm_token_type_ids"]), is_img.astype(int))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_pack_dataset_with_processor_trains_like_one_by_one(tmp_path, family):
    # every family at the processor's 14-pixel patches (tiny Qwen2.5-VL's window once divided by zero there)
    from test_vision_train import _loss, one_by_one

    folder = processor_folder(tmp_path / "proc")
    rows = _rows(tmp_path) * 2
    packed = pack_dataset(_dataset(rows), 128, processor=folder)
    assert len(packed) < len(rows) and max(len(r) for r in packed["seq_lengths"]) > 1
    model = tiny_vl(family, "sdpa", patch=14)
    run_mixers_per_document(model)  # Qwen3.5's DeltaNet layers per document (nothing on the others)
    batch = MultimodalCollator(model, 0)(list(packed))
    done = process_vision_dataset(_dataset(rows), folder)
    samples = []
    for r in done:
        s = {"input_ids": r["input_ids"], "assistant_masks": r["assistant_masks"]}
        if len(r["image_grid_thw"]):
            s["pixel_values"] = np.asarray(r["pixel_values"], np.float32)
            s["image_grid_thw"] = np.asarray(r["image_grid_thw"])
        samples.append(s)
    ref, _ = one_by_one(copy.deepcopy(model), samples)  # assistant turns only: text chat's default
    assert abs(_loss(model.eval(), batch) - ref) < 1e-5
    every = MultimodalCollator(model, 0, assistant_only_loss=False)(list(packed))  # the switch: all text
    ref_all, _ = one_by_one(
        copy.deepcopy(model), [{k: v for k, v in s.items() if k != "assistant_masks"} for s in samples]
    )
    assert abs(_loss(model.eval(), every) - ref_all) < 1e-5
    assert abs(ref_all - ref) > 1e-3  # negative control: the two rules train different tokens
    assert torch.equal(
        batch["image_grid_thw"].sum(0),
        torch.as_tensor(np.concatenate([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])).sum(
            0
        ),
    )


def test_refusals(tmp_path):
    folder = processor_folder(tmp_path / "proc")
    rows = _rows(tmp_path)
    bad = [{**rows[0], "images": rows[0]["images"] * 2}]
    with pytest.raises(PackingError, match="row 0: its messages hold 1 image part"):
        process_vision_dataset(_dataset(bad), folder)
    with pytest.raises(PackingError, match="not a folder"):
        load_vision_processor("Qwen/Qwen2-VL-2B-Instruct")  # a hub id: never downloaded
    with pytest.raises(PackingError, match="cannot open image"):
        process_vision_dataset(
            datasets.Dataset.from_list([{**rows[0], "images": [str(tmp_path / "none.png")]}]), folder
        )


def test_profile_lengths_count_image_tokens_without_processing_pixels(tmp_path):
    from packtools import profile_lengths
    from packtools.integrations.multimodal.processor import vision_lengths

    folder = processor_folder(tmp_path / "proc")
    ds = _dataset(_rows(tmp_path))
    lengths = vision_lengths(ds, folder)
    done = process_vision_dataset(ds, folder)
    assert lengths.tolist() == [len(r) for r in done["input_ids"]]
    assert (lengths > [len(r) - int(np.sum(np.asarray(r) == IMAGE)) for r in done["input_ids"]]).sum() == 2
    assert profile_lengths(lengths).lengths.tolist() == lengths.tolist()


def test_a_literal_image_placeholder_in_the_text_is_refused_by_message(tmp_path):
    # the processor expands every placeholder of the rendered text: a text part holding "<|image_pad|>" took the
    # row's image at the text's spot (no image part, one image: packed without a word), or, beside an image
    # part, was refused as "2 image part(s)" when the messages hold one
    from packtools.integrations.multimodal.processor import process_vision_sample

    vp = load_vision_processor(processor_folder(tmp_path / "proc"))
    image = _image(np.random.default_rng(0), 28, 28)
    answer = {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}
    literal = {"type": "text", "text": f"what {vp.image_token} is"}
    for parts, images in (([literal], [image]), ([{"type": "image"}, literal], [image])):
        messages = [{"role": "user", "content": parts}, answer]
        with pytest.raises(PackingError, match=r"row 3: message 0 holds the image placeholder .* literally"):
            process_vision_sample(vp, messages, images, 3)
    say = [{"role": "user", "content": f"say {vp.image_token}"}, answer]
    with pytest.raises(PackingError, match="message 0 holds the image placeholder"):
        process_vision_sample(vp, say, [], 0)
    # the same words without the placeholder pack
    fine = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is"}]}, answer]
    assert process_vision_sample(vp, fine, [image], 0)["image_grid_thw"].shape == (1, 3)


def test_pack_dataset_with_a_processor_names_what_it_got_and_the_fix(tmp_path):
    # the docs write pack_dataset(rows, ..., processor=DIR): a list of rows was refused as "processor= needs a
    # Dataset or DatasetDict." without what was given or how to build one
    rows = [{"messages": [{"role": "user", "content": "hi"}], "images": []}]
    with pytest.raises(PackingError, match=r"got list.*datasets\.Dataset\.from_list\(rows\)") as err:
        pack_dataset(rows, 64, processor=processor_folder(tmp_path / "proc"))
    assert err.value.param == "dataset"


_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


def _llava_folder(path):
    """A LLaVA processor folder (LlavaProcessor.save_pretrained: CLIP's image processor, a trained tokenizer)."""
    from packtools.testing import tiny_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer(str(path), chat_template=_TEMPLATE))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ip = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    transformers.LlavaProcessor(
        image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        chat_template=_TEMPLATE,
    ).save_pretrained(str(path))  # fmt: skip
    return str(path)


def _internvl_folder(path):
    """An InternVL processor folder as saved by InternVLProcessor (its video processor needs torchvision, not
    installed here: the parts, each saved with save_pretrained, and its processor_config.json)."""
    from packtools.testing import tiny_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer(str(path), chat_template=_TEMPLATE))
    tok.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>"]})
    tok.save_pretrained(str(path))
    transformers.GotOcr2ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(str(path))
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "InternVLProcessor", "image_seq_length": 4}, f)
    return str(path)


@pytest.mark.parametrize("make", [_llava_folder, _internvl_folder], ids=["llava", "internvl"])
def test_llava_and_internvl_processor_folders_are_refused_with_the_processed_rows_route(
    tmp_path, make, capsys
):
    """pack --processor reads Qwen-VL processor folders only: a LLaVA or InternVL one stops before any row is
    processed, naming its image processor and how such rows pack (already processed, pack_dataset)."""
    from packtools.cli.main import main

    folder = make(tmp_path / "proc")
    with pytest.raises(
        PackingError, match=r"image processor \(\w+\) has no merge_size.*LLaVA and InternVL rows"
    ):
        load_vision_processor(folder)
    with pytest.raises(PackingError, match="has no merge_size"):
        pack_dataset(_dataset(_rows(tmp_path)), 256, processor=folder)
    rows = tmp_path / "rows.jsonl"
    image = os.path.join(tmp_path, "a.png")
    _image(np.random.default_rng(0), 30, 40).save(image)
    msg = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}
    rows.write_text(json.dumps({"messages": [msg], "images": [image]}) + "\n")
    assert main(
        ["pack", "--processor", folder, str(rows), "--out", str(tmp_path / "out"), "--max-length", "64"]
    )
    assert "has no merge_size" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "manifest.json")
