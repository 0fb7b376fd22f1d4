"""Adapters to other libraries: Hugging Face ``datasets``, ``transformers``/TRL trainers, Ray Data.

Each name is imported on first use (``datasets``, ``transformers``, ``trl`` or ``ray`` only then).
``pack_dataset``, ``packed_view``, ``prepare_trainer`` and ``prepare_dpo_trainer`` are also at the front door;
``prepare_reward_trainer`` (with ``pack_reward_pairs``) and ``prepare_kto_trainer`` run TRL's ``RewardTrainer``
and ``KTOTrainer`` padding-free.
``unprepare(trainer)`` undoes everything a ``prepare_*`` call changed; ``prepared(trainer, **kwargs)`` is
``prepare_trainer`` (``prepare_dpo_trainer`` for a ``DPOTrainer``) for the span of a ``with`` block.

>>> import datasets
>>> from packtools.integrations import truncate_dataset
>>> truncate_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 2)[:]["input_ids"]
[[1, 2], [4]]
"""

from .._lazy import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "pack_dataset": "packtools.integrations.data.datasets",
    "packed_view": "packtools.integrations.data.views",
    "truncate_dataset": "packtools.integrations.data.datasets",
    "pack_preference": "packtools.integrations.preference.data",
    "pack_ray_dataset": "packtools.integrations.data.ray",
    "prepare_trainer": "packtools.integrations.trainers.transformers",
    "prepared": "packtools.integrations.trainers.prepared_block",
    "unprepare": "packtools.compat",
    "packed_sft_config": "packtools.integrations.trainers.sft",
    "use_segmented_sdpa": "packtools.integrations.attention.backends",
    "check_isolation": "packtools.integrations.attention.isolation",
    "check_vision_isolation": "packtools.integrations.multimodal.models",
    "prepare_dpo_trainer": "packtools.integrations.preference.dpo",
    "prepare_reward_trainer": "packtools.integrations.preference.reward",
    "pack_reward_pairs": "packtools.integrations.preference.data",
    "prepare_kto_trainer": "packtools.integrations.preference.kto",
    "prepare_grpo_trainer": "packtools.integrations.rl.grpo",
    "use_cp_attention": "packtools.integrations.attention.context_parallel",
    "RankLayout": "packtools.integrations.parallel.layout",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports

__all__ = [
    "RankLayout",
    "check_isolation",
    "check_vision_isolation",
    "use_cp_attention",
    "pack_dataset",
    "pack_preference",
    "pack_ray_dataset",
    "pack_reward_pairs",
    "packed_sft_config",
    "packed_view",
    "prepare_dpo_trainer",
    "prepare_kto_trainer",
    "prepare_reward_trainer",
    "prepare_grpo_trainer",
    "prepare_trainer",
    "prepared",
    "truncate_dataset",
    "unprepare",
    "use_segmented_sdpa",
]
