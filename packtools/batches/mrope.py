"""Multimodal rotary positions (mRoPE) of packed vision-language rows, computed per document with NumPy.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 rotate each token by three positions (temporal, height, width).  Text tokens
get the same value in all three rows, counting on from the previous token; the ``t*h*w / merge²`` tokens of an
image get ``start + (t, h, w)`` over its merged grid, and the text after it continues at ``start + max(h, w)``
(grid sides divided by the merge size).  These positions are a pure function of a document's ``input_ids``,
its ``image_grid_thw`` rows and the vision config's ``spatial_merge_size``: no weights are needed.

A packed row must get each document's own positions, restarting at 0 for every document; the models compute
them only when ``position_ids`` is None, and then over the whole row.  :func:`row_positions` returns ``(4, T)``:
the text row (``0, 1, 2, ...`` restarting per document, what the text model's masks detect packed documents
from), then t/h/w (why this layout, and the negative controls: docs/vision.md).

Videos are refused by name (their temporal spacing differs per family); two images with no text token between
them are refused too (the models group consecutive image tokens as one image and fail on them).

LLaVA, InternVL, Gemma 3, Idefics3 and SmolVLM (:data:`FLAT_MODEL_TYPES`) have 1-D positions: its :class:`MropeSpec`
(``flat``) carries the tokens of one image (one tile, for Idefics3 and SmolVLM) and the pixel shape, and a packed row's
positions are the text row alone.  LLaVA-NeXT and LLaVA-OneVision (:data:`ANYRES_MODEL_TYPES`) too, but each image is
as many tokens as :func:`anyres_image_tokens` counts from its ``image_sizes`` (the spec's :class:`AnyresGrid`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PackingError

#: The multimodal model types (``config.model_type``) whose packed path packtools computes and has verified
#: against the model's own ``get_rope_index`` and one-by-one training (``tests/test_vision_*.py``).  Every other
#: multimodal model is refused by name (:func:`packtools.integrations.multimodal.models.check_multimodal_model`).
#: Of these, the LLaVA-style types: a language model with 1-D rotary positions over a fixed run of image tokens per
#: image (or InternVL tile), from a vision tower at one image size.  Their packed positions are the text row, restarting at every
#: document; the images travel in row order (``pixel_values`` ``(images, channels, size, size)``).
FLAT_MODEL_TYPES = ("llava", "internvl", "gemma3", "idefics3", "smolvlm")
#: The vision towers verified with each of :data:`FLAT_MODEL_TYPES` (one fixed image size, each image -- each
#: InternVL tile -- seen alone).
FLAT_VISION_TYPES = {
    "llava": ("clip_vision_model", "siglip_vision_model"),
    "internvl": ("internvl_vision",),
    "gemma3": ("siglip_vision_model",),
    "idefics3": ("idefics3_vision",),
    "smolvlm": ("smolvlm_vision",),
}
#: The ``vision_feature_select_strategy`` values verified with each of :data:`FLAT_MODEL_TYPES`.
FLAT_STRATEGIES = {"llava": ("default", "full"), "internvl": ("default",)}  # Gemma 3 has no strategy
#: Of :data:`FLAT_MODEL_TYPES`, those whose images attend bidirectionally within themselves (``token_type_ids``):
#: transformers builds their packed sliding-window masks wrong (:data:`IMAGE_BLOCK_REASON`), so
#: ``MultimodalCollator`` gives them each document's own masks ready-made (``attention_mask``, a dict by layer type
#: of boolean ``[1, 1, T, T]`` masks, which ``sdpa`` and ``packtools_sdpa`` read and ``eager`` cannot, or, on
#: ``packtools_sdpa``, of per-document ``DocumentBlockMask``s: ``image_masks``).
IMAGE_BLOCK_TYPES = ("gemma3",)
#: Of :data:`FLAT_MODEL_TYPES`, those whose images are tiles read with a ``pixel_attention_mask`` (Idefics3,
#: SmolVLM): the processor splits an image into ``image_size`` tiles plus a global one, each tile a run of
#: ``(image_size / patch_size)² / scale_factor²`` tokens between row/column tokens; the model takes ``pixel_values``
#: ``(batch, tiles, channels, size, size)`` and ``pixel_attention_mask`` ``(batch, tiles, size, size)`` and drops
#: all-zero tiles as padding.  Packed, a row's tiles are concatenated in document order under one batch entry
#: (measured exact on transformers 5.25: ``tests/test_vision_idefics3.py``).
TILE_MODEL_TYPES = ("idefics3", "smolvlm")
#: The vision-language types ``prepare_trainer`` switches from ``sdpa`` to ``packtools_sdpa`` as it does text models
#: (each document's attention on its own, no ``T x T`` mask): those measured exact on it with both towers switched,
#: their vision tower's calls carrying no ``cu_seq_lens`` (so they run as on ``sdpa``): Gemma 3 (its ready-made masks,
#: ``tests/test_vision_gemma3.py``), Idefics3 and SmolVLM (``tests/test_vision_idefics3.py``).  The other types stay
#: on ``sdpa`` (not verified on ``packtools_sdpa``).
SEGMENTED_SDPA_TYPES = (*IMAGE_BLOCK_TYPES, *TILE_MODEL_TYPES)
#: The attention implementations verified with the ready-made masks of :data:`IMAGE_BLOCK_TYPES`.
IMAGE_BLOCK_BACKENDS = ("sdpa", "packtools_sdpa")
#: Why :data:`IMAGE_BLOCK_TYPES` need their masks ready-made, measured on transformers 5.25.
IMAGE_BLOCK_REASON = (
    "transformers builds Gemma 3's sliding-window layers' mask over a packed row by looking up the bidirectional "
    "image blocks (from token_type_ids) at each document's own positions instead of the row's token indices, so "
    "from the second document on, image tokens lose their bidirectional attention and text tokens can attend "
    "ahead (a later document's logits 0.3 away from it run alone; exact with full-attention layers only)"
)
#: Whether each vision tower of :data:`FLAT_VISION_TYPES` puts a class token before its patches (CLIP does, SigLIP does
#: not): the ``"default"`` strategy drops the first token either way, so SigLIP's images are one token short.
_CLASS_TOKEN = {"clip_vision_model": 1, "siglip_vision_model": 0, "internvl_vision": 1}
#: Any-resolution LLaVA types: 1-D positions like :data:`FLAT_MODEL_TYPES`, but each image is a base tile plus a grid
#: of tiles picked from its original size (``image_sizes``), unpadded and ended by a newline token per row of features
#: (OneVision: pooled down past ``vision_aspect_ratio``'s tiles; an image of a sample of several is its base tile and
#: one newline), so a different number of tokens each (:func:`anyres_image_tokens`).  ``MultimodalCollator`` carries
#: ``image_sizes`` and ``pixel_values`` ``(images, tiles, channels, size, size)`` padded to the batch's most tiles.
ANYRES_MODEL_TYPES = ("llava_next", "llava_onevision")
#: The vision towers verified with each of :data:`ANYRES_MODEL_TYPES` (each tile's features are
#: ``(image_size / patch_size)²``: CLIP under ``"default"``, SigLIP under ``"full"``).
ANYRES_VISION_TYPES = {
    "llava_next": {"clip_vision_model": "default"},
    "llava_onevision": {"siglip_vision_model": "full"},
}
#: Qwen3.5 and Qwen3.5-MoE (``qwen3_5``, ``qwen3_5_moe``) place their positions as Qwen3-VL does; their text model
#: is a hybrid whose gated DeltaNet layers run per document (``packtools.integrations.attention.mixers``).
VERIFIED_MODEL_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    *FLAT_MODEL_TYPES,
    *ANYRES_MODEL_TYPES,
)
#: Why popular multimodal types outside :data:`VERIFIED_MODEL_TYPES` are refused, measured on transformers 5.25
#: (``tests/test_vision_refusals.py``); the refusals of :class:`MropeSpec` and ``prepare_trainer`` say it.
UNVERIFIED_REASONS = {
    "mistral3": (
        "Mistral 3's Pixtral tower reads images of any size (a different number of tokens each, with "
        "[IMG_BREAK] rows, from image_sizes), which MultimodalCollator does not carry or check."
    ),
}


def unverified_reason(model_type: Any) -> str:
    """The reason :data:`UNVERIFIED_REASONS` gives for ``model_type`` (with a leading space), or ``""``.

    >>> unverified_reason("qwen2_vl")
    ''
    """
    reason = UNVERIFIED_REASONS.get(model_type) if isinstance(model_type, str) else None
    return f" {reason}" if reason else ""


@dataclass(frozen=True)
class AnyresGrid:
    """How an any-resolution model (:data:`ANYRES_MODEL_TYPES`) tiles an image: tiles of ``tile`` pixels a side,
    each ``side x side`` features; the grid resolutions ``(height, width)`` it picks from; OneVision's most tiles
    before its features are pooled (``vision_aspect_ratio`` ``anyres_max_N``; ``None``: LLaVA-NeXT, never pooled)."""

    tile: int
    side: int
    pinpoints: tuple[tuple[int, int], ...]
    max_tiles: int | None = None


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The grid resolution an image of ``height x width`` is resized into: the one that keeps the most of its
    pixels once scaled to fit (never more than it has), then wastes the least area, the first of equals.

    >>> best_resolution(30, 70, [(28, 28), (28, 56), (56, 28), (56, 56)])
    (28, 56)
    """
    best, kept_most, waste_least = pinpoints[0], -1, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = h * w - kept
        if kept > kept_most or (kept == kept_most and waste < waste_least):
            best, kept_most, waste_least = (h, w), kept, waste
    return best


