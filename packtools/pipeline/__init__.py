"""The offline job: input files -> (tokenize) -> one global plan -> packed output folder, on any executor.

``pack_files`` (also at the front door, and ``packtools pack`` on the command line) is the one engine:
``plan="global"`` (default) or ``plan="shards"`` (every input part planned on its own).
"""

from .._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".run": ("pack_files", "run_pipeline"),
        ".config": ("PipelineConfig", "PipelineResult"),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
