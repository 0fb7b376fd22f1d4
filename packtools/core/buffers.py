"""Large output buffers in fresh memory that is not advised for transparent huge pages: the token buffers
that packing gathers into (``core.pack``'s ``gather_column`` and ``unpack``, ``pack_pairs``, the prompt-shared
layouts).

NumPy advises every allocation of 4 MiB or more for huge pages (``madvise(MADV_HUGEPAGE)``).  Where the kernel's
huge page ``defrag`` setting is ``madvise`` (a common default) or the machine is a virtual machine whose host
takes back the guest's free memory (free page reporting, ballooning), the first touch of each 2 MiB of such a
buffer can stall: compacting memory for it, or waiting for the host to back it.  A gather writes its whole
output buffer once, front to back, so that stall was most of a gather's time on such a machine
(``docs/tokenize.md``: a 63 MiB block took 0.2-0.6 s to gather into NumPy's memory and 0.03-0.15 s into this).
:func:`empty` maps the memory itself (an anonymous mapping, which the kernel gives huge pages only where it has
them to spare) and hands it out as a NumPy array; the mapping is unmapped when the last view of it goes.

>>> a = empty(3, "int32")
>>> a[:] = (1, 2, 3); a.tolist(), a.flags.writeable
([1, 2, 3], True)
>>> big = empty(MIN_BYTES // 8, np.int64); big.fill(7); int(big.sum()) == 7 * (MIN_BYTES // 8)
True
"""

from __future__ import annotations

import mmap

import numpy as np

#: buffers from this size on are mapped here (below it NumPy gives no advice, and ``np.empty`` is the same)
MIN_BYTES = 4 << 20
#: a private mapping, as malloc's (Python's default on POSIX is a shared one: shared memory, and writes after a
#: ``fork`` seen by both processes); Windows has no flags (its anonymous mappings are the process's own)
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # Python adds MAP_ANONYMOUS


def empty(n: int, dtype: np.dtype | type | str) -> np.ndarray:
    """An uninitialized 1-D array of ``n`` values of ``dtype``: NumPy's own below :data:`MIN_BYTES`, else one
    in an anonymous mapping of its own (zero-filled pages, touched on first write)."""
    dt = np.dtype(dtype)
    nbytes = int(n) * dt.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(int(n), dt)
    try:
        memory = mmap.mmap(-1, nbytes, **_PRIVATE)
    except (OSError, ValueError):  # no address space for a mapping (a limit): NumPy's allocator says why
        return np.empty(int(n), dt)
    return np.frombuffer(memory, dt, count=int(n))
