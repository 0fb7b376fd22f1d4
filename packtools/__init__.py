"""packtools: fast, exact sequence packing for LLM fine-tuning."""

from .errors import PackingError
from .hf_datasets import pack_dataset, truncate_dataset
from .packing import pack_table, truncate_table, unpack
from .planning import STRATEGIES, PackPlan, plan, warmup
from .profile import LengthProfile, profile_lengths

__version__ = "0.1.0"

# Public names imported on first attribute access: modules that need torch or transformers, and the
# pipeline and scale-out modules (kept out of `import packtools`, which every worker process pays).
_LAZY = {
    "pack_files": "packtools.pipeline",
    "pack_shards": "packtools.shards",
    "pack_ray_dataset": "packtools.ray_data",
    "ArrowCollator": "packtools.loader",
    "PackedRows": "packtools.loader",
    "PaddingFreeCollator": "packtools.collate",
    "TokenBudgetBatchSampler": "packtools.sampler",
    "varlen_attention": "packtools.attention",
    "prepare_trainer": "packtools.hf",
    "packed_sft_config": "packtools.hf",
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
    "PackingError",
    "PaddingFreeCollator",
    "TokenBudgetBatchSampler",
    "pack_dataset",
    "pack_files",
    "pack_ray_dataset",
    "pack_shards",
    "pack_table",
    "packed_sft_config",
    "plan",
    "prepare_trainer",
    "profile_lengths",
    "truncate_dataset",
    "truncate_table",
    "unpack",
    "varlen_attention",
    "warmup",
]
