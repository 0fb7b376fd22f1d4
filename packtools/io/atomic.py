"""Reading and atomically writing Arrow tables on disk (parquet and Arrow IPC)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import PackingError


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """Read a ``.parquet`` file or an Arrow IPC file/stream (``.arrow``, ``.feather``, datasets cache files)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist.")
    if path.endswith(".parquet"):
        return pq.read_table(path, memory_map=True)
    if path.endswith((".arrow", ".feather", ".ipc")):
        source = pa.memory_map(path, "r")
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()
    raise PackingError(f"input {path!r}: unknown format; give a .parquet or .arrow file.")


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
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_table(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """Write ``table`` to ``path`` (``.parquet`` or ``.arrow``) atomically: write aside, then rename."""
    path = os.fspath(path)
    if not path.endswith((".parquet", ".arrow")):
        raise PackingError(f"--out {path!r}: name the output .parquet or .arrow.")
    with atomic_path(path) as tmp:
        if path.endswith(".parquet"):
            pq.write_table(table, tmp)
        else:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
