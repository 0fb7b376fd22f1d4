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
from ...core.pack import pack_table, refuse_pixel_columns
from ...core.plan import Strategy, check_max_length, check_strategy


def pack_ray_dataset(
    ds: Any, max_length: int, strategy: Strategy | str = "bfd", columns: Sequence[str] | None = None
) -> Any:
    """A lazy ``ray.data.Dataset`` of packed rows: every block of ``ds`` packed into rows of ``max_length``.

    ``columns`` as in :func:`packtools.pack_table` (default: all columns, which must all be list columns).
    Processed vision-language rows (:data:`~packtools.constants.PIXEL_COLUMNS`) and audio rows
    (:data:`~packtools.constants.AUDIO_COLUMNS`) are refused whatever ``columns`` says, here when ``ds`` knows its
    schema, else by ``pack_table`` at the first block: left out, their placeholder tokens would train without their
    pixels or audio.

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
    refuse_pixel_columns(names, "pack_ray_dataset", "ds")
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
