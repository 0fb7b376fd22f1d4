"""Tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL models and their processor folder (``packtools.testing``'s, re-exported
under the tests' names), and multimodal samples for the tests."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools.testing import (  # noqa: E402, F401
    IMAGE,
    MERGE,
    PATCH,
    TEMPORAL,
    VIDEO,
)
from packtools.testing import VISION_END as VEND  # noqa: E402, F401
from packtools.testing import VISION_START as VSTART  # noqa: E402, F401
from packtools.testing import VL_FAMILIES as FAMILIES  # noqa: E402, F401
from packtools.testing import tiny_processor as processor_folder  # noqa: E402, F401
from packtools.testing import tiny_vl_model as tiny_vl  # noqa: E402, F401


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
