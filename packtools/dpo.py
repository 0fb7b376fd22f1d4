"""Preference pairs (DPO) without padding: the names a DPO run uses, in one place.

``pack_preference`` packs whole pairs into rows, ``PreferenceCollator`` lays packed pairs out as one
padding-free row (or TRL's padded layout), ``sequence_logps`` sums the log-probabilities of each sequence of a
packed batch, and ``prepare_dpo_trainer`` (also at the front door) runs TRL's ``DPOTrainer`` padding-free.  They
live in ``packtools.integrations`` and ``packtools.batches``; each is imported on first use.

>>> import pyarrow as pa
>>> from packtools.dpo import pack_preference
>>> pairs = pa.table({"prompt_ids": [[1, 2]], "chosen_ids": [[3]], "rejected_ids": [[4, 5]]})
>>> pack_preference(pairs, max_length=8).column("seq_lengths").to_pylist()
[[3, 4]]
"""

from ._lazy import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "pack_preference": "packtools.integrations.preference.data",
    "PreferenceCollator": "packtools.batches.preference",
    "sequence_logps": "packtools.batches.logps",
    "prepare_dpo_trainer": "packtools.integrations.preference.dpo",
    "pack_groups": "packtools.integrations.preference.data",
    "TreeCollator": "packtools.batches.tree",
    "use_tree_attention": "packtools.integrations.attention.tree",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports

# (ruff cannot see names that __getattr__ provides)
__all__ = [  # noqa: F822
    "PreferenceCollator",
    "TreeCollator",
    "pack_groups",
    "pack_preference",
    "prepare_dpo_trainer",
    "sequence_logps",
    "use_tree_attention",
]
