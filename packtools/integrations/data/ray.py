"""Pack a ``ray.data.Dataset`` block by block (needs ``pip install 'packtools[ray]'``).

Each Ray Data block is packed on its own by :func:`packtools.pack_table` inside ``map_batches`` over pyarrow
batches with ``batch_size=None`` (one batch per block).  Block boundaries are chosen by Ray (file layout, target
block size, operator fusion, the number of CPUs) and are not deterministic: the same data can be packed into
different rows from run to run, and small blocks cost extra rows over the lower bound.  For reproducible,
resumable output with a manifest use :func:`packtools.pack_files` (``executor="ray"``) instead.

The packer changes the number of rows, so it is declared with ``udf_modifying_row_count=True`` where Ray has that
argument (Ray >= 2.52).  Ray 2.52 and 2.53 defaulted it to ``False`` and then pushed a downstream ``limit()`` /
``take()`` below the packer, packing only the first few input rows; older Ray never pushes a limit past
``map_batches``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..._optional import require
from ...core.pack import pack_table
from ...core.plan import Strategy, check_max_length, check_strategy


def _pack_block(batch: pa.Table, max_length: int, strategy: str, columns: list[str] | None) -> pa.Table:
    return pack_table(batch, max_length, strategy, columns)


def pack_ray_dataset(
    ds: Any, max_length: int, strategy: Strategy | str = "bfd", columns: Sequence[str] | None = None
) -> Any:
    """A lazy ``ray.data.Dataset`` of packed rows: every block of ``ds`` packed into rows of ``max_length``.

    ``columns`` as in :func:`packtools.pack_table` (default: all columns, which must all be list columns).

    >>> import ray  # doctest: +SKIP
    >>> ds = ray.data.read_parquet("tokenized/")  # doctest: +SKIP
    >>> pack_ray_dataset(ds, 4096, "bfd_split").write_parquet("packed/")  # doctest: +SKIP
    """
    require("ray.data", "pack_ray_dataset")
    max_length = check_max_length(max_length)
    strategy = check_strategy(strategy)
    if isinstance(columns, str):
        columns = [columns]
    kwargs: dict[str, Any] = {}
    if "udf_modifying_row_count" in inspect.signature(ds.map_batches).parameters:
        kwargs["udf_modifying_row_count"] = True
    return ds.map_batches(
        _pack_block,
        batch_format="pyarrow",
        batch_size=None,
        fn_kwargs={
            "max_length": max_length,
            "strategy": strategy,
            "columns": list(columns) if columns else None,
        },
        **kwargs,
    )
