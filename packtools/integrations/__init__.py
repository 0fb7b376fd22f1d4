"""Adapters to other libraries: Hugging Face ``datasets``, ``transformers``/TRL trainers, Ray Data.

Each name is imported on first use (``datasets``, ``transformers``, ``trl`` or ``ray`` only then).
``unprepare(trainer)`` undoes everything a ``prepare_*`` call changed; ``prepared(trainer, **kwargs)`` is the
``prepare_*`` of the trainer's kind for the span of a ``with`` block.

>>> import datasets
>>> from packtools.integrations import truncate_dataset
>>> truncate_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 2)[:]["input_ids"]
[[1, 2], [4]]
"""

from .._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".data.datasets": ("pack_dataset", "truncate_dataset"),
        ".data.views": ("packed_view",),
        ".preference.data": ("pack_preference", "pack_reward_pairs"),
        ".data.ray": ("pack_ray_dataset",),
        ".trainers.transformers": ("prepare_trainer",),
        ".trainers.prepared_block": ("prepared",),
        "..compat": ("unprepare",),
        ".trainers.sft": ("packed_sft_config",),
        ".attention.backends": ("use_segmented_sdpa",),
        ".attention.isolation": ("check_isolation",),
        ".multimodal.models": ("check_vision_isolation",),
        ".preference.dpo": ("prepare_dpo_trainer",),
        ".preference.reward": ("prepare_reward_trainer",),
        ".preference.kto": ("prepare_kto_trainer",),
        ".rl.grpo": ("prepare_grpo_trainer",),
        ".rl.distillation": ("prepare_distillation_trainer",),
        ".attention.context_parallel": ("use_cp_attention",),
        ".parallel.layout": ("RankLayout",),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
