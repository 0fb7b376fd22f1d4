"""``pack_shards``, deprecated: call :func:`packtools.pack_files` with ``plan="shards"``.

There is one engine and one output format: ``pack_shards(inputs, out, max_length, ...)`` is
``pack_files(inputs, out, max_length, ..., plan="shards", part_rows=shard_rows)``, which plans every input part
(a parquet row-group range of about ``shard_rows`` rows, a JSON-lines byte range or a file) on its own and
writes the same ``datasets.load_from_disk`` folder with ``manifest.json``.  Calling it warns
(``DeprecationWarning``) and then makes exactly that call.

>>> import os, tempfile, warnings, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), os.path.join(d, "a.parquet"))
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     res = pack_shards([os.path.join(d, "a.parquet")], os.path.join(d, "out"), max_length=4)
>>> res.stats["rows_out"], res.stats["plan"], caught[0].category.__name__
(2, 'shards', 'DeprecationWarning')
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from .config import PipelineResult
from .run import pack_files

DEFAULT_SHARD_ROWS = 1 << 17
SHARDS_DEPRECATED = (
    "packtools.pack_shards is deprecated: call packtools.pack_files(inputs, out, max_length, strategy, "
    "plan='shards', part_rows=N) (the same engine and output; shard_rows is part_rows)"
)


def pack_shards(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    max_length: int,
    strategy: str = "bfd",
    columns: Sequence[str] | None = None,
    *,
    shard_rows: int | None = DEFAULT_SHARD_ROWS,
    **kwargs: Any,
) -> PipelineResult:
    """Deprecated: :func:`packtools.pack_files` with ``plan="shards"``; ``shard_rows`` is ``part_rows`` and
    ``kwargs`` go to :func:`~packtools.pack_files` (``executor``, ``workers``, ``address``, ``retries``, ...)."""
    warnings.warn(SHARDS_DEPRECATED, DeprecationWarning, stacklevel=2)
    if isinstance(columns, str):
        columns = [columns]
    return pack_files(
        inputs,
        out_dir,
        max_length,
        strategy,
        plan="shards",
        part_rows=shard_rows or DEFAULT_SHARD_ROWS,
        columns=tuple(columns) if columns else None,
        **kwargs,
    )
