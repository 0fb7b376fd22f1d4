"""``pack_dataset`` for processed vision-language rows: samples placed whole, their images with them.

A processed sample has its token columns (``input_ids``, ``labels``, ``mm_token_type_ids``, masks), whose
length already counts the image tokens the processor expanded, and per-sample image columns
(``pixel_values``: one list of patches; ``image_grid_thw``: one ``(t, h, w)`` per image).  Only ``bfd``
packs them: every sample goes whole into one row (a sample longer than ``max_length`` is refused, never
truncated, since cutting it would cut an image or its placeholder tokens), and each packed row gets its
samples' patches and grids concatenated in row order (:func:`~packtools.core.nested.gather_whole_samples`).
``bfd_split`` and ``wrapped`` are refused by name: they cut samples.

Memory: the packed rows are built in memory -- the token columns plus one copy of every pixel value
(``pixel_values`` of ``n`` patches of ``C*tp*p*p`` values per image; e.g. 1,176 float32 values = 4.6 kB per
patch for Qwen2-VL's 14-pixel patches), whatever ``keep_in_memory`` says.  Offline, out of core packing of
images is not available yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..core.arrow import is_list_type
from ..core.nested import check_whole_samples, gather_whole_samples
from ..core.pack import pack_columns, read_columns
from ..core.plan import PackPlan
from ..core.plan import plan as make_plan
from ..errors import PackingError

#: Per-sample image columns: they travel whole with their sample (never cut per token).
IMAGE_COLUMNS = ("pixel_values", "image_grid_thw")


def has_images(dataset_or_table: Any) -> bool:
    """Whether a ``Dataset`` or table carries per-sample image columns.

    >>> has_images(pa.table({"input_ids": [[1]], "image_grid_thw": [[[1, 2, 2]]]})), has_images(pa.table({"a": [1]}))
    (True, False)
    """
    names = getattr(dataset_or_table, "column_names", None) or []
    return any(c in names for c in IMAGE_COLUMNS)


def _check_patches(table: pa.Table) -> None:
    """Every sample's ``pixel_values`` hold exactly the patches its ``image_grid_thw`` announces."""
    if not all(c in table.column_names for c in IMAGE_COLUMNS):
        missing = [c for c in IMAGE_COLUMNS if c not in table.column_names]
        raise PackingError(
            f"the rows have image columns but not {missing}: keep both 'pixel_values' and 'image_grid_thw' "
            f"(the processor's output) so every image travels with its sample.",
            param="columns",
        )
    grid = table.column("image_grid_thw").combine_chunks()
    images = np.asarray(grid.value_lengths().fill_null(0), np.int64)
    sides = np.asarray(grid.flatten().flatten(), np.int64) if len(grid) else np.zeros(0, np.int64)
    if sides.shape[0] != 3 * int(images.sum()):
        raise PackingError("'image_grid_thw' must hold three sides (t, h, w) per image.", param="columns")
    prods = sides.reshape(-1, 3).prod(axis=1)
    expected = np.zeros(images.shape[0], np.int64)
    np.add.at(expected, np.repeat(np.arange(images.shape[0]), images), prods)
    patches = np.asarray(table.column("pixel_values").combine_chunks().value_lengths().fill_null(0), np.int64)
    bad = np.flatnonzero(patches != expected)
    if bad.size:
        r = int(bad[0])
        raise PackingError(
            f"row {r}: 'pixel_values' holds {patches[r]} patches but its image_grid_thw gives {expected[r]}; "
            f"pass the processor's output for every sample unchanged."
        )


def pack_vision_table(
    table: pa.Table,
    indices: np.ndarray | None,
    max_length: int,
    strategy: str,
    columns: Sequence[str] | None,
    *,
    shuffle: bool,
    seed: int,
) -> tuple[pa.Table, PackPlan]:
    """Pack processed vision-language samples whole (``bfd`` only), images in row order; the plan too.

    ``indices`` maps the dataset's rows to rows of ``table`` (a ``select``/``shuffle`` mapping), or None.
    """
    if strategy != "bfd":
        raise PackingError(
            f"strategy={strategy!r} cuts samples, and a vision-language sample cut in two splits an image from "
            f"its placeholder tokens; multimodal rows are packed with strategy='bfd' (every sample whole).",
            param="strategy",
        )
    names = list(table.column_names) if columns is None else list(columns)
    left_out = [c for c in IMAGE_COLUMNS if c in table.column_names and c not in names]
    if left_out:
        raise PackingError(
            f"columns={names} leaves out {left_out}: the packed rows would lose their images. Include them.",
            param="columns",
        )
    _check_patches(table)
    token_names = [n for n in names if n not in IMAGE_COLUMNS]
    non_list = [
        n for n in token_names if n in table.column_names and not is_list_type(table.schema.field(n).type)
    ]
    if non_list:
        raise PackingError(
            f"columns {non_list} are not list columns, so they cannot be packed; pass columns=[...] with the "
            f"token and image columns (the others are left out), or remove {non_list} first.",
            param="columns",
        )
    cols, lengths = read_columns(table, token_names)
    if indices is not None:
        lengths = lengths[indices]
    over = np.flatnonzero(lengths > max_length)
    if over.size:
        r = int(over[0])
        raise PackingError(
            f"sample {r} has {int(lengths[r])} tokens (image tokens included) > max_length={max_length}, and "
            f"{over.size} sample(s) in all: multimodal samples are never truncated (an image would be cut). Raise "
            f"max_length (packtools.profile_lengths shows the lengths) or drop those samples.",
            param="max_length",
        )
    p = make_plan(lengths, max_length, "bfd")
    if shuffle:
        p = p.shuffled(seed)
    check_whole_samples(p, "samples with images")
    packed = pack_columns(cols, p, indices)
    for name in IMAGE_COLUMNS:
        packed = packed.append_column(name, gather_whole_samples(table.column(name), p, indices))
    return packed, p
