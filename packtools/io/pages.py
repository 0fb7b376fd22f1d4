"""Give back the pages of read-only memory-mapped files once a gather is done with them, read a file into the
page cache ahead of its mapping (:func:`read_ahead`), and hand the heap's freed memory back to the system
(:func:`give_back_freed_memory`).

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
import threading

import numpy as np

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_READ = 22  # Linux 5.14 (not in Python's mmap module before 3.13)


def _libc_madvise():
    """libc's ``madvise`` through ctypes (which releases the GIL while it runs), or None off Linux."""
    if not os.path.exists("/proc/self/maps"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def give_back_freed_memory() -> None:
    """Hand the memory this process has freed back to the system where the C library can (glibc's
    ``malloc_trim``, every thread's arena): loading a tokenizer parses its tokenizer.json into objects that are
    freed once it is loaded (a pipeline's driver: ~150-230 MB for a 128k vocabulary, in the fast engine's load
    thread's arena; the first run's check child: transformers' load), which glibc otherwise keeps in the RSS
    beside everything the process allocates next.  Elsewhere (not glibc) a no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory stays with the process until it exits
        pass


class PageReleaser:
    """Drops the pages under arrays that lie in read-only file mappings (as found when created)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._madvise = _libc_madvise()
        if self._madvise is None:
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


def read_ahead(path: str) -> threading.Thread | None:
    """Read ``path`` into the page cache in a background thread, for a mapping of it soon after (a staged part,
    written past the page cache by :class:`packtools.io.direct.DirectFile`, is mapped by the gather).

    The pages are filled by disk reads, not by this process touching fresh memory, and in 2 MB pages where the
    file system makes them (the file mapped with ``MADV_HUGEPAGE``, then ``MADV_POPULATE_READ``), so a later
    mapping of the file takes one fault per 2 MB instead of one per 64 KB (the kernel's plain read-ahead of
    ``POSIX_FADV_WILLNEED`` makes small pages: 16k faults per GB mapped, on every block the gather maps it
    for).  Only advice: a kernel without ``MADV_POPULATE_READ`` gets ``POSIX_FADV_WILLNEED``, a failure
    nothing.  Returns the thread (a caller may wait for it; nothing needs to), None if none could start.
    """
    thread = threading.Thread(target=_populate, args=(path,), name="packtools-read-ahead", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to spare (a process at its limit): the gather reads the file itself
        return None
    return thread


def _populate(path: str) -> None:
    try:
        fh = open(path, "rb")
    except OSError:
        return
    with fh:
        size = os.fstat(fh.fileno()).st_size
        madvise = _libc_madvise()
        if size and madvise is not None:
            try:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                mapped = None
            if mapped is not None:
                view = np.frombuffer(mapped, np.uint8)
                try:
                    madvise(view.ctypes.data, size, _MADV_HUGEPAGE)  # refused where THP is off: small pages
                    if madvise(view.ctypes.data, size, _MADV_POPULATE_READ) == 0:
                        return
                finally:
                    del view
                    mapped.close()
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None:
            try:
                advise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
