"""What a failed or interrupted run does on the way out: signals held back while it cleans up, OS errors
explained as one line naming the place and the fix, and the note an interrupted run leaves on its exception.

>>> import errno
>>> err = explain_os_error(OSError(errno.ENOSPC, "No space left on device", "/data/x.arrow"), "/data")
>>> print(err)
no space left on the device while writing '/data/x.arrow'; free some space or choose another out
(nothing was left behind).
>>> err.param
'out'
"""

from __future__ import annotations

import contextlib
import errno
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import PackingError

if TYPE_CHECKING:
    from .workspace import Workspace


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while cleaning up (they are delivered right after)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def explain_os_error(exc: BaseException, out: str) -> BaseException:
    """OS errors while writing, as one clear line naming the place and the fix."""
    if isinstance(exc, PackingError) or not isinstance(exc, OSError):
        return exc
    place = exc.filename or out
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackingError(
            f"no space left on the device while writing {place!r}; free some space or choose another out "
            f"(nothing was left behind).",
            param="out",
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PackingError(
            f"cannot write {place!r} ({exc.strerror}); choose an out in a folder you can write to.",
            param="out",
        )
    return exc


def note_interrupted(exc: BaseException, ws: Workspace) -> None:
    """Say on ``exc`` (``packtools_note``, which the CLI prints) what an interrupted run kept for the next one."""
    kept = ws.staged_parts()
    note = "no output was written"
    if kept:
        note += f"; {kept} finished part(s) kept in {ws.root} for the next run (delete it to free the space)"
    with contextlib.suppress(AttributeError):
        exc.packtools_note = note  # type: ignore[attr-defined]
