"""TRL's vision format through a local processor folder: ``messages`` with image parts + an ``images`` column.

:func:`load_vision_processor` opens a folder written by the model's own processor (``save_pretrained``); it never
downloads.  When transformers can build the folder's ``AutoProcessor``, that processor does all the work;
without torchvision (transformers 5.25 cannot build the Qwen-VL processors then) packtools uses the folder's
image processor, tokenizer and chat template, and expands each image placeholder to ``t*h*w / merge²`` image
tokens itself (the rule of ``Qwen2VLProcessor.replace_image_token``).  :func:`process_vision_sample` gives what
the processor gives for one sample, with ``assistant_masks`` (:func:`assistant_mask`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._optional import require
from ...constants import IMAGE_COLUMNS
from ...errors import PackingError
from .images import check_messages, image_list, image_size, open_image, where_of

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


#: The files a processor folder keeps the image processor's settings in (transformers'
#: ``ImageProcessingMixin.get_image_processor_dict`` reads either).
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _unloadable(path: str, err: Exception) -> str:
    """Why ``path`` is no processor folder, ours first (the folder, the file it lacks, the fix), then
    transformers' own words (long, and about the hub)."""
    fix = (
        f"save the model's processor there: AutoProcessor.from_pretrained(NAME).save_pretrained({path!r}) "
        f"(a tokenizer alone is no processor folder)"
    )
    if not any(os.path.isfile(os.path.join(path, f)) for f in IMAGE_PROCESSOR_FILES):
        head = f"processor={path!r} has no {IMAGE_PROCESSOR_FILES[0]} (the image processor's settings)"
    else:
        head = f"processor={path!r}: neither the folder's AutoProcessor nor its image processor and tokenizer load"
    said = " ".join(str(err).split())
    return f"{head}; {fix}. transformers said: {said}"


