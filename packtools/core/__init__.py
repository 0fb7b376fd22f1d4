"""The packing engine on plain arrays: Numba kernels, plans, the Arrow door and the gather.

Nothing here imports from any other packtools subpackage (only ``packtools.errors`` and
``packtools.constants``).  Its public names (``packtools.plan`` and ``packtools.pack_table`` are also at the
front door; ``packtools.core.plan`` is the module of plans):

>>> import pyarrow as pa
>>> from packtools.core import STRATEGIES, pack_table, unpack
>>> STRATEGIES
('bfd', 'bfd_split', 'wrapped')
>>> table = pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]})
>>> packed = pack_table(table, max_length=4)
>>> packed.column("seq_lengths").to_pylist(), unpack(packed).column("input_ids").to_pylist()
([[3, 1], [2]], [[1, 2, 3], [6], [4, 5]])
"""

from .._lazy import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "STRATEGIES": "packtools.core.plan",
    "PackPlan": "packtools.core.plan",
    "pack_table": "packtools.core.pack",
    "unpack": "packtools.core.pack",
    "truncate_table": "packtools.core.pack",
    "warmup": "packtools.core.pack",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports

__all__ = ["PackPlan", "STRATEGIES", "pack_table", "truncate_table", "unpack", "warmup"]
