"""The offline job: input files -> (tokenize) -> one global plan -> packed output folder, on any executor.

``pack_files`` (also at the front door, and ``packtools pack`` on the command line) is the one engine:
``plan="global"`` (default) or ``plan="shards"`` (every input part planned on its own).

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> from packtools.pipeline import pack_files
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), os.path.join(d, "a.parquet"))
>>> pack_files(os.path.join(d, "a.parquet"), os.path.join(d, "out"), max_length=4).stats["rows_out"]
2
"""

from .._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".run": ("pack_files", "run_pipeline"),
        ".config": ("PipelineConfig", "PipelineResult"),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
