"""Large files written past the page cache (``O_DIRECT``).

A run writes ~1 GB of staged token ids per GB of text, and again as much in output shards.  Written through the
page cache, every byte first takes a fresh page of memory, zeroed and copied into by the writing thread; where
fresh memory is expensive (a virtual machine whose host backs guest memory only when first touched, as the
2-core machine of ``docs/tokenize.md``) that was most of the system time of a 1 GB run.  :class:`DirectFile`
copies what Arrow writes into one small aligned buffer, reused, and hands it to the disk with ``O_DIRECT``; the
file's bytes are exactly those Arrow wrote (the last aligned block is cut back to the true size).  Where the
OS or the file system refuses ``O_DIRECT`` (tmpfs, macOS, Windows, a block size it will not take), the same
bytes are written plainly.  A file mapped soon after (a staged part, by the gather) is read back into the page
cache by :func:`packtools.io.pages.read_ahead`: disk reads fill those pages, not the reading thread.

>>> import os, tempfile, pyarrow as pa
>>> d = tempfile.mkdtemp(); path = os.path.join(d, "t.arrow")
>>> table = pa.table({"x": [[1, 2], [3]]})
>>> with arrow_sink(path) as sink, pa.ipc.new_stream(sink, table.schema) as writer:
...     writer.write_table(table)
>>> plain = pa.BufferOutputStream()
>>> with pa.ipc.new_stream(plain, table.schema) as writer:
...     writer.write_table(table)
>>> open(path, "rb").read() == plain.getvalue().to_pybytes()
True
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

#: What ``O_DIRECT`` needs aligned (the buffer's address, each write's offset and size): a page covers the
#: logical block size of every common disk (512 or 4,096 bytes).
ALIGN = mmap.PAGESIZE
#: Bytes gathered before each write (a multiple of :data:`ALIGN`): large enough for the disk's full speed (1 MiB
#: reached 2 GB/s on the machine of ``docs/tokenize.md``), small enough to cost nothing to allocate per file.
CHUNK = 2 << 20


#: Set to ``0`` to write every file through the page cache (same bytes): for a file system that takes
#: ``O_DIRECT`` but serves it slowly (some network or FUSE file systems), or a machine where fresh memory is cheap
#: and the disk is not.
DIRECT_ENV = "PACKTOOLS_DIRECT_IO"
#: The errors by which a file system says it does not take ``O_DIRECT`` (tmpfs: EINVAL; some FUSE and network file
#: systems: EOPNOTSUPP): the file is then written plainly.  Any other error is raised.
REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def _open_direct(path: str) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` created (or emptied) for writing, with ``O_DIRECT`` where it is taken (and not
    turned off by :data:`DIRECT_ENV`)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
    direct = getattr(os, "O_DIRECT", 0) if os.environ.get(DIRECT_ENV, "1") != "0" else 0
    if direct:
        try:
            return os.open(path, flags | direct, 0o666), True
        except OSError as exc:
            if exc.errno not in REFUSED:
                raise
    return os.open(path, flags, 0o666), False


class DirectFile:
    """A file being written, whose data goes to the disk past the page cache (see the module docstring).

    File-like enough for ``pa.PythonFile`` (``write``, ``tell``, ``flush``, ``close``): Arrow's IPC writers write
    into it as into any file.  ``direct`` says whether ``O_DIRECT`` is in use; it turns false (plain writes
    from then on, same bytes) if the file system refuses a direct write after all.
    """

    def __init__(self, path: str, chunk: int = CHUNK, *, crc: bool = False) -> None:
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}, got {chunk}")
        self.path = path
        #: ``crc=True``: the CRC-32 of every byte written so far (:func:`file_crc32` of the file once closed), for
        #: a later reader to check the file's content by; None otherwise
        self.crc32: int | None = 0 if crc else None
        self._fd, self.direct = _open_direct(path)
        self._map = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        self._buf = np.frombuffer(self._map, np.uint8)
        self._fill = 0  # bytes in the buffer, not written yet
        self._written = 0  # bytes of the file written so far (aligned while direct)
        self._failed = False  # a write raised: the file is left as it is (its writer removes it)
        self.closed = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written + self._fill

    def flush(self) -> None:
        """Nothing to do: the buffer is written when full and on :meth:`close` (``O_DIRECT`` writes only whole
        aligned blocks)."""

    def write(self, data: Any) -> int:
        src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if self.crc32 is not None:  # zlib releases the GIL on large buffers
            self.crc32 = zlib.crc32(src, self.crc32)
        size, start, room = src.shape[0], 0, self._buf.shape[0]
        while start < size:
            n = min(room - self._fill, size - start)
            self._buf[self._fill : self._fill + n] = src[start : start + n]
            self._fill += n
            start += n
            if self._fill == room:
                self._drain(room)
                self._fill = 0
        return size

    def _drain(self, size: int) -> None:
        """Write the buffer's first ``size`` bytes (a multiple of :data:`ALIGN` while direct)."""
        view = memoryview(self._map)[:size]
        self._failed = True  # until the whole buffer is written: close() then writes nothing more
        try:
            done = 0
            while done < size:
                try:
                    n = os.write(self._fd, view[done:])
                except OSError as exc:
                    if not self.direct or exc.errno not in REFUSED:
                        raise
                    self._plain()  # e.g. a block size larger than a page: the rest is written plainly
                    continue
                if n <= 0:
                    raise OSError(errno.EIO, f"short write to {self.path!r}")
                done += n
                if self.direct and done < size and (done % ALIGN):
                    self._plain()  # a short direct write left the next write unaligned
            self._written += size
            self._failed = False
        finally:
            view.release()

    def _plain(self) -> None:
        """Go on without ``O_DIRECT`` (same bytes, through the page cache)."""
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write what is left (while direct: padded to a whole block, then the file cut back to its size);
        after a write that raised, only close the file."""
        if self.closed:
            return
        try:
            if self._failed:
                return
            size = self.tell()
            tail = self._fill
            if tail and self.direct:
                padded = -(-tail // ALIGN) * ALIGN
                self._buf[tail:padded] = 0
                self._drain(padded)
                os.ftruncate(self._fd, size)  # the padding's zeros cut off
            elif tail:
                self._drain(tail)
            self._fill = 0
        finally:
            self.closed = True
            os.close(self._fd)
            self._buf = None  # type: ignore[assignment]
            try:
                self._map.close()
            except BufferError:  # a view is still held (e.g. by a traceback): unmapped when it goes
                pass

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def arrow_sink(path: str | DirectFile) -> pa.PythonFile:
    """An Arrow output stream writing ``path`` through a :class:`DirectFile` (or into the one given; closing the
    stream closes the file)."""
    return pa.PythonFile(path if isinstance(path, DirectFile) else DirectFile(path), mode="w")


def file_crc32(path: str) -> int:
    """The CRC-32 of the file at ``path`` (what :attr:`DirectFile.crc32` was when it was closed)."""
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    return crc
