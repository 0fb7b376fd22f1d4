"""Every touch of the standard library's ``concurrent.futures`` internals, checked against :data:`CHECKED`.

The pipeline's process pool (:class:`packtools.pipeline.executors.PoolExecutor`) must tell a pool that a dead
worker broke (``ProcessPoolExecutor._broken``: a new pool is started instead of failing every later job) and stop
its workers at once when a run is interrupted (``ProcessPoolExecutor._processes``: ``shutdown`` alone waits for
the running jobs, and a killed driver would leave them running).  Neither has a public API.

>>> from concurrent.futures import ProcessPoolExecutor
>>> with ProcessPoolExecutor(1) as pool:
...     pool_broken(pool), pool_processes(pool)
(False, [])
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import PackingError

#: The Python versions whose ``ProcessPoolExecutor`` shape this module was checked against.
CHECKED = "3.10 - 3.13"
_FIX = "Run packtools on a Python version it was checked against (see CHECKED), or use --executor local."


def _unknown(what: str) -> PackingError:
    return PackingError(
        f"packtools does not know the concurrent.futures of Python {sys.version.split()[0]}: {what}. packtools "
        f"was checked against Python {CHECKED}. {_FIX}"
    )


def pool_broken(pool: Any) -> bool:
    """Whether a worker of ``pool`` died, so that the pool takes no more work."""
    if not hasattr(pool, "_broken"):
        raise _unknown(f"{type(pool).__name__} has no _broken flag")
    return bool(pool._broken)


def pool_processes(pool: Any) -> list[Any]:
    """The worker processes of ``pool`` (none before its first job, or after shutdown)."""
    if not hasattr(pool, "_processes"):
        raise _unknown(f"{type(pool).__name__} has no _processes")
    return list((pool._processes or {}).values())
