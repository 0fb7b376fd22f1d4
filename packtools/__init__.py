"""packtools: fast, exact sequence packing for LLM fine-tuning."""

from .errors import PackingError
from .hf_datasets import pack_dataset, truncate_dataset
from .packing import pack_table, truncate_table, unpack
from .pipeline import pack_files
from .planning import STRATEGIES, PackPlan, plan, warmup
from .profile import LengthProfile, profile_lengths
from .ray_data import pack_ray_dataset
from .shards import pack_shards

__version__ = "0.1.0"

# Public names whose modules need torch or transformers: imported on first attribute access.
_LAZY = {
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
