"""Sequence-length profiles, the max_length tradeoff table, plots and the HTML report.

``profile_lengths`` is also at the front door; the plots need ``packtools[plot]`` (matplotlib, imported when
they are called).

>>> from packtools.profiling import LengthProfile, profile_lengths
>>> isinstance(profile_lengths([10, 200, 3000, 45]), LengthProfile)
True
"""

from .._lazy import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "profile_lengths": "packtools.profiling.profile",
    "LengthProfile": "packtools.profiling.profile",
    "plot_lengths": "packtools.profiling.figures",
    "plot_tradeoffs": "packtools.profiling.figures",
    "write_report": "packtools.profiling.plot",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports

__all__ = ["LengthProfile", "plot_lengths", "plot_tradeoffs", "profile_lengths", "write_report"]
