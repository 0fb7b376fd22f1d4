"""The ``.npz`` file of a :class:`~packtools.PackPlan`: its layout, its version, and reading it back safely.

:meth:`PackPlan.save` / :meth:`PackPlan.load` call these; a file that is cut, corrupted, not a plan, or of
another format version is refused with a :class:`PackingError` that names the file and the fix.

>>> import tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "plan.npz")
>>> write_plan(path, 4, "bfd", [np.array([0]), np.array([0]), np.array([3]), np.array([0, 1]), np.array([3])])
>>> max_length, strategy, arrays = read_plan(path)
>>> max_length, strategy, [a.tolist() for a in arrays]
(4, 'bfd', [[0], [0], [3], [0, 1], [3]])
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence

import numpy as np

from .._atomic import atomic_path
from ..errors import PackingError

#: Version of the ``.npz`` layout written by :meth:`PackPlan.save`; other versions are refused on load.
PLAN_FORMAT = 1
#: The arrays of a plan, in the order of :class:`PackPlan`'s fields.
PLAN_ARRAYS = ("seg_source", "seg_start", "seg_length", "row_offsets", "source_lengths")


def write_plan(
    path: str | os.PathLike[str], max_length: int, strategy: str, arrays: Sequence[np.ndarray]
) -> None:
    """Write a plan's fields (``arrays`` in :data:`PLAN_ARRAYS` order) to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(
            fh,
            format=np.int64(PLAN_FORMAT),
            max_length=np.int64(max_length),
            strategy=np.array(strategy),
            **dict(zip(PLAN_ARRAYS, arrays)),
        )


def read_plan(path: str | os.PathLike[str]) -> tuple[int, str, list[np.ndarray]]:
    """``(max_length, strategy, arrays)`` read from a plan file (the plan's own checks come after)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"plan file {path!r} does not exist.")
    try:
        return _read(path)
    except PackingError:
        raise
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "pickled" in detail:  # numpy's reading of bytes that are no .npz at all
            detail = "not a NumPy .npz archive"
        raise PackingError(
            f"plan file {path!r} cannot be read as a packtools plan ({type(exc).__name__}: {detail}): it is "
            f"cut, corrupted or not a plan saved by PackPlan.save; make the plan again with "
            f"packtools.plan(lengths, ...) and save it."
        ) from None


def _read(path: str) -> tuple[int, str, list[np.ndarray]]:
    z = np.load(path, allow_pickle=False)
    if not hasattr(z, "files"):
        raise ValueError("it holds one array, not a plan's arrays")
    with z:
        version = int(z["format"]) if "format" in z.files else 0
        if version != PLAN_FORMAT:
            age = "an older" if version < PLAN_FORMAT else "a newer"
            raise PackingError(
                f"plan file {path!r} has plan format {version}, from {age} packtools; this one "
                f"reads format {PLAN_FORMAT}. Make the plan again with packtools.plan(lengths, ...)."
            )
        return int(z["max_length"]), str(z["strategy"]), [np.asarray(z[name]) for name in PLAN_ARRAYS]
