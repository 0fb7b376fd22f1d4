"""packtools: fast, exact sequence packing for LLM fine-tuning.

The front door holds what most runs call: pack (``pack_dataset``, ``pack_table``, ``pack_files``), view
(``packed_view``), plan (``plan``, ``PackPlan``), collate (``PaddingFreeCollator``), prepare a trainer
(``prepare_trainer``, ``prepare_dpo_trainer``, ``prepare_grpo_trainer``), profile (``profile_lengths``) and the error (``PackingError``).
Everything else lives in a namespace named for what it is: ``packtools.core``, ``packtools.batches``,
``packtools.integrations``, ``packtools.pipeline``, ``packtools.profiling`` and ``packtools.dpo``.
"""

from ._lazy import lazy_exports
from .constants import __version__ as __version__
from .errors import PackingError

# Every name but the error is imported on first use: `import packtools` (which every worker process and every
# `packtools` command pays) imports neither Numba, the kernels, pyarrow's compute functions, torch nor the
# pipeline until a name that needs them is read.
_LAZY = {
    "pack_table": "packtools.core.pack",
    "plan": "packtools.core.plan",
    "PackPlan": "packtools.core.plan",
    "packed_view": "packtools.integrations.data.views",
    "pack_dataset": "packtools.integrations.data.datasets",
    "profile_lengths": "packtools.profiling.profile",
    "pack_files": "packtools.pipeline.run",
    "profile_files": "packtools.pipeline.profile",
    "PaddingFreeCollator": "packtools.batches.collate",
    "prepare_trainer": "packtools.integrations.trainers.transformers",
    "prepare_dpo_trainer": "packtools.integrations.preference.dpo",
    "prepare_grpo_trainer": "packtools.integrations.rl.grpo",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
del lazy_exports

__all__ = [
    "PackPlan",
    "PackingError",
    "PaddingFreeCollator",
    "pack_dataset",
    "pack_files",
    "pack_table",
    "packed_view",
    "plan",
    "prepare_dpo_trainer",
    "prepare_grpo_trainer",
    "prepare_trainer",
    "profile_files",
    "profile_lengths",
]