def anyres_tiles(grid: AnyresGrid, height: int, width: int, tiled: bool = True) -> int:
    """The tiles the vision tower reads for an image of ``height x width`` (its base tile, then the grid's);
    ``tiled=False`` (an image of a OneVision sample of several): its base tile alone.

    >>> anyres_tiles(AnyresGrid(28, 2, ((28, 28), (28, 56), (56, 28), (56, 56))), 30, 70)
    3
    """
    if not tiled:
        return 1
    h, w = best_resolution(height, width, grid.pinpoints)
    return -(-h // grid.tile) * -(-w // grid.tile) + 1


def anyres_image_tokens(grid: AnyresGrid, height: int, width: int, tiled: bool = True) -> int:
    """The ``<image>`` tokens of an image of ``height x width`` (its original size, ``image_sizes``): the base tile's
    ``side²`` features, then the grid's features cut back to the image's aspect ratio (the grid holds it resized
    to fit and centred), OneVision's pooled down when they pass ``max_tiles`` tiles by more than 10% in each
    direction, one newline token ending each row of them.  ``tiled=False``: the base tile and one newline.

    >>> grid = AnyresGrid(28, 2, ((28, 28), (28, 56), (56, 28), (56, 56)))
    >>> anyres_image_tokens(grid, 30, 70), anyres_image_tokens(grid, 56, 56), anyres_image_tokens(grid, 9, 9, False)
    (14, 24, 5)
    """
    base = grid.side * grid.side
    if not tiled:
        return base + 1
    best_h, best_w = best_resolution(height, width, grid.pinpoints)
    rows, cols = best_h // grid.tile * grid.side, best_w // grid.tile * grid.side
    if width * rows > cols * height:  # wider than the grid: the rows above and below it are padding
        rows -= (rows - height * cols // width) // 2 * 2
    else:
        cols -= (cols - width * rows // height) // 2 * 2
    if grid.max_tiles is not None:
        ratio = math.sqrt(rows * cols / (grid.max_tiles * base))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
    return base + rows * (cols + 1)


@dataclass(frozen=True)
class MropeSpec:
    """What the positions of one model family depend on: the vision token ids and the spatial merge size."""

    model_type: str
    image_token_id: int
    video_token_id: int | None
    spatial_merge_size: int
    #: values per patch in the ``pixel_values`` the vision tower reads (``in_channels * temporal_patch_size *
    #: patch_size**2``), so rows processed for another patch size are refused by name rather than crashing in
    #: the vision tower; ``None`` (a spec built by hand): not checked.  Not part of equality: it decides no
    #: position.
    patch_width: int | None = field(default=None, compare=False)
    #: :data:`FLAT_MODEL_TYPES` only: the tokens of one image and the ``(channels, size, size)`` of its pixels.
    image_tokens: int | None = None
    image_shape: tuple[int, int, int] | None = field(default=None, compare=False)
    #: :data:`IMAGE_BLOCK_TYPES` only: the text model's sliding window (``None``: no sliding layers).
    sliding_window: int | None = None
    #: :data:`ANYRES_MODEL_TYPES` only: how an image is tiled, so how many tokens it is (``image_tokens``: its base
    #: tile's; ``image_shape``: one tile's).
    anyres: AnyresGrid | None = None

    @property
    def flat(self) -> bool:
        """1-D positions (the text row): a LLaVA-style model (:data:`FLAT_MODEL_TYPES`, :data:`ANYRES_MODEL_TYPES`)."""
        return self.model_type in FLAT_MODEL_TYPES or self.model_type in ANYRES_MODEL_TYPES

    @property
    def tiles(self) -> bool:
        """Images are tiles read with a ``pixel_attention_mask`` (:data:`TILE_MODEL_TYPES`): the collator carries
        it, and gives ``pixel_values`` / ``pixel_attention_mask`` one batch entry of all the row's tiles."""
        return self.model_type in TILE_MODEL_TYPES

    @property
    def image_blocks(self) -> bool:
        """Images attend bidirectionally within themselves (:data:`IMAGE_BLOCK_TYPES`): the collator gives
        ``token_type_ids`` and each document's masks ready-made."""
        return self.model_type in IMAGE_BLOCK_TYPES

    def __post_init__(self) -> None:
        if self.model_type not in VERIFIED_MODEL_TYPES:
            raise PackingError(
                f"model_type {self.model_type!r}: packtools computes packed multimodal positions only for "
                f"{list(VERIFIED_MODEL_TYPES)}; other multimodal models are not verified."
                f"{unverified_reason(self.model_type)}",
                param="model_type",
            )
        if (self.model_type in ANYRES_MODEL_TYPES) != (self.anyres is not None):
            raise PackingError(
                f"model_type {self.model_type!r}: anyres (an AnyresGrid) is given for {list(ANYRES_MODEL_TYPES)} "
                f"and only for them, got {self.anyres!r}.",
                param="anyres",
            )
        if self.flat and (not isinstance(self.image_tokens, int) or self.image_tokens < 1):
            raise PackingError(
                f"model_type {self.model_type!r} needs image_tokens (the tokens of one image), got "
                f"{self.image_tokens!r}.",
                param="image_tokens",
            )
        if int(self.spatial_merge_size) < 1:
            raise PackingError(
                f"spatial_merge_size must be >= 1, got {self.spatial_merge_size!r}.",
                param="spatial_merge_size",
            )

    @classmethod
    def from_config(cls, config: Any) -> MropeSpec:
        """The spec of a transformers config (``Qwen2VLConfig``, ``Qwen2_5_VLConfig``, ``Qwen3VLConfig``,
        ``Qwen3_5Config``, ``Qwen3_5MoeConfig``, ``LlavaConfig``, ``InternVLConfig``, ``Gemma3Config``,
        ``Idefics3Config``, ``SmolVLMConfig``)."""
        model_type = getattr(config, "model_type", None)
        vision = getattr(config, "vision_config", None)
        image = getattr(config, "image_token_id", None)
        if model_type not in VERIFIED_MODEL_TYPES or vision is None or not isinstance(image, int):
            raise PackingError(
                f"{type(config).__name__} (model_type {model_type!r}) is not a multimodal model packtools has "
                f"verified; packed multimodal rows are supported for {list(VERIFIED_MODEL_TYPES)}."
                f"{unverified_reason(model_type)} Train it unpacked, with its processor's collator.",
                param="model",
            )
        if model_type in ANYRES_MODEL_TYPES:
            return cls._anyres_from_config(config, model_type, vision, image)
        if model_type in FLAT_MODEL_TYPES:
            return cls._flat_from_config(config, model_type, vision, image)
        video = getattr(config, "video_token_id", None)
        sizes = [getattr(vision, k, None) for k in ("in_channels", "temporal_patch_size", "patch_size")]
        width = sizes[0] * sizes[1] * sizes[2] ** 2 if all(isinstance(v, int) for v in sizes) else None
        return cls(
            model_type,
            image,
            video if isinstance(video, int) else None,
            int(vision.spatial_merge_size),
            patch_width=width,
        )

    @classmethod
    def _flat_from_config(cls, config: Any, model_type: str, vision: Any, image: int) -> MropeSpec:
        size, patch = (
            _square(getattr(vision, "image_size", None)),
            _square(getattr(vision, "patch_size", None)),
        )
        strategy = getattr(config, "vision_feature_select_strategy", None)
        tower = getattr(vision, "model_type", None)
        if model_type == "gemma3" and tower in FLAT_VISION_TYPES[model_type] and size and patch:
            return cls._gemma3_from_config(config, vision, image, size, patch)
        if model_type in TILE_MODEL_TYPES and tower in FLAT_VISION_TYPES[model_type] and size and patch:
            return cls._tiles_from_config(config, model_type, vision, image, size, patch)
        if tower not in FLAT_VISION_TYPES[model_type] or size is None or patch is None:
            raise PackingError(
                f"{type(config).__name__} with a {tower!r} vision tower: packtools has verified {model_type!r} "
                f"packed with the vision towers {list(FLAT_VISION_TYPES[model_type])} only (one image size, a fixed "
                f"number of tokens per image); train this one unpacked.",
                param="model",
            )
        if strategy not in FLAT_STRATEGIES[model_type]:
            raise PackingError(
                f"{type(config).__name__}: vision_feature_select_strategy {strategy!r} is not verified "
                f"({list(FLAT_STRATEGIES[model_type])}).",
                param="model",
            )
        side = size // patch
        if model_type == "internvl":  # the pixel shuffle keeps side * downsample_ratio tokens a side
            side = side * float(getattr(config, "downsample_ratio", 1.0))
            if side != int(side) or side < 1:
                raise PackingError(
                    f"{type(config).__name__}: {size // patch} patches a side times downsample_ratio "
                    f"{config.downsample_ratio} is not a whole number of tokens.",
                    param="model",
                )
        if model_type == "internvl":  # the class token is dropped before the pixel shuffle
            tokens = int(side) ** 2
        else:  # the tower's patches, its class token, less the first token under "default"
            tokens = int(side) ** 2 + _CLASS_TOKEN[tower] - (1 if strategy == "default" else 0)
        if tokens < 1:
            raise PackingError(
                f"{type(config).__name__}: {tokens} tokens per image ({size // patch} patches a side).",
                param="model",
            )
        shape = (int(getattr(vision, "num_channels", 3)), size, size)
        return cls(model_type, image, None, 1, image_tokens=tokens, image_shape=shape)

    @classmethod
    def _anyres_from_config(cls, config: Any, model_type: str, vision: Any, image: int) -> MropeSpec:
        """LLaVA-NeXT / LLaVA-OneVision: tiles of the tower's ``image_size``, ``(image_size / patch_size)²`` features
        each (the verified tower and strategy of :data:`ANYRES_VISION_TYPES`), grids from ``image_grid_pinpoints``."""
        name = type(config).__name__
        size, patch = (
            _square(getattr(vision, "image_size", None)),
            _square(getattr(vision, "patch_size", None)),
        )
        tower = getattr(vision, "model_type", None)
        strategy = getattr(config, "vision_feature_select_strategy", None)
        verified = ANYRES_VISION_TYPES[model_type]
        if tower not in verified or strategy != verified[tower] or not size or not patch or size % patch:
            raise PackingError(
                f"{name} with a {tower!r} vision tower, vision_feature_select_strategy {strategy!r}, image_size "
                f"{getattr(vision, 'image_size', None)!r} and patch_size {getattr(vision, 'patch_size', None)!r}: "
                f"packtools has verified {model_type!r} packed with {verified} (tower: strategy) and square tiles a "
                f"whole number of patches a side only; train this one unpacked.",
                param="model",
            )
        points = getattr(config, "image_grid_pinpoints", None)
        pairs = [tuple(p) for p in points] if isinstance(points, (list, tuple)) else []
        if not pairs or any(
            len(p) != 2 or not all(isinstance(v, int) and v > 0 and v % size == 0 for v in p) for p in pairs
        ):
            raise PackingError(
                f"{name}: image_grid_pinpoints {points!r} must be (height, width) pairs, each a whole number of "
                f"{size}-pixel tiles.",
                param="model",
            )
        max_tiles = None
        if model_type == "llava_onevision":
            aspect = getattr(config, "vision_aspect_ratio", None)
            digits = aspect[len("anyres_max_") :] if isinstance(aspect, str) else ""
            if (
                not isinstance(aspect, str)
                or not aspect.startswith("anyres_max_")
                or not digits.isdigit()
                or int(digits) < 1
            ):
                raise PackingError(
                    f"{name}: vision_aspect_ratio {aspect!r} is not 'anyres_max_N' (N >= 1).", param="model"
                )
            max_tiles = int(digits)
            video = getattr(config, "video_token_id", None)
        else:
            video = None
        side = size // patch
        grid = AnyresGrid(size, side, tuple(pairs), max_tiles)  # type: ignore[arg-type]
        shape = (int(getattr(vision, "num_channels", 3)), size, size)
        return cls(
            model_type,
            image,
            video if isinstance(video, int) else None,
            1,
            image_tokens=side * side,
            image_shape=shape,
            anyres=grid,
        )

    @classmethod
    def _tiles_from_config(
        cls, config: Any, model_type: str, vision: Any, image: int, size: int, patch: int
    ) -> MropeSpec:
        """Idefics3 / SmolVLM: :func:`_tile_tokens` tokens a tile, tiles of ``(channels, size, size)``."""
        shape = (int(getattr(vision, "num_channels", 3)), size, size)
        tokens = _tile_tokens(config, size, patch)
        return cls(model_type, image, None, 1, image_tokens=tokens, image_shape=shape)

    @classmethod
    def _gemma3_from_config(cls, config: Any, vision: Any, image: int, size: int, patch: int) -> MropeSpec:
        """Gemma 3: ``mm_tokens_per_image`` tokens an image (the tower's ``side x side`` patches average-pooled to
        a square of them), and the text model's sliding window."""
        tokens, side = getattr(config, "mm_tokens_per_image", None), size // patch
        per_side = int(round(tokens**0.5)) if isinstance(tokens, int) and tokens > 0 else 0
        if per_side < 1 or per_side * per_side != tokens or side % per_side:
            raise PackingError(
                f"{type(config).__name__}: mm_tokens_per_image {tokens!r} is not a square whose side divides the "
                f"tower's {side} patches a side.",
                param="model",
            )
        text = config.get_text_config()
        if getattr(text, "use_bidirectional_attention", False):
            raise PackingError(
                f"{type(config).__name__}: use_bidirectional_attention=True (every token attends both ways) is not "
                f"verified packed; train it unpacked.",
                param="model",
            )
        layers = getattr(text, "layer_types", None) or ()
        window = getattr(text, "sliding_window", None) if "sliding_attention" in layers else None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise PackingError(f"{type(text).__name__}: sliding_window {window!r} is not a positive int.")
        shape = (int(getattr(vision, "num_channels", 3)), size, size)
        return cls("gemma3", image, None, 1, image_tokens=tokens, image_shape=shape, sliding_window=window)


def _tile_tokens(config: Any, size: int, patch: int) -> int:
    """The tokens of one Idefics3 / SmolVLM tile: ``(size / patch)²`` patches, pixel-shuffled by ``scale_factor``
    a side (what the model's ``image_seq_len`` and the processor's ``image_seq_len`` count)."""
    side, scale = size // patch, getattr(config, "scale_factor", None)
    if not isinstance(scale, int) or scale < 1 or size % patch or side % scale:
        raise PackingError(
            f"{type(config).__name__}: {size // patch} patches a side (image_size {size}, patch_size {patch}) is "
            f"not a whole number of scale_factor {scale!r} squares.",
            param="model",
        )
    return (side // scale) ** 2


def _square(value: Any) -> int | None:
    """A side given as an int or a square (side, side) pair; ``None`` otherwise."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return value if isinstance(value, int) and value > 0 else None


def check_grid(image_grid_thw: Any, name: str, row: int | None = None) -> np.ndarray:
    """``image_grid_thw`` as an int64 ``(n, 3)`` array of positive sides (``None`` or empty: no image)."""
    where = "" if row is None else f"row {row}: "
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grid = np.asarray(image_grid_thw)
    if grid.size == 0:
        return np.zeros((0, 3), np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu":
        raise PackingError(
            f"{where}{name!r} must be integer rows (t, h, w), one per image, got shape {grid.shape} "
            f"({grid.dtype}); pass the processor's image_grid_thw for this sample."
        )
    if grid.min() < 1:
        raise PackingError(f"{where}{name!r} has a side < 1: {grid.tolist()}.")
    return grid.astype(np.int64, copy=False)


def image_token_runs(ids: np.ndarray, image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of ``image_token_id`` in ``ids``: their starts and their ends (one past the last token).

    >>> [r.tolist() for r in image_token_runs(np.array([1, 9, 9, 2, 9, 3]), 9)]
    [[1, 4], [3, 5]]
    """
    is_img = (np.asarray(ids) == image_token_id).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_img, [0]])))
    return edges[0::2], edges[1::2]


