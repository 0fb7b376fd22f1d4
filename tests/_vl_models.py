"""Tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL models built from configs, and multimodal samples for the tests."""

from __future__ import annotations

import numpy as np
import pytest
from _hf_models import tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
IMAGE, VIDEO, VSTART, VEND = 120, 121, 122, 123
PATCH, MERGE, TEMPORAL = 2, 2, 2
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _text(family: str) -> dict:
    text = tiny_config(
        None, hidden_size=32, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2
    )
    if family == "qwen3_vl":
        text.update(
            head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
    else:
        text.update(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        )
    return text


def _vision(family: str, patch: int = PATCH) -> dict:
    common = dict(patch_size=patch, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3)
    if family == "qwen2_vl":
        return dict(common, depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    # Qwen2.5-VL's and Qwen3-VL's vision towers: an MLP and a projection to the text width on top
    newer = dict(common, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    if family == "qwen2_5_vl":
        return dict(newer, window_size=8, fullatt_block_indexes=[1])
    return dict(newer, num_position_embeddings=64, deepstack_visual_indexes=[0])


def config(family: str, impl: str = "sdpa", patch: int = PATCH):
    cls = {
        "qwen2_vl": transformers.Qwen2VLConfig,
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
        "qwen3_vl": transformers.Qwen3VLConfig,
    }[family]
    cfg = cls(
        text_config=_text(family),
        vision_config=_vision(family, patch),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )
    cfg._attn_implementation = impl
    for sub in ("text_config", "vision_config"):
        getattr(cfg, sub)._attn_implementation = impl
    return cfg


def tiny_vl(family: str, impl: str = "sdpa", seed: int = 0, patch: int = PATCH):
    """A 2-layer model of ``family`` with random fp32 weights (text and vision towers)."""
    torch.manual_seed(seed)
    cls = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }[family]
    return cls(config(family, impl, patch)).float()


def image_sample(rng: np.random.Generator, grids: list[tuple[int, int, int]], text: int = 5) -> dict:
    """A processed sample: text, then each image as <vstart> image tokens <vend>, then text; random pixels."""
    ids: list[int] = list(rng.integers(3, 100, text))
    patches = []
    for t, h, w in grids:
        ids += [VSTART] + [IMAGE] * (t * h * w // (MERGE * MERGE)) + [VEND]
        ids += list(rng.integers(3, 100, int(rng.integers(1, 4))))
        patches.append(rng.standard_normal((t * h * w, 3 * TEMPORAL * PATCH * PATCH)).astype(np.float32))
    row = {"input_ids": [int(i) for i in ids]}
    if grids:
        row["pixel_values"] = np.concatenate(patches)
        row["image_grid_thw"] = np.asarray(grids, np.int64)
    return row


def mixed_samples(seed: int = 0) -> list[dict]:
    """Samples with 0, 1 and 3 images of different sizes, and text-only ones."""
    rng = np.random.default_rng(seed)
    return [
        image_sample(rng, [(1, 4, 6)], text=4),
        image_sample(rng, [], text=9),
        image_sample(rng, [(1, 2, 2), (1, 6, 4), (1, 4, 4)], text=3),
        image_sample(rng, [(1, 2, 4)], text=6),
        image_sample(rng, [], text=5),
    ]


SPECIALS = [
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
]
WORDS = [
    "<unk>",
    "<pad>",
    "</s>",
    "user",
    "assistant",
    "what",
    "is",
    "this",
    "a",
    "cat",
    "dog",
    "and",
    "here",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %} <|vision_start|><|image_pad|><|vision_end|> "
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
)


def processor_folder(path) -> str:
    """A Qwen2-VL processor folder built offline: the PIL image processor from its defaults (14-pixel patches,
    merge 2), a word-level tokenizer whose vision tokens have the ids of the tiny models' configs, a chat
    template that renders image parts as Qwen's placeholder."""
    import json
    import os

    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(IMAGE - len(WORDS))]
    vocab = {w: i for i, w in enumerate(words + SPECIALS)}
    assert vocab["<|image_pad|>"] == IMAGE and vocab["<|vision_end|>"] == VEND
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
        additional_special_tokens=SPECIALS,
    )  # fmt: skip
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(path)
    cfg_path = os.path.join(path, "preprocessor_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(
        image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor"
    )  # as saved by the hub's
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return str(path)
