"""Sequence-length profiles, the max_length tradeoff table, plots and the HTML report.

``profile_lengths`` is also at the front door; the plots need ``packtools[plot]`` (matplotlib, imported when
they are called).

>>> from packtools.profiling import LengthProfile, profile_lengths
>>> isinstance(profile_lengths([10, 200, 3000, 45]), LengthProfile)
True
"""

from .._lazy import lazy_exports

# the module that defines each public name (imported on first use)
_EXPORTS = lazy_exports(
    globals(),
    {
        ".profile": ("profile_lengths", "LengthProfile"),
        ".figures": ("plot_lengths", "plot_tradeoffs"),
        ".plot": ("write_report",),
    },
)

del lazy_exports

__all__ = sorted(_EXPORTS)
