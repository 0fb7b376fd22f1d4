"""packtools: fast, exact sequence packing for LLM fine-tuning."""

from .errors import PackingError
from .hf_datasets import pack_dataset, truncate_dataset
from .packing import pack_table, truncate_table, unpack
from .planning import STRATEGIES, PackPlan, plan, warmup

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "PackPlan",
    "PackingError",
    "pack_dataset",
    "pack_table",
    "plan",
    "truncate_dataset",
    "truncate_table",
    "unpack",
    "warmup",
]
