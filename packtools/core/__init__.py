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

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".plan": ("STRATEGIES", "PackPlan"),
        ".pack": ("pack_table", "unpack", "truncate_table", "warmup"),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
