"""Padding-free batches of vision-language rows: the text batch of ``PaddingFreeCollator`` plus the images.

A row is a processed sample (or a packed row of several, with ``seq_lengths``): ``input_ids`` with the
processor's image tokens, ``pixel_values`` (the row's image patches, images in row order) and ``image_grid_thw``
(one ``(t, h, w)`` row per image).  :class:`MultimodalCollator` lays the rows end to end like
:class:`~packtools.batches.collate.PaddingFreeCollator` and adds each document's own rotary positions
(:mod:`packtools.batches.mrope`), the images in row order (the vision tower attends within each image, so images
of different documents never mix), ``mm_token_type_ids``, and -100 on every image token.  A row whose image
tokens do not match its images, a column it does not carry (unless ``leave_out`` lists it) and any video input
are refused by name (docs/vision.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._optional import require
from ..compat.transformers import attn_implementation
from ..constants import ANYRES_COLUMNS, IGNORE_INDEX, IMAGE_COLUMNS, PIXEL_MASK, VIDEO_COLUMNS
from ..errors import PackingError
from .collate import PaddingFreeCollator, to_tensors
from .flatten import CARRIED_KEYS, check_carried, check_leave_out, flatten_rows
from .mrope import (
    MropeSpec,
    anyres_image_tokens,
    anyres_tiles,
    check_grid,
    document_positions,
    grid_runs,
    image_token_runs,
)

#: The per-row image columns this collator consumes (everything else goes to the text collator; Gemma 3's
#: ``token_type_ids`` too, :func:`image_columns`).
VISION_COLUMNS = (*IMAGE_COLUMNS, "mm_token_type_ids")

#: The processors' video columns (:data:`~packtools.constants.VIDEO_COLUMNS` and what travels with them): refused
#: by name (videos are not verified; see :mod:`.mrope`), even when ``leave_out`` lists them.
VIDEO_ROW_COLUMNS = (*VIDEO_COLUMNS, "second_per_grid_ts", "video_metadata", "image_sizes_videos")


def image_columns(spec: MropeSpec) -> tuple[str, ...]:
    """The row columns a :class:`MultimodalCollator` for ``spec`` reads besides the text ones: what it takes out
    of the text rows, and what a trainer must keep through ``remove_unused_columns``.

    >>> image_columns(MropeSpec("qwen2_vl", 9, 8, 2))
    ('pixel_values', 'image_grid_thw', 'mm_token_type_ids')
    """
    blocks = ("token_type_ids",) if spec.image_blocks else ()
    anyres = ANYRES_COLUMNS if spec.anyres is not None else ()
    return (*VISION_COLUMNS, *blocks, *anyres, *((PIXEL_MASK,) if spec.tiles else ()))


def _refuse_image_grid(i: int, row: Mapping[str, Any], spec: MropeSpec) -> None:
    """Refuse row ``i``'s ``image_grid_thw`` for a model of 1-D positions (``spec.flat``), which takes no image
    grid: the row was processed for another model."""
    if row.get("image_grid_thw") is not None and np.asarray(row["image_grid_thw"]).size:
        raise PackingError(
            f"row {i} has 'image_grid_thw' but {spec.model_type!r} takes no image grid: the row was processed "
            f"for another model; process it again with this model's processor.",
            param="image_grid_thw",
        )


def check_no_video(features: Sequence[Mapping[str, Any]]) -> None:
    """Refuse, by name, a row with a video column."""
    for i, row in enumerate(features):
        if isinstance(row, Mapping):
            video = [k for k in VIDEO_ROW_COLUMNS if k in row]
            if video:
                raise PackingError(
                    f"row {i} has the video column(s) {video}: packtools packs images only (video positions "
                    f"are not verified). Drop the video samples and columns, or train them unpacked.",
                    param="features",
                )


def _pixels(value: Any, row: int, patches: int, width: int | None) -> np.ndarray | None:
    if value is None or (patches == 0 and np.asarray(value).size == 0):
        if patches:
            raise PackingError(
                f"row {row} has image tokens and image_grid_thw ({patches} patches) but no 'pixel_values'; "
                f"keep the processor's pixel_values column with the row."
            )
        return None
    arr = np.asarray(value)
    if arr.ndim != 2 or arr.shape[0] != patches or arr.dtype.kind != "f":
        raise PackingError(
            f"row {row}: 'pixel_values' has shape {arr.shape} ({arr.dtype}) but its image_grid_thw gives "
            f"{patches} patches; pass the processor's float pixel_values, one patch per line, images in row order."
        )
    if width is not None and arr.shape[1] != width:
        raise PackingError(
            f"row {row}: 'pixel_values' has {arr.shape[1]} values per patch but the model's vision tower reads "
            f"{width} (in_channels x temporal_patch_size x patch_size**2): the row was processed with another "
            f"model's processor. Process the rows again with this model's processor folder.",
            param="pixel_values",
        )
    return arr


def _tile_masks(value: Any, pixels: np.ndarray, row: int, model_type: str) -> np.ndarray:
    """A row's ``pixel_attention_mask`` for its ``pixels`` (Idefics3 / SmolVLM tiles), checked: one
    ``(size, size)`` mask of 0/1 per tile, no tile masked whole, and no tile all zeros (the model drops an all-zero
    tile as padding: its tokens would then have no features)."""
    tiles = pixels.shape[0]
    if value is None:
        raise PackingError(
            f"row {row} has {tiles} image tile(s) but no 'pixel_attention_mask': {model_type!r} reads each tile "
            f"with its mask (the padded pixels of a tile are masked out). Keep the processor's "
            f"pixel_attention_mask column with the rows (pack_dataset carries it).",
            param=PIXEL_MASK,
        )
    mask = np.asarray(value)
    if mask.shape != (tiles, *pixels.shape[2:]) or not np.isin(mask, (0, 1)).all():
        raise PackingError(
            f"row {row}: 'pixel_attention_mask' has shape {mask.shape} ({mask.dtype}) but its pixel_values hold "
            f"{tiles} tile(s) of {tuple(pixels.shape[2:])} pixels: one 0/1 mask per tile, as the processor gives "
            f"it; re-process the row.",
            param=PIXEL_MASK,
        )
    empty = [t for t in range(tiles) if not mask[t].any()]
    zero = [t for t in range(tiles) if not pixels[t].any()]
    if empty or zero:
        what = f"tile(s) {empty} fully masked" if empty else f"tile(s) {zero} all zeros"
        raise PackingError(
            f"row {row}: {what}: {model_type!r} takes an all-zero tile for padding and drops it (and a fully "
            f"masked tile has no pixels to read), so its image tokens would have no features. Re-process the row "
            f"with the model's processor.",
            param=PIXEL_MASK if empty else "pixel_values",
        )
    return mask.astype(np.int64)


def _row_walk(features: Sequence[Mapping[str, Any]], flat: Any) -> Any:
    """Each row with its tokens in the flat batch: ``(row index, row, ids, offset of its first token, documents)``,
    ``documents`` a list of ``(document index, start in the row, length)``; an empty row has no ids, no documents
    (``flatten_rows`` keeps no segment for it).  Nothing is checked here: the callers check rows in their order."""
    seg_at = tok_at = kept = 0
    for i, row in enumerate(features):
        n = len(np.asarray(row["input_ids"]))
        if n == 0:
            yield i, row, flat.input_ids[tok_at:tok_at], tok_at, []
            continue
        segs = flat.seg_lengths[seg_at : seg_at + int(flat.segs_per_row[kept])].tolist()
        seg_at += len(segs)
        kept += 1
        starts = np.concatenate([[0], np.cumsum(segs)[:-1]]).tolist()
        yield i, row, flat.input_ids[tok_at : tok_at + n], tok_at, list(zip(range(len(segs)), starts, segs))
        tok_at += n


def image_block_masks(
    positions: np.ndarray, is_image: np.ndarray, sliding_window: int | None
) -> dict[str, Any]:
    """Each document's own masks over a packed row, as transformers builds them for the document alone in a model
    whose images attend bidirectionally within themselves (Gemma 3, :data:`~.mrope.IMAGE_BLOCK_TYPES`): a query
    sees the keys of its document that are causal or in its own image; under a sliding window also only keys
    less than ``sliding_window`` behind it.  Boolean ``[1, 1, T, T]`` (True: attend), by layer type.

    ``positions`` restart at 0 at every document (the collator's text row).

    >>> m = image_block_masks(np.array([0, 1, 2, 0, 1, 2]), np.array([0, 1, 1, 0, 1, 1], bool), 2)
    >>> m["full_attention"][0, 0].astype(int).tolist()
    [[1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    >>> m["sliding_attention"][0, 0, 2].astype(int).tolist()
    [0, 1, 1, 0, 0, 0]
    """
    doc = np.cumsum(positions == 0)
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    starts |= is_image & (positions == 0)  # an image at a document's start opens a block of its own
    block = np.where(is_image, np.cumsum(starts), 0)  # 0: text (no block)
    index = np.arange(positions.shape[0])
    same_block = (block[:, None] == block[None, :]) & (block[:, None] > 0)
    full = (doc[:, None] == doc[None, :]) & ((index[None, :] <= index[:, None]) | same_block)
    masks = {"full_attention": full[None, None]}
    if sliding_window is not None:
        masks["sliding_attention"] = (full & (index[None, :] > index[:, None] - sliding_window))[None, None]
    return masks


#: How :class:`MultimodalCollator` gives the masks of :data:`~.mrope.IMAGE_BLOCK_TYPES` (Gemma 3): ``"dense"``,
#: boolean ``[1, 1, T, T]`` tensors by layer type (what ``sdpa`` reads: ``T²`` bytes each, 1 GiB at 32,768 tokens);
#: ``"per_document"``, a :class:`DocumentBlockMask` by layer type (``T`` bytes; what ``packtools_sdpa`` reads, one
#: document's block at a time).
IMAGE_MASK_FORMS = ("dense", "per_document")


def document_block(is_image: Any, sliding_window: int | None) -> Any:
    """One document's mask (torch boolean ``[1, 1, L, L]``, True: attend) from its image tokens (a torch boolean
    ``[L]``): :func:`image_block_masks` of that document alone, built on ``is_image``'s device.

    >>> import torch
    >>> document_block(torch.tensor([False, True, True]), 2)[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 1], [0, 1, 1]]
    """
    torch = require("torch", "MultimodalCollator's per-document masks")
    length = is_image.shape[0]
    previous = torch.cat([is_image.new_zeros(1), is_image[:-1]])
    block = torch.where(is_image, torch.cumsum(is_image & ~previous, 0), 0)  # 0: text (no block)
    index = torch.arange(length, device=is_image.device)
    mask = (index[None, :] <= index[:, None]) | ((block[:, None] == block[None, :]) & (block[:, None] > 0))
    if sliding_window is not None:
        mask &= index[None, :] > index[:, None] - sliding_window
    return mask[None, None]


class DocumentBlockMask:
    """One layer type's mask of a packed Gemma 3 row, kept per document: the documents' boundaries and which
    tokens are image tokens (``T`` bytes instead of the ``T²`` of the dense mask).  Each document's block is
    :func:`document_block` of it alone, and nothing crosses a boundary: what ``packtools_sdpa`` reads
    (:mod:`packtools.integrations.attention.segmented`).  Any other backend that slices it or adds it to its
    scores as a tensor (``flex_attention``, ``eager``), or hands it to a torch function (plain ``sdpa``), is stopped
    with a :class:`~packtools.errors.PackingError` naming the fix (never a silently different mask;
    ``guard_model`` and ``prepare_trainer`` refuse it by name first).

    >>> m = DocumentBlockMask([0, 3, 5], np.array([0, 1, 1, 0, 1], bool), None)
    >>> m.shape, m.dense()[0, 0].astype(int).tolist()
    ((1, 1, 5, 5), [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    """

    def __init__(self, bounds: Sequence[int], is_image: np.ndarray, sliding_window: int | None) -> None:
        self.bounds = [int(b) for b in bounds]
        self.is_image = np.ascontiguousarray(is_image, dtype=bool)
        self.sliding_window = sliding_window
        total = int(self.is_image.shape[0])
        if not self.bounds or self.bounds[0] != 0 or self.bounds[-1] != total:
            raise PackingError(f"document bounds {self.bounds} do not cover the row's {total} tokens.")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise PackingError(f"document bounds {self.bounds} are not strictly increasing.")
        self.shape = (1, 1, total, total)
        self._ends = dict(zip(self.bounds, self.bounds[1:]))
        self._on: dict[str, Any] = {}
        # additive blocks on the device of ``_on``, weakly: each lives while autograd holds it for a backward, not
        # as long as the batch (Trainer keeps an accumulation window's batches through the optimizer step)
        self._built: dict[tuple[int, Any], Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # pickled (a DataLoader worker's batch, torch.save) without the blocks built in a forward (weak references)
        return {**vars(self), "_on": {}, "_built": {}}

    def __repr__(self) -> str:
        return (
            f"DocumentBlockMask({len(self.bounds) - 1} documents, {self.shape[-1]} tokens, "
            f"sliding_window={self.sliding_window})"
        )

    def plain_causal(self, bounds: Sequence[int]) -> list[bool]:
        """For each document, whether its block is the plain causal triangle (no image token, and no window or
        one at least as long as the document)."""
        self.check_bounds(bounds)
        window = self.sliding_window
        return [
            not self.is_image[a:b].any() and (window is None or b - a <= window)
            for a, b in zip(self.bounds, self.bounds[1:])
        ]

    def check_bounds(self, bounds: Sequence[int]) -> None:
        """Refuse boundaries other than this mask's documents (a block would then span two documents)."""
        if list(bounds) != self.bounds:
            raise PackingError(
                f"the batch's cu_seq_lens {list(bounds)} are not the documents of its per-document masks "
                f"{self.bounds}: the batch was changed after MultimodalCollator made it. Collate and pass it whole.",
                param="attention_mask",
            )

    def block(self, start: int, end: int, device: Any = None, dtype: Any = None) -> Any:
        """The ``[1, 1, L, L]`` block of the document ``start:end`` on ``device``: torch boolean (True: attend),
        built at each call; or, given a floating ``dtype``, its additive form (0 where it attends, ``-inf``
        elsewhere: what ``scaled_dot_product_attention`` turns a boolean mask into, so the same result), built once
        per document, device and dtype while autograd holds it (a weak reference on this mask: freed by the
        backward, not kept with the batch).  Every layer of the type shares that one tensor: autograd saves a
        layer's mask for its backward, one copy per layer when each builds its own."""
        if self._ends.get(start) != end:
            raise PackingError(f"tokens {start}:{end} are not one document of {self.bounds}.")
        key = str(device)
        if key not in self._on:
            torch = require("torch", "MultimodalCollator's per-document masks")
            self._on = {key: torch.from_numpy(self.is_image).to(device)}  # one device at a time
            self._built = {}
        if dtype is None:
            return document_block(self._on[key][start:end], self.sliding_window)
        held = self._built.get((start, dtype))
        additive = None if held is None else held()
        if additive is None:
            keep = document_block(self._on[key][start:end], self.sliding_window)
            additive = keep.new_zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
            self._built[start, dtype] = weakref.ref(additive)
        return additive

    def dense(self) -> np.ndarray:
        """The whole row's boolean ``[1, 1, T, T]`` mask (``T²`` bytes: for checks and small rows)."""
        out = np.zeros(self.shape, bool)
        for a, b in zip(self.bounds, self.bounds[1:]):
            out[0, 0, a:b, a:b] = self.block(a, b, "cpu").numpy()[0, 0]
        return out

    def full(self, device: Any = None) -> Any:
        """:meth:`dense` as a torch tensor on ``device``."""
        torch = require("torch", "MultimodalCollator's per-document masks")
        return torch.from_numpy(self.dense()).to(device)

    def __getitem__(self, item: Any) -> Any:
        raise _whole_row_refusal("")

    def __add__(self, other: Any) -> Any:  # a backend adding it to its scores: same refusal
        raise _whole_row_refusal("")

    __radd__ = __add__

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """A torch function handed the mask as a tensor (plain ``sdpa`` passes it to
        ``scaled_dot_product_attention`` as ``attn_mask``, ``eager`` adds it to its scores): refused by name,
        naming the fix (torch raised a ``TypeError`` from inside transformers)."""
        raise _whole_row_refusal(f" (it handed it to torch's {getattr(func, '__name__', func)}())")


def _whole_row_refusal(how: str) -> PackingError:
    return PackingError(
        f"a per-document Gemma 3 mask (MultimodalCollator(image_masks='per_document')) reached an attention "
        f"backend that reads masks as whole-row tensors{how}, which it is not: load the model with "
        f"attn_implementation='packtools_sdpa' (packtools.integrations.attention.segmented.register(); "
        f"prepare_trainer switches 'sdpa' to it), or collate with image_masks='dense' on 'sdpa'.",
        param="attention_mask",
    )


class MultimodalCollator:
    """Collate processed vision-language rows (packed or one sample each) into one padding-free batch.

    ``model`` is the model, its config or an :class:`~packtools.batches.mrope.MropeSpec` (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Qwen3.5, LLaVA, InternVL, Gemma 3, Idefics3, SmolVLM, LLaVA-NeXT, LLaVA-OneVision; others are
    refused by name).  LLaVA-NeXT and LLaVA-OneVision (``spec.anyres``) get the text row as ``position_ids`` and
    :func:`anyres_images`' ``pixel_values`` (tiles padded to the batch's most), ``image_sizes`` and OneVision's
    ``batch_num_images``.  For LLaVA, InternVL, Gemma 3, Idefics3 and SmolVLM (``spec.flat``) ``position_ids`` are
    the text row ``[1, T]``, ``pixel_values`` ``(images, channels, size, size)``, and there is no ``image_grid_thw`` /
    ``mm_token_type_ids``; Idefics3 and SmolVLM (``spec.tiles``) get ``pixel_values`` ``(1, tiles, channels, size,
    size)`` and ``pixel_attention_mask`` ``(1, tiles, size, size)``, every tile of the batch in row order, each row's
    mask required and checked; Gemma 3 (``spec.image_blocks``) also gets ``token_type_ids`` (1 on
    image tokens) and ``attention_mask``, each document's own masks by layer type: ``image_masks='dense'``
    (:func:`image_block_masks`, ``T²`` bytes each, what ``sdpa`` reads) or ``'per_document'``
    (:class:`DocumentBlockMask`, ``T`` bytes each, what ``packtools_sdpa`` reads); ``None`` picks
    ``'per_document'`` for a model on ``packtools_sdpa``, else ``'dense'`` (a spec names no backend).  The text options are those of
    :class:`~packtools.batches.collate.PaddingFreeCollator` (``seq_idx`` is off by default: Qwen3.5's gated DeltaNet
    layers get their documents from the text row, :mod:`packtools.integrations.attention.mixers`).  Output keys: ``input_ids``, ``labels`` ``[1, T]``,
    ``position_ids`` ``(4, 1, T)``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``mm_token_type_ids`` ``[1, T]``,
    ``use_cache=False`` (as :class:`~packtools.batches.collate.PaddingFreeCollator`'s: ``model(**batch)`` needs
    nothing else), and, when the batch holds images, ``pixel_values`` and ``image_grid_thw``.

    >>> import numpy as np
    >>> spec = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)
    >>> rows = [{"input_ids": [1, 9, 2, 3, 4], "seq_lengths": [3, 2], "image_grid_thw": [[1, 2, 2]],
    ...          "pixel_values": np.zeros((4, 6), np.float32)}]
    >>> b = MultimodalCollator(spec, 0, return_tensors="np")(rows)
    >>> b["position_ids"][:, 0].tolist(), b["labels"].tolist(), b["image_grid_thw"].tolist()
    ([[0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1]], [[-100, -100, 2, -100, 4]], [[1, 2, 2]])
    """

    def __init__(
        self,
        model: Any,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        return_tensors: str = "pt",
        *,
        unpacked: bool = False,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = True,
        return_flash_attn_kwargs: bool = True,
        return_seq_idx: bool = False,
        return_mm_token_type_ids: bool = True,
        return_use_cache: bool = True,
        leave_out: Sequence[str] = (),
        image_masks: str | None = None,
    ) -> None:
        self.spec = (
            model if isinstance(model, MropeSpec) else MropeSpec.from_config(getattr(model, "config", model))
        )
        if image_masks is None:  # the form the model's backend reads (a spec names none: dense)
            config = None if isinstance(model, MropeSpec) else getattr(model, "config", model)
            image_masks = "per_document" if attn_implementation(config) == "packtools_sdpa" else "dense"
        if image_masks not in IMAGE_MASK_FORMS:
            raise PackingError(
                f"image_masks must be one of {list(IMAGE_MASK_FORMS)} (or None: 'per_document' for a model on "
                f"'packtools_sdpa', else 'dense'), got {image_masks!r}.",
                param="image_masks",
            )
        self.image_masks = image_masks
        self.text = PaddingFreeCollator(
            pad_token_id,
            pad_to_multiple_of,
            True,
            "np",
            unpacked=unpacked,
            return_flash_attn_kwargs=return_flash_attn_kwargs,
            return_seq_idx=return_seq_idx,
            return_use_cache=return_use_cache,
            completion_only_loss=completion_only_loss,
            assistant_only_loss=assistant_only_loss,
        )
        if return_tensors not in ("pt", "np"):
            raise PackingError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}.")
        self.return_tensors = return_tensors
        self.return_mm_token_type_ids = bool(return_mm_token_type_ids)
        self.leave_out = check_leave_out(leave_out)

    def options(self) -> dict[str, Any]:
        """The constructor arguments (``MultimodalCollator(**c.options())`` copies it)."""
        text = self.text.options()
        keep = (
            "pad_token_id",
            "pad_to_multiple_of",
            "unpacked",
            "completion_only_loss",
            "assistant_only_loss",
        )
        return {
            "model": self.spec,
            **{k: text[k] for k in keep},
            "return_tensors": self.return_tensors,
            "return_flash_attn_kwargs": text["return_flash_attn_kwargs"],
            "return_seq_idx": text["return_seq_idx"],
            "return_mm_token_type_ids": self.return_mm_token_type_ids,
            "return_use_cache": text["return_use_cache"],
            "leave_out": self.leave_out,
            "image_masks": self.image_masks,
        }

    def replace(self, **changes: Any) -> MultimodalCollator:
        return type(self)(**{**self.options(), **changes})

    def __repr__(self) -> str:
        return f"MultimodalCollator({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise PackingError(f"features must be a non-empty list of rows, got {type(features).__name__}.")
        check_no_video(features)
        # Gemma 3's processor gives token_type_ids (1 on image tokens): checked, and made again for the batch
        consumed = frozenset(image_columns(self.spec))
        check_carried(features, self.leave_out, CARRIED_KEYS | consumed, "MultimodalCollator")
        text_rows = [
            {k: v for k, v in row.items() if k not in consumed} if isinstance(row, Mapping) else row
            for row in features
        ]
        flat = flatten_rows(text_rows, self.text.mask_keys)
        batch = self.text.collate_flat(flat)
        if self.spec.anyres is not None:  # LLaVA-NeXT / OneVision: 1-D positions, images of any size
            is_image = batch["input_ids"][0] == self.spec.image_token_id
            batch["labels"][0, is_image] = IGNORE_INDEX
            batch.update(anyres_images(features, flat, self.spec))
            return to_tensors(batch, self.return_tensors)
        if self.spec.flat:  # 1-D positions: the text row's, restarting at every document
            pixels, masks = self._flat_images(features, flat)
            is_image = batch["input_ids"][0] == self.spec.image_token_id
            batch["labels"][0, is_image] = IGNORE_INDEX
            if pixels:
                batch["pixel_values"] = np.concatenate(pixels) if len(pixels) > 1 else pixels[0]
            if pixels and self.spec.tiles:  # one batch entry holding every tile of the batch, in row order
                batch["pixel_values"] = batch["pixel_values"][None]
                batch[PIXEL_MASK] = np.concatenate(masks)[None]
            if not self.spec.image_blocks:
                return to_tensors(batch, self.return_tensors)
            batch["token_type_ids"] = is_image.astype(np.int64)[None]
            out = to_tensors(batch, self.return_tensors)
            out["attention_mask"] = self._image_block_masks(batch["position_ids"][0], is_image)
            return out
        total = int(flat.input_ids.shape[0])
        width = int(batch["input_ids"].shape[1])
        positions = np.empty((4, width), np.int64)
        positions[0] = batch["position_ids"][0]
        positions[1:, total:] = positions[0, total:]  # the padding segment: plain text positions
        grids, pixels = self._place_images(features, flat, positions)
        ids = batch["input_ids"][0]
        is_image = ids == self.spec.image_token_id
        labels = batch["labels"]
        labels[0, is_image] = IGNORE_INDEX
        batch["position_ids"] = positions[:, None, :]
        if self.return_mm_token_type_ids:
            batch["mm_token_type_ids"] = is_image.astype(np.int64)[None]
        if grids:
            batch["pixel_values"] = np.concatenate(pixels) if len(pixels) > 1 else pixels[0]
            batch["image_grid_thw"] = np.concatenate(grids)
        return to_tensors(batch, self.return_tensors)

    def _image_block_masks(self, positions: np.ndarray, is_image: np.ndarray) -> dict[str, Any]:
        """Each document's masks by layer type, in the form of ``image_masks``."""
        window = self.spec.sliding_window
        if self.image_masks == "dense":
            return to_tensors(image_block_masks(positions, is_image, window), self.return_tensors)
        starts = np.flatnonzero(positions[1:] == 0) + 1  # documents restart at 0 (as image_block_masks reads)
        bounds = [0, *starts.tolist(), int(positions.shape[0])]
        masks = {"full_attention": DocumentBlockMask(bounds, is_image, None)}
        if window is not None:
            masks["sliding_attention"] = DocumentBlockMask(bounds, is_image, window)
        return masks

    def _place_images(
        self, features: Sequence[Mapping[str, Any]], flat: Any, positions: np.ndarray
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Fill ``positions[1:]`` document by document; the rows' grids and pixels, in row order."""
        grids: list[np.ndarray] = []
        pixels: list[np.ndarray] = []
        for i, row, ids, tok_at, documents in _row_walk(features, flat):
            grid = check_grid(row.get("image_grid_thw"), "image_grid_thw", i)
            pix = _pixels(row.get("pixel_values"), i, int(grid.prod(axis=1).sum()), self.spec.patch_width)
            if not len(ids):
                if grid.shape[0]:
                    raise PackingError(
                        f"row {i} is empty but has {grid.shape[0]} image(s) in image_grid_thw."
                    )
                continue
            self._check_types(row, i, ids)
            used = 0
            for d, start, length in documents:
                doc = ids[start : start + length]
                k = len(image_token_runs(doc, self.spec.image_token_id)[0])
                try:
                    pos = document_positions(doc, grid[used : used + k], self.spec, doc=d)
                except PackingError as err:
                    raise PackingError(f"row {i}: {err}") from None
                positions[1:, tok_at + start : tok_at + start + length] = pos
                used += k
            _check_all_used(f"row {i}", used, grid.shape[0], "image_grid_thw", "runs of image tokens")
            if grid.shape[0]:
                grids.append(grid)
                pixels.append(pix)
        return grids, pixels

    def _flat_images(
        self, features: Sequence[Mapping[str, Any]], flat: Any
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The rows' ``(images, channels, size, size)`` pixels, in row order, each document's image tokens checked
        against them: runs of ``image_tokens`` tokens per image (a LLaVA-style spec); and, for
        :data:`~.mrope.TILE_MODEL_TYPES`, the rows' ``pixel_attention_mask`` ``(tiles, size, size)`` (empty
        otherwise)."""
        spec = self.spec
        per = int(spec.image_tokens or 0)
        pixels: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        for i, row, ids, _, documents in _row_walk(features, flat):
            _refuse_image_grid(i, row, spec)
            images = 0
            if len(ids):
                self._check_types(row, i, ids)
            for d, start, length in documents:
                images += fixed_runs(ids[start : start + length], spec, f"row {i}, document {d}")
            value = row.get("pixel_values")
            try:
                arr = None if value is None else np.asarray(value)
            except ValueError:  # images of different shapes (any-resolution tiles: another model's rows)
                raise PackingError(
                    f"row {i}: 'pixel_values' holds images of different shapes but {spec.model_type!r} reads "
                    f"(images, channels, size, size): process the row with this model's processor.",
                    param="pixel_values",
                ) from None
            count = 0 if arr is None or arr.size == 0 else int(arr.shape[0])
            shape = spec.image_shape  # None (a spec built by hand): any (channels, size, size) is taken
            if count and (
                arr.ndim != 4
                or (shape is not None and tuple(arr.shape[1:]) != shape)
                or arr.dtype.kind != "f"
            ):
                raise PackingError(
                    f"row {i}: 'pixel_values' has shape {arr.shape} ({arr.dtype}) but {spec.model_type!r} reads "
                    f"float images of shape (images, {'channels, size, size' if shape is None else shape}): process "
                    f"the row with this model's processor.",
                    param="pixel_values",
                )
            if count != images:
                padded = (
                    " (a processor called on several samples at once pads each to the most tiles with all-zero "
                    "tiles: process one sample at a time)"
                    if spec.tiles and count > images
                    else ""
                )
                raise PackingError(
                    f"row {i}: 'pixel_values' holds {count} image(s) but its input_ids hold {images} "
                    f"({per} image tokens each); every image must travel with its sample (re-process the "
                    f"row){padded}.",
                    param="pixel_values",
                )
            if count:
                pixels.append(arr)
                if spec.tiles:
                    masks.append(_tile_masks(row.get(PIXEL_MASK), arr, i, spec.model_type))
            elif spec.tiles and row.get(PIXEL_MASK) is not None and np.asarray(row[PIXEL_MASK]).size:
                raise PackingError(
                    f"row {i} has a 'pixel_attention_mask' but no images; re-process the row.",
                    param=PIXEL_MASK,
                )
        return pixels, masks

    def _check_types(self, row: Mapping[str, Any], i: int, ids: np.ndarray) -> None:
        for name in (
            ("mm_token_type_ids", "token_type_ids") if self.spec.image_blocks else ("mm_token_type_ids",)
        ):
            given = row.get(name)
            if given is None:
                continue
            arr = np.asarray(given)
            if arr.shape != ids.shape or not np.array_equal(arr != 0, ids == self.spec.image_token_id):
                raise PackingError(
                    f"row {i}: {name!r} does not mark exactly the image tokens (id "
                    f"{self.spec.image_token_id}) of its input_ids; re-process the row.",
                    param=name,
                )


def _anyres_pixels(value: Any, row: int, count: int, spec: MropeSpec) -> list[np.ndarray]:
    """A row's ``pixel_values`` as ``count`` arrays ``(tiles, channels, size, size)``: the processor's
    ``(images, tiles, ...)`` (tiles padded to its most) or a packed row's list of them (tiles differ by image)."""
    if value is None:
        items: list[Any] = []
    elif isinstance(value, np.ndarray) and value.dtype != object:
        if value.size and value.ndim != 5:
            raise PackingError(
                f"row {row}: 'pixel_values' has shape {value.shape} but {spec.model_type!r} reads (images, tiles, "
                f"channels, size, size), as its processor gives: process the row with this model's processor.",
                param="pixel_values",
            )
        items = list(value)
    else:
        items = list(value)
    out = [np.asarray(item) for item in items]
    shape = spec.image_shape
    for arr in out:
        if arr.ndim != 4 or arr.dtype.kind != "f" or (shape is not None and tuple(arr.shape[1:]) != shape):
            raise PackingError(
                f"row {row}: 'pixel_values' holds an image of shape {arr.shape} ({arr.dtype}) but "
                f"{spec.model_type!r} reads float images of tiles (images, tiles, "
                f"{'channels, size, size' if shape is None else ', '.join(map(str, shape))}): process the row "
                f"with this model's processor.",
                param="pixel_values",
            )
    if len(out) != count:
        raise PackingError(
            f"row {row}: 'pixel_values' holds {len(out)} image(s) but its 'image_sizes' {count}: every image "
            f"travels with its size (re-process the row).",
            param="pixel_values",
        )
    return out


def _anyres_sizes(value: Any, row: int, spec: MropeSpec) -> np.ndarray:
    sizes = np.zeros((0, 2), np.int64) if value is None else np.asarray(value)
    if sizes.size == 0:
        return np.zeros((0, 2), np.int64)
    if sizes.ndim != 2 or sizes.shape[1] != 2 or sizes.dtype.kind not in "iu" or sizes.min() < 1:
        raise PackingError(
            f"row {row}: 'image_sizes' must be one positive (height, width) per image, got {sizes.tolist()}: "
            f"pass the processor's image_sizes for the row.",
            param="image_sizes",
        )
    return sizes.astype(np.int64)


def anyres_images(features: Sequence[Mapping[str, Any]], flat: Any, spec: MropeSpec) -> dict[str, np.ndarray]:
    """The images of any-resolution rows (:data:`~.mrope.ANYRES_MODEL_TYPES`) as the model reads a batch of them:
    ``pixel_values`` ``(images, tiles, channels, size, size)`` in row order, each image's own tiles then zeros up to
    the batch's most (the model reads each image's first :func:`~.mrope.anyres_tiles`), ``image_sizes``, and for
    OneVision ``batch_num_images``, the rows' own entries in order (the model tiles an image only when its entry is
    1, as the processor did).  Every document's image tokens are checked against its images'
    :func:`~.mrope.anyres_image_tokens`, by row: a wrong count would put image features on other tokens."""
    grid = spec.anyres
    assert grid is not None
    tiles: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    numbers: list[int] = []
    for i, row, ids, _, documents in _row_walk(features, flat):
        _refuse_image_grid(i, row, spec)
        if spec.video_token_id is not None and np.any(ids == spec.video_token_id):
            raise PackingError(
                f"row {i} holds video tokens (id {spec.video_token_id}): packtools packs {spec.model_type!r} images "
                f"only (videos are not verified). Drop the video samples or train them unpacked.",
                param="input_ids",
            )
        row_sizes = _anyres_sizes(row.get("image_sizes"), i, spec)
        image_tokens = int(np.count_nonzero(ids == spec.image_token_id))
        if image_tokens and not row_sizes.shape[0]:
            raise PackingError(
                f"row {i} has {image_tokens} image tokens but no 'image_sizes': {spec.model_type!r} reads each "
                f"image's tokens from its original size. Keep the processor's image_sizes column with the rows "
                f"(prepare_trainer keeps it through remove_unused_columns).",
                param="image_sizes",
            )
        pixels = _anyres_pixels(row.get("pixel_values"), i, row_sizes.shape[0], spec)
        tiled, entries = _tiled(row, i, row_sizes.shape[0], spec)
        used = _check_documents(i, ids, documents, row_sizes, tiled, spec) if len(ids) else 0
        _check_all_used(f"row {i}", used, row_sizes.shape[0], "image_sizes", "images")
        for j, (h, w) in enumerate(row_sizes.tolist()):
            need = anyres_tiles(grid, h, w, tiled[j])
            if pixels[j].shape[0] < need:
                raise PackingError(
                    f"row {i}: image {j} of size {[h, w]} has {pixels[j].shape[0]} tile(s) in 'pixel_values' but "
                    f"{spec.model_type!r} reads {need} for it: re-process the row.",
                    param="pixel_values",
                )
            tiles.append(pixels[j][:need])
        sizes.append(row_sizes)
        numbers += entries
    if not tiles:
        return {}
    most = max(t.shape[0] for t in tiles)
    out = np.zeros((len(tiles), most, *tiles[0].shape[1:]), np.result_type(*tiles))
    for j, t in enumerate(tiles):
        out[j, : t.shape[0]] = t
    batch = {"pixel_values": out, "image_sizes": np.concatenate(sizes)}
    if spec.model_type == "llava_onevision":
        batch["batch_num_images"] = np.asarray(numbers, np.int64)
    return batch


def _tiled(row: Mapping[str, Any], i: int, images: int, spec: MropeSpec) -> tuple[list[bool], list[int]]:
    """Whether each of the row's images is tiled, and the row's ``batch_num_images`` entries (non-zero).
    LLaVA-NeXT tiles every image; OneVision an image whose processor call gave its sample one image (the row's
    ``batch_num_images``: a sample's images given as a list of their own count as one sample of several, given one
    by one as samples of one)."""
    if spec.model_type != "llava_onevision":
        return [True] * images, []
    given = row.get("batch_num_images")
    entries = [] if given is None else [int(n) for n in np.asarray(given).reshape(-1) if int(n)]
    if sum(entries) != images or any(n < 0 for n in entries):
        raise PackingError(
            f"row {i}: 'batch_num_images' {given!r} does not count its {images} image(s) (image_sizes): "
            f"LLaVA-OneVision tiles an image only when its sample has one, so the processor's count of images per "
            f"sample is needed. Keep the processor's batch_num_images column with the rows.",
            param="batch_num_images",
        )
    return [n == 1 for n in entries for _ in range(n)], entries


def _check_documents(
    i: int, ids: np.ndarray, documents: Any, sizes: np.ndarray, tiled: list[bool], spec: MropeSpec
) -> int:
    """Check each document's image tokens against the counts of the row's next images (in order, as many as add
    up to its tokens, each run of them ending where an image ends); the images the documents hold."""
    grid = spec.anyres
    assert grid is not None
    at = 0
    for d, start, length in documents:
        starts, stops = image_token_runs(ids[start : start + length], spec.image_token_id)
        runs = (stops - starts).tolist()
        total, got, k = sum(runs), 0, 0
        expected: list[int] = []
        while got < total and at + k < sizes.shape[0]:
            expected.append(anyres_image_tokens(grid, *sizes[at + k].tolist(), tiled[at + k]))
            got += expected[-1]
            k += 1
        # every run ends where an image ends (images may be adjacent, one run; an image is never split by text)
        ends = set(np.cumsum(expected).tolist())
        if got != total or not set(np.cumsum(runs).tolist()) <= ends:
            hint = (
                " (OneVision: an image is tiled only when its batch_num_images entry is 1)"
                if spec.model_type == "llava_onevision"
                else ""
            )
            raise PackingError(
                f"row {i}, document {d}: its image tokens (id {spec.image_token_id}) form runs of {runs} tokens, "
                f"but its image(s) of sizes {sizes[at : at + k].tolist()} (image_sizes) are {expected} tokens for "
                f"{spec.model_type!r} (tiles, unpadding and newline tokens from the size){hint}: each image needs "
                f"exactly its own tokens. Process the sample with this model's own processor, and keep its "
                f"image_sizes and batch_num_images with it.",
                param="input_ids",
            )
        at += k
    return at


def fixed_runs(ids: np.ndarray, spec: MropeSpec, where: str) -> int:
    """The images (tiles, for :data:`~.mrope.TILE_MODEL_TYPES`) one document's image tokens ``ids`` hold under a
    LLaVA-style spec (``flat``: a fixed ``image_tokens`` per image), refusing runs that are not whole images: the
    one rule ``MultimodalCollator`` and ``guard_model`` apply (a run cut short or grown moves every later image's
    features onto other tokens)."""
    per = int(spec.image_tokens or 0)
    run_starts, run_stops = image_token_runs(ids, spec.image_token_id)
    runs = run_stops - run_starts
    if per < 1 or np.any(runs % per):
        raise PackingError(
            f"{where}: its image tokens (id {spec.image_token_id}) form runs of {runs.tolist()} tokens, but each "
            f"image of {spec.model_type!r} is {per} tokens: process the sample with the model's own processor.",
            param="input_ids",
        )
    return int(runs.sum()) // per


def _check_all_used(where: str, used: int, given: int, column: str, what: str) -> None:
    """Refuse images given in ``column`` that the documents' image tokens do not all use, or too few."""
    if used != given:
        raise PackingError(
            f"{where}: {column!r} has {given} image(s) but the input_ids hold {used} {what}: every image must "
            f"travel with its sample (re-process the row).",
            param=column,
        )


def check_batch_images(
    spec: MropeSpec, ids: np.ndarray, starts: Sequence[int], inputs: Mapping[str, Any]
) -> None:
    """Check a packed batch's per-image inputs against each document's image tokens by the collator's own rules
    (what ``guard_model`` applies to a forward built by a collator of one's own): Qwen-VL's ``image_grid_thw``
    (:func:`~.mrope.grid_runs`), LLaVA-NeXT's / OneVision's ``image_sizes`` (and ``batch_num_images``:
    :func:`_check_documents`), and the LLaVA-style types' fixed runs (Idefics3 / SmolVLM tiles included:
    :func:`fixed_runs`).  ``ids``: the batch's ``input_ids`` as one sequence (rows in order), ``starts``: its
    documents' first tokens (0 first).  Images are matched to image tokens by order alone, so two images' sizes or
    grids swapped, or a document's token count off, would give features to the wrong document, with no error.

    >>> spec = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)
    >>> check_batch_images(spec, np.array([1, 9, 9, 0, 9, 9, 9, 9]), [0, 3], {"image_grid_thw": [[1, 2, 4], [1, 4, 4]]})
    >>> check_batch_images(spec, np.array([1, 9, 9, 0, 9, 9, 9, 9]), [0, 3], {"image_grid_thw": [[1, 4, 4], [1, 2, 4]]})
    Traceback (most recent call last):
    packtools.errors.PackingError: document 0: its image tokens (id 9) form runs of [2] tokens but its image_grid_thw [[1, 4, 4]] gives [4] ...
    """
    bounds = [*starts, int(ids.shape[0])]
    documents = [(d, a, b - a) for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    if spec.anyres is not None:
        sizes = _anyres_sizes(host_numpy(inputs.get("image_sizes")), 0, spec)
        if inputs.get("batch_num_images") is None:  # the model then tiles every image (its own default)
            tiled = [True] * sizes.shape[0]
        else:
            numbers = {"batch_num_images": host_numpy(inputs["batch_num_images"])}
            tiled = _tiled(numbers, 0, sizes.shape[0], spec)[0]
        used = _check_documents(0, ids, documents, sizes, tiled, spec)
        _check_all_used("the batch", used, sizes.shape[0], "image_sizes", "images")
    elif spec.flat:
        for d, a, n in documents:
            fixed_runs(ids[a : a + n], spec, f"document {d}")
    else:
        grid = check_grid(host_numpy(inputs.get("image_grid_thw")), "image_grid_thw")
        used = 0
        for d, a, n in documents:
            doc = ids[a : a + n]
            k = len(image_token_runs(doc, spec.image_token_id)[0])
            grid_runs(doc, grid[used : used + k], spec, doc=d)
            used += k
        _check_all_used("the batch", used, grid.shape[0], "image_grid_thw", "runs of image tokens")


def host_numpy(value: Any) -> Any:
    """A tensor's values as a NumPy array (a small per-image input: sizes, grids, counts), else ``value``."""
    to_cpu = getattr(value, "cpu", None)
    return value.detach().cpu().numpy() if callable(to_cpu) else value
