"""Ctrl-C and SIGTERM held back while Numba loads or compiles in the main thread, and delivered right after.

Python runs a signal's handler in the main thread between two bytecodes, wherever that thread is.  While Numba
loads a kernel from its cache or compiles one, that can be:

- inside one of llvmlite's ctypes callbacks (its object cache: ``ExecutionEngine._raw_object_cache_getbuffer``,
  ``_raw_object_cache_notify``), where the ``KeyboardInterrupt`` cannot get out: ctypes prints "Exception ignored
  on calling ctypes callback function" and drops it, and the run goes on to finish as though Ctrl-C had not been
  pressed, or fails with "no compiled object yet";
- in the middle of a compile, which it leaves half done: the process then printed its "interrupted" line and
  died of a segmentation fault at its exit;
- right after Numba takes its compiler lock (an ``RLock``, taken in ``_CompilerLock.acquire``) and before the
  ``with`` block that gives it back begins: the main thread then keeps the lock, and any other thread that
  compiles (the kernels' thread beside the stage) waits for it forever.

:func:`held` holds them around a load in the main thread (the kernels module's import, which imports Numba);
:func:`hold_while_numba_compiles` does so around every span of Numba's compiler lock in the main thread, through
Numba's event API (``numba.core.event``: its ``"numba:compiler_lock"`` event starts before the lock is taken and
ends after it is given back, and covers the load from the cache as well as a compile).  A signal that comes
meanwhile is recorded; when the outermost hold ends, the handlers are put back and the first signal's handler is
called there (``KeyboardInterrupt`` for Ctrl-C, the CLI's ``Terminated`` for SIGTERM), where it can only end the
run.  Only handlers written in Python are held (a signal left to the OS's default, such as SIGTERM outside the
CLI, still ends the process at once), and only in the main thread, the one thread where Python runs them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

#: the signals a hold records instead of handling
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Hold:
    """The main thread's hold: how many holds are open, the handlers it stood in for, the first signal that came.

    One per process, as the signal handlers it stands in for are; touched by the main thread alone (the handlers
    run there, and :meth:`enter` / :meth:`leave` do nothing in another thread).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.saved: dict[int, Callable[[int, FrameType | None], Any]] = {}
        self.arrived: int | None = None
        #: whether Numba's compiler lock opens holds (:func:`hold_while_numba_compiles`)
        self.listening = False

    def record(self, signum: int, frame: FrameType | None) -> None:
        if self.arrived is None:
            self.arrived = signum

    def enter(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            self.arrived = None
            try:
                for signum in HELD_SIGNALS:
                    handler = signal.getsignal(signum)
                    if callable(handler) and handler != self.record:
                        self.saved[signum] = handler
                        signal.signal(signum, self.record)
            except BaseException:  # a signal handled before the hold was whole: its handlers back, then it
                self._put_back()
                raise
        self.depth += 1

    def leave(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth:
            return
        handler = self.saved.get(self.arrived) if self.arrived is not None else None
        arrived, self.arrived = self.arrived, None
        self._put_back()
        if handler is not None:
            handler(arrived, None)  # raises (KeyboardInterrupt, Terminated) out of the hold

    def _put_back(self) -> None:
        for signum, handler in list(self.saved.items()):
            signal.signal(signum, handler)
            del self.saved[signum]


_HOLD = _Hold()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back in the main thread for the block, and deliver the first that came right after
    it (a no-op in any other thread).  Holds nest; the outermost delivers."""
    _HOLD.enter()
    try:
        yield
    finally:
        _HOLD.leave()


def hold_while_numba_compiles() -> None:
    """Hold Ctrl-C and SIGTERM in the main thread while it holds Numba's compiler lock (a compile or a load from
    Numba's cache), from now on in this process; a second call changes nothing.  Called by the kernels module as
    it is imported, after Numba (this module imports Numba only here)."""
    if _HOLD.listening:
        return
    from numba.core import event

    class CompilerLockHold(event.Listener):
        """A hold from just before the lock is taken to just after it is given back (the nested spans of the
        reentrant lock nest their holds)."""

        def on_start(self, event: Any) -> None:
            _HOLD.enter()

        def on_end(self, event: Any) -> None:
            _HOLD.leave()

    event.register("numba:compiler_lock", CompilerLockHold())
    _HOLD.listening = True
