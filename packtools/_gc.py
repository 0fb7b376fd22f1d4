"""Python's cyclic garbage collector kept out of two one-off costs of a run.

- **A large parse** (:func:`paused`): ``json.load`` of a real vocabulary's tokenizer.json creates several hundred
  thousand lists and dicts, and each 700 of them start a collection that walks the young ones (and, as they
  are promoted, the whole heap): a third of the parse's time.  Nothing in such a parse is a cycle, so pausing
  the collector while it runs frees nothing of the parse later than reference counting does.  The pause is
  the process's: cycles that other threads drop meanwhile wait for its end.
- **The interpreter's shutdown** (:func:`freeze_at_exit`): at exit Python collects every generation several
  times while it tears the modules down.  A process that is about to exit anyway (the console script, once its
  command has returned) moves what it holds to the permanent generation first, which those collections skip;
  finalizers still run as reference counts drop, and ``atexit`` handlers as always, but an object already
  unreachable in a cycle at the freeze is never finalized (its ``__del__`` does not run): packtools closes its
  files and removes its folders itself, and defines no ``__del__``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator


class _Pauses:
    """The :func:`paused` blocks open in this process, counted under a lock: the first one in records whether
    the collector was on and turns it off, the last one out turns it on again where it was.  Each block reading
    and restoring the state by itself is not safe for two threads (two runs loading their tokenizers at once):
    a second block that read "off" while the first held it, and turned it off only after the first had turned
    it on again, would leave the collector off for the rest of the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.was = False

    def enter(self) -> None:
        with self.lock:
            if self.open == 0:
                self.was = gc.isenabled()
                gc.disable()
            self.open += 1

    def exit(self) -> None:
        with self.lock:
            self.open -= 1
            if self.open == 0 and self.was:
                gc.enable()

    def after_fork(self) -> None:
        """In a forked process: the threads whose blocks were open are not there to close them, so the
        collector is as it was before them, and the lock (held, perhaps, by one of them) is a new one."""
        if self.open and self.was:
            gc.enable()
        self.lock, self.open, self.was = threading.Lock(), 0, False


_PAUSES = _Pauses()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PAUSES.after_fork)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector is enabled again once the last block open in
    this process has ended, only where it was on before the first (so a caller that disabled it keeps it off).
    Safe for threads: blocks of several threads at once leave the collector as it was before them.

    >>> import gc
    >>> with paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    _PAUSES.enter()
    try:
        yield
    finally:
        _PAUSES.exit()


def freeze_at_exit() -> None:
    """Everything this process holds moved to the permanent generation, so that the interpreter's collections at
    shutdown skip it.  For a process about to exit only: frozen objects are never collected again, and cycles
    already unreachable are never finalized."""
    gc.freeze()
