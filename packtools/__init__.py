"""packtools: fast, exact sequence packing for LLM fine-tuning."""

from .constants import __version__ as __version__
from .core.pack import pack_table, truncate_table, unpack, warmup
from .core.plan import STRATEGIES, PackPlan, plan
from .errors import PackingError
from .integrations.datasets import pack_dataset, pack_preference, packed_view, truncate_dataset
from .profiling.profile import LengthProfile, profile_lengths

# Public names imported on first attribute access: modules that need torch or transformers, and the
# pipeline and scale-out modules (kept out of `import packtools`, which every worker process pays).
_LAZY = {
    "pack_files": "packtools.pipeline.run",
    "profile_files": "packtools.pipeline.profile",
    "pack_shards": "packtools.pipeline.shards",
    "pack_ray_dataset": "packtools.integrations.ray",
    "ArrowCollator": "packtools.batches.loader",
    "PackedRows": "packtools.batches.loader",
    "PackedView": "packtools.batches.view",
    "choose_buckets": "packtools.batches.buckets",
    "PaddingFreeCollator": "packtools.batches.collate",
    "TokenBudgetBatchSampler": "packtools.batches.sampler",
    "varlen_attention": "packtools.batches.attention",
    "prepare_trainer": "packtools.integrations.transformers",
    "check_isolation": "packtools.integrations.isolation",
    "packed_sft_config": "packtools.integrations.transformers",
    "PreferenceCollator": "packtools.batches.preference",
    "sequence_logps": "packtools.batches.logps",
    "prepare_dpo_trainer": "packtools.integrations.trl",
    "use_segmented_sdpa": "packtools.integrations.transformers",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packtools' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "ArrowCollator",
    "LengthProfile",
    "PackPlan",
    "PackedRows",
    "PackedView",
    "PackingError",
    "PaddingFreeCollator",
    "PreferenceCollator",
    "TokenBudgetBatchSampler",
    "check_isolation",
    "choose_buckets",
    "pack_dataset",
    "pack_files",
    "pack_preference",
    "pack_ray_dataset",
    "pack_shards",
    "pack_table",
    "packed_view",
    "packed_sft_config",
    "plan",
    "prepare_dpo_trainer",
    "prepare_trainer",
    "profile_files",
    "profile_lengths",
    "sequence_logps",
    "truncate_dataset",
    "truncate_table",
    "unpack",
    "use_segmented_sdpa",
    "varlen_attention",
    "warmup",
]
