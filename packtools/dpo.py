"""Preference pairs (DPO) without padding: the names a DPO run uses, in one place.

``pack_preference``, ``PreferenceCollator``, ``sequence_logps``, ``prepare_dpo_trainer`` (also at the front
door) and the prompt-once names ``pack_groups``, ``TreeCollator``, ``use_tree_attention`` (each says what it
does; ``docs/preference.md``) live in ``packtools.integrations`` and ``packtools.batches``, imported on first use.

>>> import pyarrow as pa
>>> from packtools.dpo import pack_preference
>>> pairs = pa.table({"prompt_ids": [[1, 2]], "chosen_ids": [[3]], "rejected_ids": [[4, 5]]})
>>> pack_preference(pairs, max_length=8).column("seq_lengths").to_pylist()
[[3, 4]]
"""

from ._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".integrations.preference.data": ("pack_preference", "pack_groups"),
        ".batches.preference": ("PreferenceCollator",),
        ".batches.logps": ("sequence_logps",),
        ".integrations.preference.dpo": ("prepare_dpo_trainer",),
        ".batches.tree": ("TreeCollator",),
        ".integrations.attention.tree": ("use_tree_attention",),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