def load_vision_processor(path: str | os.PathLike[str]) -> VisionProcessor:
    """Open a local processor folder (``AutoProcessor.save_pretrained`` output); never a hub download.

    >>> load_vision_processor("Qwen/Qwen2-VL-2B-Instruct")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: processor='Qwen/Qwen2-VL-2B-Instruct' is not a folder: ...
    """
    transformers = require("transformers", "packtools processor=DIR")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise PackingError(
            f"processor={path!r} is not a folder: pass the folder the model's processor was saved to "
            f"(AutoProcessor.from_pretrained(name).save_pretrained(DIR)); packtools never downloads one.",
            param="processor",
        )
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
            raise PackingError(_unloadable(path, err), param="processor") from err
    merge = getattr(image_processor, "merge_size", None)
    if not isinstance(merge, int):  # decided first: a LLaVA / InternVL folder is named as what it is
        raise PackingError(
            f"processor={path!r}: its image processor ({type(image_processor).__name__}) has no merge_size; "
            f"packtools processes rows with the Qwen-VL image processors only (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
            f"Qwen3.5). LLaVA and InternVL rows, and those of Gemma 3, Idefics3 and SmolVLM, pack already "
            f"processed (input_ids with each image's tokens expanded, pixel_values one entry per image or tile, "
            f"Idefics3's and SmolVLM's pixel_attention_mask with them): pack_dataset(ds, max_length) without "
            f"processor= (docs/vision.md).",
            param="processor",
        )
    image_token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
    image_token = image_token or DEFAULT_IMAGE_TOKEN
    token_id = tokenizer.convert_tokens_to_ids(image_token)
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        raise PackingError(
            f"processor={path!r}: the tokenizer has no image token {image_token!r}; this is not a Qwen-VL "
            f"processor folder.",
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


def _image_features(vp: VisionProcessor, images: list[Any], names: Sequence[Any], row: int | str) -> Any:
    """The image processor's output for ``images``; an image it refuses is named (its entry in the row, its
    size) with the processor's reason."""
    try:
        return vp.image_processor(images=images, return_tensors="np")
    except (ValueError, OSError, TypeError) as err:
        for k, (img, name) in enumerate(zip(images, names)):
            try:
                vp.image_processor(images=[img], return_tensors="np")
            except (ValueError, OSError, TypeError) as one:
                # a long path keeps its end, the file's name (its head was kept, cutting the name off)
                shown = str(name) if len(str(name)) <= 80 else "..." + str(name)[-77:]
                raise PackingError(
                    f"{where_of(row)}: image {k} ({shown!r}, {img.width}x{img.height} pixels): the image "
                    f"processor refuses it: {one}. Fix or remove that image (and its image part).",
                    param="images",
                ) from one
        raise PackingError(
            f"{where_of(row)}: the image processor refuses the images: {err}", param="images"
        ) from err


def process_vision_sample(
    vp: VisionProcessor, messages: Any, images: Any, row: int | str = 0
) -> dict[str, np.ndarray]:
    """One sample of TRL's vision format processed as the model's processor does it, with ``assistant_masks``
    (1 on the tokens of the assistant turns, as text chat's labels: :func:`assistant_mask`).  ``row``: the
    row number, or ``"FILE:LINE"``, named by every error."""
    check_messages(messages, row)
    names = image_list(images, row)
    images = [open_image(v, row) for v in names]
    text = _render(vp, messages, row=row)
    _check_image_parts(vp, messages, text, len(images), row)
    if vp.processor is not None:
        try:
            out = vp.processor(text=[text], images=images or None, return_tensors="np")
        except (ValueError, OSError, TypeError) as err:
            if images:
                _image_features(vp, images, names, row)  # names the image the processor refuses
            raise PackingError(f"{where_of(row)}: the processor refuses the sample: {err}") from err
        ids = np.asarray(out["input_ids"][0], np.int64)
        grid = np.asarray(out.get("image_grid_thw", np.zeros((0, 3))), np.int64).reshape(-1, 3)
        pixels = out.get("pixel_values")
    else:
        grid = np.zeros((0, 3), np.int64)
        pixels = None
        if images:
            feats = _image_features(vp, images, names, row)
            grid = np.asarray(feats["image_grid_thw"], np.int64).reshape(-1, 3)
            pixels = feats["pixel_values"]
        ids = np.asarray(vp.tokenizer(_expand(vp, text, grid))["input_ids"], np.int64)
    row_out = {"input_ids": ids, "mm_token_type_ids": (ids == vp.image_token_id).astype(np.int64)}
    row_out["assistant_masks"] = assistant_mask(vp, messages, ids, grid, row)
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


def _check_image_parts(vp: VisionProcessor, messages: Any, text: str, images: int, row: int | str) -> None:
    """Refuse a sample whose rendered ``text`` holds another number of image parts than its ``images``, and one
    whose messages' text holds the image placeholder itself: the processor expands every placeholder of the
    rendered text, so a literal one would take an image (or be counted as an image part) at the text's spot."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        texts = [content] if isinstance(content, str) else []
        for part in content if isinstance(content, list) else []:
            texts += [v for v in part.values() if isinstance(v, str)] if isinstance(part, dict) else []
        if any(vp.image_token in t for t in texts):
            raise PackingError(
                f"{where_of(row)}: message {i} holds the image placeholder {vp.image_token!r} literally in its text; "
                f"the processor would expand it as an image. Remove it from the text (an image goes in an "
                f'{{"type": "image"}} part, with its entry in the images column).',
                param="messages",
            )
    parts = text.count(vp.image_token)
    if parts != images:
        raise PackingError(
            f"{where_of(row)}: its messages hold {parts} image part(s) but its images column has {images} "
            f"image(s); every image part needs exactly one image, in order.",
            param="images",
        )


def _expand(vp: VisionProcessor, text: str, grid: np.ndarray) -> str:
    """``text`` with its k-th image placeholder repeated as many times as image k has tokens (``t*h*w/merge²``)."""
    parts = text.split(vp.image_token)
    counts = grid.prod(axis=1) // (vp.merge_size**2)
    return parts[0] + "".join(vp.image_token * int(n) + p for n, p in zip(counts, parts[1:]))


def assistant_mask(
    vp: VisionProcessor, messages: Any, ids: np.ndarray, grid: np.ndarray, row: int | str = 0
) -> np.ndarray:
    """1 on the tokens of each assistant turn, 0 elsewhere, by the rule text chat's labels follow (the
    incremental rule): assistant message ``i`` covers the tokens between the rendering of ``messages[:i]``
    with the generation prompt and that of ``messages[:i + 1]``, each tokenized with its images expanded.
    :class:`~packtools.batches.vision.MultimodalCollator` (``assistant_only_loss=True``, its default) trains
    only these tokens; ``assistant_only_loss=False`` trains every text token.  A template whose renderings do
    not extend one another is refused by name."""
    mask = np.zeros(ids.shape[0], np.int64)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") == "assistant"):
            continue
        bounds = []
        for upto, prompt in ((i, True), (i + 1, False)):
            text = _render(vp, messages[:upto], prompt, row=row) if upto else ""
            n_img = text.count(vp.image_token)
            got = np.asarray(
                vp.tokenizer(_expand(vp, text, grid[:n_img]))["input_ids"] if text else [], np.int64
            )
            if got.shape[0] > ids.shape[0] or not np.array_equal(ids[: got.shape[0]], got):
                raise PackingError(
                    f"{where_of(row)}: the chat template's rendering of the first {upto} message(s) is not the start "
                    f"of the whole conversation's, so assistant message {i}'s tokens cannot be found (the "
                    f"assistant-only mask text chat uses). Use a template whose turns render incrementally.",
                    param="processor",
                )
            bounds.append(got.shape[0])
        mask[bounds[0] : bounds[1]] = 1
    return mask


def not_vision_rows(where: str, names: Sequence[str], messages: str = "messages") -> str:
    """The refusal of rows without ``messages`` given to ``processor=``: what they hold instead, and the way to
    pack that (already processed vision rows and tokenized rows pack as they are, text without a processor)."""
    found = f"{where} has no {messages!r} (it has {sorted(names)})"
    if "input_ids" in names and any(c in names for c in IMAGE_COLUMNS):
        return (
            f"{found}: these rows are already processed (input_ids with the image tokens, "
            f"{[c for c in IMAGE_COLUMNS if c in names]}), and processor= processes TRL's vision format "
            f"(messages with image parts + images). Pack them as they are, without processor=: "
            f"pack_dataset(ds, max_length) on a datasets.Dataset of these rows."
        )
    if "input_ids" in names:
        return (
            f"{found}: these rows are already tokenized text (input_ids, no images), and processor= processes TRL's "
            f"vision format (messages with image parts + images). Pack them as they are: leave processor= "
            f"(--processor) out."
        )
    return (
        f"{found}; processor= (--processor) packs TRL's vision format: a {messages!r} list whose contents have "
        f"{{'type': 'image'}} parts, and an 'images' list. Text or chat data without images packs without it "
        f"(with tokenizer=DIR, --tokenizer)."
    )


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
        raise PackingError(not_vision_rows("the dataset", names, messages), param="messages")
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

    # never from datasets' cache: its fingerprint covers the rows (image paths), not the image files' content
    return dataset.map(one, with_indices=True, remove_columns=names, load_from_cache_file=False)


def _render(vp: VisionProcessor, messages: Any, prompt: bool = False, *, row: int | str = 0) -> str:
    if vp.chat_template is None and vp.processor is None:
        raise PackingError(
            f"processor={vp.path!r} has no chat template to render messages.", param="processor"
        )
    try:
        if vp.processor is not None:
            return vp.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        return vp.tokenizer.apply_chat_template(
            messages, tokenize=False, chat_template=vp.chat_template, add_generation_prompt=prompt
        )
    except PackingError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError, transformers' ValueError...: named here
        raise PackingError(
            f"{where_of(row)}: the processor's chat template cannot render its messages: {err}",
            param="messages",
        ) from err


def vision_lengths(
    dataset: Any,
    processor: str | os.PathLike[str] | VisionProcessor,
    *,
    messages: str = "messages",
    images: str = "images",
) -> np.ndarray:
    """Token counts of rows in TRL's vision format as the model sees them (:func:`sample_length` of each row,
    no pixel processed); feed them to :func:`packtools.profile_lengths` to choose ``max_length``.  They are
    a :class:`~packtools.core.plan.WholeLengths` (a NumPy int64 array): vision samples are packed
    whole and a longer one is refused, so the profile's ``recommend()`` holds every sample."""
    from ...core.plan import WholeLengths

    vp = processor if isinstance(processor, VisionProcessor) else load_vision_processor(processor)
    lengths = [
        sample_length(vp, example[messages], example.get(images), i) for i, example in enumerate(dataset)
    ]
    return np.asarray(lengths, np.int64).view(WholeLengths)


def sample_length(vp: VisionProcessor, messages: Any, images: Any, row: int | str) -> int:
    """The tokens of one TRL vision sample as the model sees them (image tokens counted from the images' sizes
    through the image processor's resize rule, ``get_number_of_image_patches / merge²``), no pixel processed."""
    count = getattr(vp.image_processor, "get_number_of_image_patches", None)
    if count is None:
        raise PackingError(
            f"processor={vp.path!r}: its image processor cannot count patches from sizes.", param="processor"
        )
    check_messages(messages, row)
    sizes = [image_size(v, row) for v in image_list(images, row)]
    text = _render(vp, messages, row=row)
    _check_image_parts(vp, messages, text, len(sizes), row)
    tokens = len(vp.tokenizer(text)["input_ids"]) - len(sizes)
    return tokens + sum(int(count(h, w)) // vp.merge_size**2 for h, w in sizes)
