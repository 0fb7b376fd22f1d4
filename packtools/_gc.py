"""Python's cyclic garbage collector kept out of two one-off costs of a run.

- **A large parse** (:func:`paused`): ``json.load`` of a real vocabulary's tokenizer.json creates several hundred
  thousand lists and dicts, and each 700 of them start a collection that walks the young ones (and, as they
  are promoted, the whole heap): a third of the parse's time.  Nothing in such a parse is a cycle, so pausing
  the collector while it runs frees nothing later than reference counting does.
- **The interpreter's shutdown** (:func:`freeze_at_exit`): at exit Python collects every generation several
  times while it tears the modules down.  A process that is about to exit anyway (the console script, once its
  command has returned) moves what it holds to the permanent generation first, which those collections skip;
  finalizers still run as reference counts drop, and ``atexit`` handlers as always.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector is enabled again after it only where it was on
    before it (so a caller that disabled it, or an enclosing block, keeps it off).

    >>> import gc
    >>> with paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_at_exit() -> None:
    """Everything this process holds moved to the permanent generation, so that the interpreter's collections at
    shutdown skip it.  For a process about to exit only: frozen objects are never collected again."""
    gc.freeze()
