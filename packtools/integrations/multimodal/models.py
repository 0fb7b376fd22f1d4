"""Vision-language models in ``prepare_trainer``: which ones packtools trains packed
(:func:`check_multimodal_model`; in the preference and RL paths none, :func:`refuse_multimodal`), and the probe
through the vision tower (:func:`check_vision_isolation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._optional import require
from ...batches.mrope import (
    IMAGE_BLOCK_BACKENDS,
    IMAGE_BLOCK_REASON,
    MropeSpec,
    anyres_image_tokens,
    anyres_tiles,
)
from ...constants import PIXEL_MASK
from ...errors import PackingError
from ..attention.backends import attention_implementation, base_model, check_multimodal, multimodal_parts
from ..attention.isolation import (
    PERTURB_TOLERANCE,
    TOLERANCE,
    IsolationReport,
    _logits,
    autocast_inside,
    compute_dtype,
)
from ..trainers.collator_check import _checking


def refuse_multimodal(models: Sequence[Any], what: str) -> None:
    """Refuse, by name, a multimodal model in a padding-free preference or RL path (verified vision-language
    models train packed in SFT only): ``what`` (e.g. ``"DPO forwards"``) carries text rows only."""
    for model in models:
        if multimodal_parts(model):  # a vision or audio tower, or pixel_values in its forward
            raise PackingError(
                f"{type(base_model(model)).__name__} is a multimodal model: packtools' padding-free {what} carry "
                f"text rows only (no pixel_values, no 3-D positions); train it padded, with TRL's collator.",
                param="model",
            )


def check_multimodal_model(model: Any, collator: Any, backend: str | None = None) -> MropeSpec | None:
    """``None`` for a text model; the positions spec of a verified multimodal model fed by a
    ``MultimodalCollator``; :class:`PackingError` otherwise (naming the model type and the fix).  ``backend`` is
    the attention implementation the model will train on (``prepare_trainer`` switches Gemma 3 from ``sdpa`` to
    ``packtools_sdpa`` after this check); ``None``: the one it has.

    >>> check_multimodal_model(object(), None) is None
    True
    """
    if not multimodal_parts(model):
        return None
    from ...batches.vision import MultimodalCollator

    check_multimodal(model)  # an unverified type: refused by name there (the one list)
    base = base_model(model)
    inner = getattr(collator, "collator", collator)
    if not isinstance(inner, MultimodalCollator):
        raise PackingError(
            f"{type(base).__name__} is a vision-language model but the trainer's data_collator is "
            f"{type(inner).__name__}: packed rows then get 2-D positions, which give image tokens text positions "
            f"and (Qwen2-VL, Qwen2.5-VL) let documents attend to each other. Use "
            f"data_collator=packtools.batches.MultimodalCollator(model, pad_token_id){_wrapper_hint(inner)}.",
            param="data_collator",
        )
    spec = MropeSpec.from_config(base.config)
    check_image_block_backend(model, spec, inner.image_masks, backend)
    if inner.spec != spec:
        raise PackingError(
            f"the MultimodalCollator was built for {inner.spec} but the model is {spec}; build it from this model.",
            param="data_collator",
        )
    return spec


def _wrapper_hint(collator: Any) -> str:
    """The refusal's last words for a data_collator that is neither a packtools collator nor a known one: most
    often the user's own wrapper (logging, recording) around a ``MultimodalCollator``, which packtools cannot see
    inside."""
    if type(collator).__module__.split(".")[0] in ("packtools", "transformers", "trl"):
        return ""
    return (
        f"; if {type(collator).__name__} wraps one of your own, keep the MultimodalCollator it calls as its "
        f"`.collator` attribute: packtools checks the collator found there"
    )


def check_image_block_backend(
    model: Any, spec: MropeSpec, image_masks: str = "dense", backend: str | None = None
) -> None:
    """Refuse a model of :data:`~packtools.batches.mrope.IMAGE_BLOCK_TYPES` (Gemma 3) on an attention backend that
    cannot read the collator's ready-made boolean masks (``eager`` adds them to its scores), or its per-document
    masks (``image_masks='per_document'``: ``packtools_sdpa`` only).  ``backend``: the one it will train on
    (``None``: the one it has)."""
    impl = backend or attention_implementation(model)
    if spec.image_blocks and image_masks == "per_document" and impl != "packtools_sdpa":
        raise PackingError(
            f"{type(base_model(model)).__name__} with attn_implementation={impl!r} and a MultimodalCollator with "
            f"image_masks='per_document': only 'packtools_sdpa' reads each document's masks per document. Load "
            f"the model with attn_implementation='packtools_sdpa' (packtools.integrations.attention.segmented."
            f"register()), or build the collator with image_masks='dense' (T² bytes per layer type and batch).",
            param="data_collator",
        )
    if spec.image_blocks and impl not in IMAGE_BLOCK_BACKENDS:
        raise PackingError(
            f"{type(base_model(model)).__name__} with attn_implementation={impl!r}: packed {spec.model_type!r} rows "
            f"with images carry each document's masks ready-made (boolean), which only {list(IMAGE_BLOCK_BACKENDS)} "
            f"read ({IMAGE_BLOCK_REASON}). Load the model with attn_implementation='sdpa'.",
            param="model",
        )


def probe_samples(model: Any, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Processed samples for the probe: images of different sizes (one, none, two) around random text."""
    base = base_model(model)
    config = base.config
    spec = MropeSpec.from_config(config)
    if spec.anyres is not None:
        return _anyres_probe_samples(config, spec, rng)
    if spec.flat:
        return _flat_probe_samples(config, spec, rng)
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    dim = (
        int(getattr(vision, "in_channels", 3)) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    )
    vocab = int(config.get_text_config().vocab_size)
    special = {
        getattr(config, name, None)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    }
    text = config.get_text_config()
    special |= {getattr(text, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id")}
    allowed = np.setdiff1d(np.arange(vocab), [s for s in special if isinstance(s, int)])
    start, end = config.vision_start_token_id, config.vision_end_token_id

    def sample(grids: list[tuple[int, int, int]], words: int) -> dict[str, Any]:
        ids = list(rng.choice(allowed, words))
        patches = []
        for t, h, w in grids:
            ids += [start] + [config.image_token_id] * (t * h * w // merge**2) + [end]
            ids += list(rng.choice(allowed, 3))
            patches.append(rng.standard_normal((t * h * w, dim)).astype(np.float32))
        row: dict[str, Any] = {"input_ids": np.asarray(ids, np.int64)}
        if grids:
            row["pixel_values"] = np.concatenate(patches)
            row["image_grid_thw"] = np.asarray(grids, np.int64)
        return row

    m = merge
    return [sample([(1, 2 * m, 2 * m)], 4), sample([], 6), sample([(1, 2 * m, m), (1, m, 3 * m)], 3)]


def _flat_probe_samples(config: Any, spec: MropeSpec, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The probe's samples for a LLaVA-style model: one image, none, two, each a run of ``image_tokens``."""
    text = config.get_text_config()
    special = {spec.image_token_id} | {
        getattr(text, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id")
    }
    allowed = np.setdiff1d(np.arange(int(text.vocab_size)), [s for s in special if isinstance(s, int)])
    shape = spec.image_shape or (3, 1, 1)

    def sample(images: int, words: int) -> dict[str, Any]:
        ids = list(rng.choice(allowed, words))
        for _ in range(images):
            ids += [spec.image_token_id] * int(spec.image_tokens or 0) + list(rng.choice(allowed, 3))
        row: dict[str, Any] = {"input_ids": np.asarray(ids, np.int64)}
        if images:
            row["pixel_values"] = rng.standard_normal((images, *shape)).astype(np.float32)
            if spec.tiles:  # Idefics3 / SmolVLM: whole tiles, each read with its mask
                row[PIXEL_MASK] = np.ones((images, *shape[1:]), np.int64)
        return row

    return [sample(1, 4), sample(0, 6), sample(2, 3)]


def _anyres_probe_samples(config: Any, spec: MropeSpec, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The probe's samples for LLaVA-NeXT / OneVision: one image, none, two, of different sizes (each its own
    number of tokens and tiles; OneVision's two are a base tile each), pixels padded to each sample's most tiles."""
    grid = spec.anyres
    assert grid is not None
    text = config.get_text_config()
    special = {spec.image_token_id, spec.video_token_id} | {
        getattr(text, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id")
    }
    allowed = np.setdiff1d(np.arange(int(text.vocab_size)), [s for s in special if isinstance(s, int)])
    shape = spec.image_shape or (3, grid.tile, grid.tile)
    tiled_alone = spec.model_type != "llava_onevision"

    def sample(sizes: list[tuple[int, int]], words: int) -> dict[str, Any]:
        ids = list(rng.choice(allowed, words))
        tiled = len(sizes) == 1 or tiled_alone
        for h, w in sizes:
            ids += [spec.image_token_id] * anyres_image_tokens(grid, h, w, tiled) + list(
                rng.choice(allowed, 3)
            )
        row: dict[str, Any] = {"input_ids": np.asarray(ids, np.int64)}
        if sizes:
            most = max(anyres_tiles(grid, h, w, tiled) for h, w in sizes)
            row["pixel_values"] = rng.standard_normal((len(sizes), most, *shape)).astype(np.float32)
            row["image_sizes"] = np.asarray(sizes, np.int64)
            row["batch_num_images"] = np.asarray([len(sizes)], np.int64)
        return row

    t = grid.tile
    return [sample([(t + 3, 2 * t + 5)], 4), sample([], 6), sample([(2 * t, t), (t // 2 + 1, t)], 3)]


def _packed_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first two samples packed in one row, the third alone (with its seq_lengths)."""
    first, second = samples[0], samples[1]
    row = {
        "input_ids": np.concatenate([first["input_ids"], second["input_ids"]]),
        "seq_lengths": [len(first["input_ids"]), len(second["input_ids"])],
    }
    images = [s for s in (first, second) if "pixel_values" in s]
    if images and "image_sizes" in images[0]:  # any-resolution: each image its own tiles
        row["pixel_values"] = [image for s in images for image in s["pixel_values"]]
        row["image_sizes"] = np.concatenate([s["image_sizes"] for s in images])
        row["batch_num_images"] = np.concatenate([s["batch_num_images"] for s in images])
    elif images:
        row["pixel_values"] = np.concatenate([s["pixel_values"] for s in images])
        if PIXEL_MASK in images[0]:
            row[PIXEL_MASK] = np.concatenate([s[PIXEL_MASK] for s in images])
        if "image_grid_thw" in images[0]:
            row["image_grid_thw"] = np.concatenate([s["image_grid_thw"] for s in images])
    return [row, {**samples[2], "seq_lengths": [len(samples[2]["input_ids"])]}]


def check_vision_isolation(
    model: Any, collator: Any, *, seed: int = 0, raise_on_leak: bool = True
) -> IsolationReport:
    """Check that ``model`` keeps packed multimodal samples apart, vision tower included.

    Runs in eval mode without gradients; the train/eval flags are restored.  Raises :class:`PackingError`
    (or returns the report with ``raise_on_leak=False``) when a packed sample's logits differ from the
    sample run alone through the model's own path, or move when another sample's pixels change.
    """
    torch = require("torch", "packtools.integrations.multimodal.models.check_vision_isolation")
    base = base_model(model)
    name = type(base).__name__
    impl = attention_implementation(model)
    param = next(iter(base.parameters()))
    device = param.device
    inner = getattr(collator, "collator", collator)
    if getattr(inner, "return_tensors", "pt") != "pt" and hasattr(inner, "replace"):
        collator = inner.replace(return_tensors="pt")
    rng = np.random.default_rng(seed)
    samples = probe_samples(model, rng)
    moved = [{**samples[0], "input_ids": samples[0]["input_ids"].copy()}, *samples[1:]]
    moved[0]["pixel_values"] = rng.standard_normal(samples[0]["pixel_values"].shape).astype(np.float32)
    text_at = np.flatnonzero(moved[0]["input_ids"] != base.config.image_token_id)[1]
    moved[0]["input_ids"][text_at] = samples[1]["input_ids"][0]
    image_id = base.config.image_token_id

    def to_device(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}

    def run_packed(parts: list[dict[str, Any]]) -> tuple[Any, tuple[str, ...]]:
        with _checking():  # not a training batch (collator wrappers read packtools.integrations.trainers.collator_check.in_check)
            batch = dict(collator(_packed_rows(parts)))
        batch.pop("labels", None)
        batch = to_device(batch)
        batch["use_cache"] = False  # also where a caller's collator was built with return_use_cache=False
        return _logits(model(**batch), name)[0], tuple(batch)

    def run_alone(sample: dict[str, Any]) -> Any:
        ids = torch.as_tensor(sample["input_ids"][None])
        extra = {}
        if "image_sizes" in sample:  # any-resolution: the images, their sizes (and OneVision's count)
            extra = {k: torch.as_tensor(sample[k]) for k in ("pixel_values", "image_sizes")}
            if MropeSpec.from_config(base.config).model_type == "llava_onevision":
                extra["batch_num_images"] = torch.as_tensor(sample["batch_num_images"])
        elif "pixel_values" in sample and "image_grid_thw" not in sample:  # LLaVA-style: the images alone
            extra = {"pixel_values": torch.as_tensor(sample["pixel_values"])}
            if (
                PIXEL_MASK in sample
            ):  # Idefics3 / SmolVLM: one batch entry of the sample's tiles, with their masks
                extra = {"pixel_values": extra["pixel_values"][None]}
                extra[PIXEL_MASK] = torch.as_tensor(sample[PIXEL_MASK])[None]
            if MropeSpec.from_config(base.config).image_blocks:  # Gemma 3: its images' blocks, as processed
                extra["token_type_ids"] = (ids == image_id).to(torch.int64)
        elif "pixel_values" in sample:
            extra = {
                "pixel_values": torch.as_tensor(sample["pixel_values"]),
                "image_grid_thw": torch.as_tensor(sample["image_grid_thw"]),
                "mm_token_type_ids": (ids == image_id).to(torch.int64),
            }
        return _logits(model(**to_device({"input_ids": ids, **extra}), use_cache=False), name)[0]

    lengths = [len(s["input_ids"]) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            with autocast_inside(
                model
            ) as seen:  # the precision the forward enters itself (accelerate's bf16)
                packed, keys = run_packed(samples)
            other, _ = run_packed(moved)
            alone = [run_alone(s) for s in samples]
    finally:
        for module, training in modes:
            module.training = training
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    diffs = tuple(float((packed[a:b].float() - al.float()).abs().max()) for (a, b), al in zip(spans, alone))
    perturb = max(float((packed[a:b].float() - other[a:b].float()).abs().max()) for a, b in spans[1:])
    scale = max(1.0, max(float(al.float().abs().max()) for al in alone))
    dtype_name = compute_dtype(base, seen=seen)
    tol = TOLERANCE.get(dtype_name, 1e-5) * scale
    report = IsolationReport(
        model=name,
        backend=impl,
        dtype=dtype_name,
        device=str(device),
        lengths=tuple(lengths),
        keys=keys,
        alone_diff=diffs,
        perturb_diff=perturb,
        tolerance=tol,
        perturb_tolerance=min(tol, PERTURB_TOLERANCE * scale),
    )
    if report.leaks and raise_on_leak:
        raise PackingError(
            f"{name} with attn_implementation={impl!r} does not keep packed multimodal samples apart: a packed "
            f"sample's logits differ by up to {max(diffs):.1e} from the sample run alone and move by "
            f"{perturb:.1e} when another sample's image changes (batch keys {list(keys)}). Check that the "
            f"collator is packtools' MultimodalCollator and its position_ids reach the model unchanged; "
            f"otherwise train this model unpacked.\n{report}"
        )
    return report
