"""Give back the pages of read-only memory-mapped files once a gather is done with them.

Pages of a memory-mapped file that were read count in the process's RSS until unmapped, so packing a
memory-mapped dataset would otherwise end up holding the whole token column.  ``MADV_DONTNEED`` on a
read-only file mapping only drops the page-table entries: the data is read again from the page cache or
the file if touched later.  Anonymous or writable mappings are never touched (there it would lose data).
Linux only; elsewhere this is a no-op.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os

import numpy as np

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


class PageReleaser:
    """Drops the pages under arrays that lie in read-only file mappings (as found when created)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._madvise = None
        if not os.path.exists("/proc/self/maps"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            return
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/") or "w" in parts[1]:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                self._starts.append(lo)
                self._ends.append(hi)
        order = np.argsort(self._starts)
        self._starts = [self._starts[i] for i in order]
        self._ends = [self._ends[i] for i in order]

    def release(self, values: np.ndarray) -> bool:
        """Drop the pages under ``values`` if they lie in one read-only file mapping; say whether it did."""
        if self._madvise is None or values.nbytes == 0:
            return False
        addr = values.ctypes.data
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr + values.nbytes > self._ends[i]:
            return False
        start = addr - addr % mmap.PAGESIZE
        length = addr + values.nbytes - start
        return self._madvise(start, length, _MADV_DONTNEED) == 0