def grid_runs(
    ids: np.ndarray, grid: np.ndarray, spec: MropeSpec, *, doc: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The runs of image tokens of one document (:func:`image_token_runs`), checked against its ``image_grid_thw``
    rows ``grid`` (:func:`check_grid`): one run of ``t*h*w / merge²`` tokens per image, in order, and no video
    token.  The one rule of a Qwen-VL document's images (``MultimodalCollator`` and ``guard_model`` apply it).

    >>> spec = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)
    >>> [r.tolist() for r in grid_runs(np.array([1, 9, 9, 2]), np.array([[1, 2, 4]]), spec)]
    [[1], [3]]
    """
    merge = int(spec.spatial_merge_size)
    if spec.video_token_id is not None and np.any(ids == spec.video_token_id):
        raise PackingError(
            f"document {doc} holds video tokens (id {spec.video_token_id}): packtools packs images only; "
            f"videos are not supported yet. Drop video samples or train them unpacked."
        )
    run_starts, run_stops = image_token_runs(ids, spec.image_token_id)
    counts = grid.prod(axis=1) // (merge * merge) if grid.size else np.zeros(0, np.int64)
    if run_starts.shape[0] != grid.shape[0] or np.any(run_stops - run_starts != counts):
        raise PackingError(
            f"document {doc}: its image tokens (id {spec.image_token_id}) form runs of "
            f"{(run_stops - run_starts).tolist()} tokens but its image_grid_thw {grid.tolist()} gives "
            f"{counts.tolist()} (t*h*w / {merge}²): each image needs exactly its own run, with text between two "
            f"images. Process the sample with the model's own processor.",
            param="image_grid_thw",
        )
    return run_starts, run_stops


def document_positions(input_ids: Any, image_grid_thw: Any, spec: MropeSpec, *, doc: int = 0) -> np.ndarray:
    """The ``(3, n)`` t/h/w positions of one document, as the model's ``get_rope_index`` computes them.

    >>> spec = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)
    >>> document_positions([1, 9, 9, 9, 9, 9, 9, 2], [[1, 4, 6]], spec).tolist()
    [[0, 1, 1, 1, 1, 1, 1, 4], [0, 1, 1, 1, 2, 2, 2, 4], [0, 1, 2, 3, 1, 2, 3, 4]]
    """
    ids = np.asarray(input_ids)
    merge = int(spec.spatial_merge_size)
    grid = check_grid(image_grid_thw, "image_grid_thw", doc)
    run_starts, run_stops = grid_runs(ids, grid, spec, doc=doc)
    out = np.empty((3, ids.shape[0]), np.int64)
    pos = 0
    cursor = 0
    for (t, h, w), start, stop in zip(grid.tolist(), run_starts.tolist(), run_stops.tolist()):
        out[:, cursor:start] = np.arange(start - cursor) + pos
        pos += start - cursor
        gh, gw = h // merge, w // merge
        thw = np.meshgrid(
            np.arange(t), np.arange(gh), np.arange(gw), indexing="ij"
        )  # the merged grid's t, h, w
        out[:, start:stop] = np.stack(thw).reshape(3, -1) + pos
        pos += max(gh, gw)
        cursor = stop
    out[:, cursor:] = np.arange(ids.shape[0] - cursor) + pos
    return out


def row_positions(
    input_ids: Any,
    seq_lengths: Any,
    images_per_doc: Any,
    image_grid_thw: Any,
    spec: MropeSpec,
    *,
    text_row: bool = True,
) -> np.ndarray:
    """Per-document positions of a packed row: ``(4, T)`` (text row, then t/h/w) or ``(3, T)``.

    ``seq_lengths[i]`` tokens of document ``i`` use the next ``images_per_doc[i]`` rows of ``image_grid_thw``
    (images in row order).  Every document restarts at 0 in every row.

    >>> spec = MropeSpec("qwen3_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)
    >>> row_positions([1, 9, 2, 3, 4], [3, 2], [1, 0], [[1, 2, 2]], spec).tolist()
    [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    """
    ids = np.asarray(input_ids)
    seg = np.asarray(seq_lengths, np.int64)
    per_doc = np.asarray(images_per_doc, np.int64)
    grid = check_grid(image_grid_thw, "image_grid_thw")
    if per_doc.shape != seg.shape or int(per_doc.sum()) != grid.shape[0]:
        raise PackingError(
            f"images_per_doc {per_doc.tolist()} must give one count per document ({seg.shape[0]}) summing to "
            f"the {grid.shape[0]} rows of image_grid_thw."
        )
    if int(seg.sum()) != ids.shape[0]:
        raise PackingError(f"seq_lengths sum to {int(seg.sum())} but the row has {ids.shape[0]} tokens.")
    rows = 4 if text_row else 3
    out = np.empty((rows, ids.shape[0]), np.int64)
    starts = np.concatenate([[0], np.cumsum(seg)])
    first = np.concatenate([[0], np.cumsum(per_doc)])
    for d in range(seg.shape[0]):
        a, b = int(starts[d]), int(starts[d + 1])
        out[rows - 3 :, a:b] = document_positions(ids[a:b], grid[first[d] : first[d + 1]], spec, doc=d)
        if text_row:
            out[0, a:b] = np.arange(b - a)
    return out
