"""TRL's vision format through a local processor folder: ``messages`` with image parts + an ``images`` column.

:func:`load_vision_processor` opens a folder written by the model's own processor (``save_pretrained``); it never
downloads.  When transformers can build the folder's ``AutoProcessor``, that processor does all the work.
transformers 5.25 cannot build the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors without torchvision (their video
processor's base class is missing), while their PIL image processor works without it: packtools then loads the
folder's image processor (``AutoImageProcessor``, PIL backend) and tokenizer, renders the folder's chat
template, and does the processor's one remaining step itself -- each image placeholder becomes
``t*h*w / merge²`` image tokens (the rule of ``Qwen2VLProcessor.replace_image_token``).

:func:`process_vision_sample` gives what the processor gives for one sample: ``input_ids``, ``pixel_values``,
``image_grid_thw``, ``mm_token_type_ids`` (NumPy).  Every text token is learned except the image tokens
(the collator sets -100 there); an assistant-only mask is not produced yet.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._optional import require
from ..errors import PackingError

#: The image placeholder of the Qwen-VL processors when the tokenizer names none.
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"


@dataclass(frozen=True)
class VisionProcessor:
    """A loaded processor folder: the model's ``AutoProcessor`` (``processor``), or its parts."""

    path: str
    tokenizer: Any
    image_processor: Any
    image_token: str
    image_token_id: int
    merge_size: int
    chat_template: str | None
    processor: Any = None


def _chat_template(path: str, tokenizer: Any) -> str | None:
    found = getattr(tokenizer, "chat_template", None)
    if found:
        return found
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    return None


def load_vision_processor(path: str | os.PathLike[str]) -> VisionProcessor:
    """Open a local processor folder (``AutoProcessor.save_pretrained`` output); never a hub download."""
    transformers = require("transformers", "packtools processor=DIR")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise PackingError(
            f"processor={path!r} is not a folder: pass the folder the model's processor was saved to "
            f"(AutoProcessor.from_pretrained(name).save_pretrained(DIR)); packtools never downloads one.",
            param="processor",
        )
    processor = None
    try:
        processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
    except (ImportError, ValueError, TypeError, AttributeError, OSError):
        processor = None  # e.g. no torchvision for the video processor: the parts below
    if processor is not None and not hasattr(processor, "image_processor"):
        processor = None
    if processor is not None:
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
    else:
        try:
            image_processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise PackingError(
                f"processor={path!r}: neither the folder's AutoProcessor nor its image processor and tokenizer "
                f"load ({err}). Save the model's processor there with save_pretrained.",
                param="processor",
            ) from err
    image_token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
    image_token = image_token or DEFAULT_IMAGE_TOKEN
    token_id = tokenizer.convert_tokens_to_ids(image_token)
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        raise PackingError(
            f"processor={path!r}: the tokenizer has no image token {image_token!r}; this is not a Qwen-VL "
            f"processor folder.",
            param="processor",
        )
    merge = getattr(image_processor, "merge_size", None)
    if not isinstance(merge, int):
        raise PackingError(
            f"processor={path!r}: its image processor ({type(image_processor).__name__}) has no merge_size; "
            f"packtools supports the Qwen2-VL / Qwen2.5-VL / Qwen3-VL image processors.",
            param="processor",
        )
    return VisionProcessor(
        path,
        tokenizer,
        image_processor,
        image_token,
        token_id,
        merge,
        _chat_template(path, tokenizer),
        processor,
    )


def open_image(value: Any, row: int) -> Any:
    """A PIL image from a PIL image, a path, bytes, or ``datasets``' ``{"bytes": ..., "path": ...}``.

    >>> open_image(b"not an image", 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: row 3: cannot open image ...
    """
    Image = require("PIL.Image", "opening images (the images column)")
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value))
        if isinstance(value, (str, os.PathLike)):
            return Image.open(value)
    except OSError as err:
        raise PackingError(f"row {row}: cannot open image {str(value)[:80]!r}: {err}") from err
    raise PackingError(
        f"row {row}: an image must be a path, bytes or a PIL image, got {type(value).__name__}.",
        param="images",
    )


