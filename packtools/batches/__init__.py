"""Padding-free training batches: collators, the Arrow-native loader, the token-budget sampler, varlen attention.

The names below need torch (``packtools[torch]``) when used, except :class:`PackedView`, ``choose_buckets`` and
the sampler; each is imported on first use.

>>> from packtools.batches import TokenBudgetBatchSampler
>>> list(TokenBudgetBatchSampler([3, 2, 2, 1], max_tokens=4, shuffle=False))
[[0, 3], [1, 2]]
"""

from .._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".collate": ("PaddingFreeCollator",),
        ".context_parallel": ("ContextParallelCollator",),
        ".loader": ("ArrowCollator", "PackedRows"),
        ".view": ("PackedView",),
        ".sampler": ("TokenBudgetBatchSampler",),
        ".buckets": ("choose_buckets",),
        ".attention": ("varlen_attention",),
        ".preference": ("PreferenceCollator",),
        ".logps": ("sequence_logps",),
        ".vision": ("MultimodalCollator",),
        ".mrope": ("MropeSpec",),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
