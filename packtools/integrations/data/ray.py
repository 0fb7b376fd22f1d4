"""Pack a ``ray.data.Dataset`` block by block (needs ``pip install 'packtools[ray]'``).

Each Ray Data block is packed on its own by :func:`packtools.pack_table`; block boundaries are Ray's and not
deterministic, so for reproducible, resumable output with a manifest use :func:`packtools.pack_files`
(``executor="ray"``) instead (``docs/scale-out.md``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..._optional import require
from ...constants import IMAGE_COLUMNS, VIDEO_COLUMNS
from ...core.pack import pack_table, video_refusal
from ...core.plan import Strategy, check_max_length, check_strategy
from ...errors import PackingError


def pack_ray_dataset(
    ds: Any, max_length: int, strategy: Strategy | str = "bfd", columns: Sequence[str] | None = None
) -> Any:
    """A lazy ``ray.data.Dataset`` of packed rows: every block of ``ds`` packed into rows of ``max_length``.

    ``columns`` as in :func:`packtools.pack_table` (default: all columns, which must all be list columns).
    Processed vision-language rows (:data:`~packtools.constants.PIXEL_COLUMNS`) are refused whatever ``columns``
    says, here when ``ds`` knows its schema, else by ``pack_table`` at the first block: left out, their image
    placeholder tokens would train without pixels.

    >>> import ray  # doctest: +SKIP
    >>> ds = ray.data.read_parquet("tokenized/")  # doctest: +SKIP
    >>> pack_ray_dataset(ds, 4096, "bfd_split").write_parquet("packed/")  # doctest: +SKIP
    """
    require("ray.data", "pack_ray_dataset")
    max_length = check_max_length(max_length)
    strategy = check_strategy(strategy)
    if isinstance(columns, str):
        columns = [columns]
    schema = ds.schema(fetch_if_missing=False)  # None when knowing it would run the dataset
    names = getattr(schema, "names", None) or []
    if videos := [c for c in VIDEO_COLUMNS if c in names]:
        raise PackingError(video_refusal("pack_ray_dataset", videos), param="ds")
    if images := [c for c in IMAGE_COLUMNS if c in names]:
        raise PackingError(
            f"the dataset holds processed vision-language rows ({images}), and pack_ray_dataset packs token "
            f"columns only: packed without them (whatever columns= names), each image's placeholder tokens would "
            f"stay in input_ids with no pixels. Pack them with packtools.pack_dataset(datasets.Dataset, "
            f"max_length) (each sample whole, its images in row order; docs/vision.md), or, to train the text "
            f"alone, remove {images} and their placeholder tokens from the rows first.",
            param="ds",
        )
    kwargs: dict[str, Any] = {}
    # the packer changes the row count; Ray 2.52-2.53 default the argument to False and then push a downstream
    # limit() below the packer, which packs only the first rows
    if "udf_modifying_row_count" in inspect.signature(ds.map_batches).parameters:
        kwargs["udf_modifying_row_count"] = True
    return ds.map_batches(
        pack_table,  # each block: pack_table(block, **fn_kwargs)
        batch_format="pyarrow",
        batch_size=None,
        fn_kwargs={
            "max_length": max_length,
            "strategy": strategy,
            "columns": list(columns) if columns else None,
        },
        **kwargs,
    )