def process_vision_sample(
    vp: VisionProcessor, messages: Any, images: Any, row: int = 0
) -> dict[str, np.ndarray]:
    """One sample of TRL's vision format processed as the model's processor does it."""
    images = [open_image(v, row) for v in (images or [])]
    text = _render(vp, messages)
    parts = text.split(vp.image_token)
    if len(parts) - 1 != len(images):
        raise PackingError(
            f"row {row}: its messages hold {len(parts) - 1} image part(s) but its images column has {len(images)} "
            f"image(s); every image part needs exactly one image, in order.",
            param="images",
        )
    if vp.processor is not None:
        out = vp.processor(text=[text], images=images or None, return_tensors="np")
        ids = np.asarray(out["input_ids"][0], np.int64)
        grid = np.asarray(out.get("image_grid_thw", np.zeros((0, 3))), np.int64).reshape(-1, 3)
        pixels = out.get("pixel_values")
    else:
        grid = np.zeros((0, 3), np.int64)
        pixels = None
        if images:
            feats = vp.image_processor(images=images, return_tensors="np")
            grid = np.asarray(feats["image_grid_thw"], np.int64).reshape(-1, 3)
            pixels = feats["pixel_values"]
        counts = grid.prod(axis=1) // (vp.merge_size**2)
        expanded = parts[0] + "".join(vp.image_token * int(n) + p for n, p in zip(counts, parts[1:]))
        ids = np.asarray(vp.tokenizer(expanded)["input_ids"], np.int64)
    row_out = {"input_ids": ids, "mm_token_type_ids": (ids == vp.image_token_id).astype(np.int64)}
    dim = (
        3
        * int(getattr(vp.image_processor, "temporal_patch_size", 2))
        * int(vp.image_processor.patch_size) ** 2
    )
    row_out["pixel_values"] = (
        np.zeros((0, dim), np.float32) if pixels is None else np.asarray(pixels, np.float32)
    )
    row_out["image_grid_thw"] = grid
    return row_out


def process_vision_dataset(
    dataset: Any,
    processor: str | os.PathLike[str] | VisionProcessor,
    *,
    messages: str = "messages",
    images: str = "images",
    leave_out: Sequence[str] = (),
) -> Any:
    """A ``datasets.Dataset`` in TRL's vision format, processed row by row (``input_ids``, ``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``).  The result holds only these columns: any other column of the
    dataset (``tools``, an ``id``...) is refused by name unless ``leave_out`` lists it, so none is dropped
    without a word (``tools`` is not passed to the processor's chat template)."""
    if isinstance(leave_out, str) or not all(isinstance(k, str) for k in leave_out):
        raise PackingError(f"leave_out must be a list of column names, got {leave_out!r}.", param="leave_out")
    vp = processor if isinstance(processor, VisionProcessor) else load_vision_processor(processor)
    names = dataset.column_names
    if messages not in names:
        raise PackingError(f"the dataset has no {messages!r} column (it has {names}).", param="messages")
    extra = sorted(n for n in names if n not in (messages, images) and n not in leave_out)
    if extra:
        raise PackingError(
            f"the dataset has the column(s) {extra}, which the processed rows do not carry (only {messages!r} and "
            f"{images!r} reach the model). Remove them (ds.remove_columns({extra!r})), or say they may be left "
            f"out: process_vision_dataset(..., leave_out={extra!r}).",
            param="leave_out",
        )

    def one(example: dict[str, Any], idx: int) -> dict[str, Any]:
        return process_vision_sample(vp, example[messages], example.get(images), idx)

    return dataset.map(one, with_indices=True, remove_columns=names)


def _render(vp: VisionProcessor, messages: Any) -> str:
    if vp.processor is not None:
        return vp.processor.apply_chat_template(messages, tokenize=False)
    if vp.chat_template is None:
        raise PackingError(
            f"processor={vp.path!r} has no chat template to render messages.", param="processor"
        )
    return vp.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=vp.chat_template)


def vision_lengths(
    dataset: Any,
    processor: str | os.PathLike[str] | VisionProcessor,
    *,
    messages: str = "messages",
    images: str = "images",
) -> np.ndarray:
    """Token counts of rows in TRL's vision format as the model sees them (image tokens counted), without
    processing a pixel: each image's tokens come from its size (read from the file header) through the image
    processor's resize rule (``get_number_of_image_patches / merge²``).  Feed them to
    :func:`packtools.profile_lengths` to choose ``max_length``.
    """
    vp = processor if isinstance(processor, VisionProcessor) else load_vision_processor(processor)
    count = getattr(vp.image_processor, "get_number_of_image_patches", None)
    if count is None:
        raise PackingError(
            f"processor={vp.path!r}: its image processor cannot count patches from sizes.", param="processor"
        )
    out = np.zeros(len(dataset), np.int64)
    for i, example in enumerate(dataset):
        text = _render(vp, example[messages])
        pictures = [open_image(v, i) for v in (example.get(images) or [])]
        if text.count(vp.image_token) != len(pictures):
            raise PackingError(
                f"row {i}: its messages hold {text.count(vp.image_token)} image part(s) but its images column has "
                f"{len(pictures)} image(s).",
                param="images",
            )
        placeholders = len(pictures)
        tokens = len(vp.tokenizer(text)["input_ids"]) - placeholders
        out[i] = tokens + sum(count(p.height, p.width) // vp.merge_size**2 for p in pictures)
    return out
