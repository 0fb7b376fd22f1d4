"""packtools: fast, exact sequence packing for LLM fine-tuning.

The front door holds what most runs call: pack (``pack_dataset``, ``pack_table``, ``pack_files``), view
(``packed_view``), plan (``plan``, ``PackPlan``), collate (``PaddingFreeCollator``), prepare a trainer
(``prepare_trainer``, ``prepare_dpo_trainer``), profile (``profile_lengths``) and the error (``PackingError``).
Everything else lives in a namespace named for what it is: ``packtools.core``, ``packtools.batches``,
``packtools.integrations``, ``packtools.pipeline``, ``packtools.profiling`` and ``packtools.dpo``.
"""

from ._lazy import lazy_exports, moved_to
from .constants import __version__ as __version__
from .errors import PackingError

# Every name but the error is imported on first use: `import packtools` (which every worker process and every
# `packtools` command pays) imports neither Numba, the kernels, pyarrow's compute functions, torch nor the
# pipeline until a name that needs them is read.
_LAZY = {
    "pack_table": "packtools.core.pack",
    "plan": "packtools.core.plan",
    "PackPlan": "packtools.core.plan",
    "packed_view": "packtools.integrations.dataset_views",
    "pack_dataset": "packtools.integrations.datasets",
    "profile_lengths": "packtools.profiling.profile",
    "pack_files": "packtools.pipeline.run",
    "profile_files": "packtools.pipeline.profile",
    "PaddingFreeCollator": "packtools.batches.collate",
    "prepare_trainer": "packtools.integrations.transformers",
    "prepare_dpo_trainer": "packtools.integrations.trl",
}

# Names that left the front door: they still resolve here, with a DeprecationWarning naming the new home.
_MOVED = {
    **{n: moved_to("packtools.core", n) for n in ("STRATEGIES", "truncate_table", "unpack", "warmup")},
    **{
        n: moved_to("packtools.batches", n)
        for n in (
            "ArrowCollator",
            "PackedRows",
            "PackedView",
            "TokenBudgetBatchSampler",
            "choose_buckets",
            "varlen_attention",
        )
    },
    **{
        n: moved_to("packtools.integrations", n)
        for n in (
            "truncate_dataset",
            "pack_ray_dataset",
            "packed_sft_config",
            "use_segmented_sdpa",
            "check_isolation",
        )
    },
    **{n: moved_to("packtools.dpo", n) for n in ("pack_preference", "PreferenceCollator", "sequence_logps")},
    "LengthProfile": moved_to("packtools.profiling", "LengthProfile"),
    "pack_shards": ("packtools.pipeline.shards", None),  # deprecated as a whole: calling it warns
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY, _MOVED)
del lazy_exports, moved_to

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
    "prepare_trainer",
    "profile_files",
    "profile_lengths",
]
