"""Atomic writes: write aside, flush to disk, then rename into place (and flush the folder), so that a file a later
run trusts is whole after a machine crash too, not only after a killed process."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success it is renamed to ``path``, on error removed.

    The file gets the usual permissions (``0o666`` minus the umask), not ``mkstemp``'s private ``0o600``.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".packtools-", suffix=os.path.splitext(path)[1], dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    with removed_on_error(tmp):
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(directory)


@contextlib.contextmanager
def removed_on_error(tmp: str) -> Iterator[None]:
    """Remove ``tmp`` (a file written aside, not yet renamed into place) if the block raises."""
    try:
        yield
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def discard(*paths: str | os.PathLike[str]) -> None:
    """Remove each of ``paths``, in order, as far as it can be: one already gone or that cannot be removed is
    left as it is (for files that are checked by content before they are trusted, so a leftover is rejected)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk (before the rename that makes it trusted)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename in it) to disk; a file system that cannot is left as it is."""
    with contextlib.suppress(OSError):  # e.g. some network file systems refuse fsync on a folder
        fsync_file(path)


def fsync_tree(folder: str | os.PathLike[str]) -> None:
    """:func:`fsync_file` every file of ``folder`` (not recursing), then the folder itself."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fsync_file(path)
    fsync_dir(folder)
