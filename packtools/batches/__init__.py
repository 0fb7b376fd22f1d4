"""Padding-free training batches: collators, the Arrow-native loader, the token-budget sampler, varlen attention.

The names below need torch (``packtools[torch]``) when used, except :class:`PackedView`, ``choose_buckets`` and
the sampler; each is imported on first use.

>>> from packtools.batches import TokenBudgetBatchSampler
>>> list(TokenBudgetBatchSampler([3, 2, 2, 1], max_tokens=4, shuffle=False))
[[0, 3], [1, 2]]
"""

from .._lazy import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "PaddingFreeCollator": "packtools.batches.collate",
    "ContextParallelCollator": "packtools.batches.context_parallel",
    "ArrowCollator": "packtools.batches.loader",
    "PackedRows": "packtools.batches.loader",
    "PackedView": "packtools.batches.view",
    "TokenBudgetBatchSampler": "packtools.batches.sampler",
    "choose_buckets": "packtools.batches.buckets",
    "varlen_attention": "packtools.batches.attention",
    "PreferenceCollator": "packtools.batches.preference",
    "sequence_logps": "packtools.batches.logps",
    "MultimodalCollator": "packtools.batches.vision",
    "MropeSpec": "packtools.batches.mrope",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports

__all__ = [
    "ArrowCollator",
    "ContextParallelCollator",
    "MropeSpec",
    "MultimodalCollator",
    "PackedRows",
    "PackedView",
    "PaddingFreeCollator",
    "PreferenceCollator",
    "TokenBudgetBatchSampler",
    "choose_buckets",
    "sequence_logps",
    "varlen_attention",
]
