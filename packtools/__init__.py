"""packtools: fast, exact sequence packing for LLM fine-tuning.

The front door holds what most runs call: pack (``pack_dataset``, ``pack_table``, ``pack_files``), view
(``packed_view``), plan (``plan``, ``PackPlan``), collate (``PaddingFreeCollator``), prepare a trainer
(``prepare_trainer``, ``prepare_dpo_trainer``, ``prepare_grpo_trainer``), profile (``profile_lengths``) and the error (``PackingError``).
Everything else lives in a namespace named for what it is: ``packtools.core``, ``packtools.batches``,
``packtools.integrations``, ``packtools.pipeline``, ``packtools.profiling`` and ``packtools.dpo``.
"""

from ._lazy import lazy_exports
from .constants import __version__ as __version__
from .errors import PackingError as PackingError

# Every name but the error is imported on first use: `import packtools` (which every worker process and every
# `packtools` command pays) imports neither Numba, the kernels, pyarrow's compute functions, torch nor the
# pipeline until a name that needs them is read.
_EXPORTS = lazy_exports(
    globals(),
    {
        ".core.pack": ("pack_table",),
        ".core.plan": ("plan", "PackPlan"),
        ".integrations.data.views": ("packed_view",),
        ".integrations.data.datasets": ("pack_dataset",),
        ".profiling.profile": ("profile_lengths",),
        ".pipeline.run": ("pack_files",),
        ".pipeline.profile": ("profile_files",),
        ".batches.collate": ("PaddingFreeCollator",),
        ".integrations.trainers.transformers": ("prepare_trainer",),
        ".integrations.preference.dpo": ("prepare_dpo_trainer",),
        ".integrations.rl.grpo": ("prepare_grpo_trainer",),
    },
)

del lazy_exports

__all__ = sorted(["PackingError", *_EXPORTS])
