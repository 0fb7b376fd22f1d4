"""Run an iterator ahead in a background thread, so producing and consuming items overlap.

The pipeline chains two of these: reading (Arrow's readers release the GIL) runs ahead of tokenizing (the
fast engine and the Rust tokenizers release it too), which runs ahead of writing the staged file.

>>> list(prefetch(iter(range(5)), depth=2))
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


def prefetch(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Yield what ``items`` yields, computing up to ``depth`` items ahead in a thread.

    An exception raised by ``items`` is raised here, at the item where it happened; closing the result early
    (``break``, an error in the consumer) stops the thread after the item it is working on.
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put((_DONE, exc))
        finally:
            close = getattr(items, "close", None)
            if stop.is_set() and close is not None:
                with contextlib.suppress(Exception):  # the consumer is already leaving
                    close()

    thread = threading.Thread(target=work, name="packtools-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if item is _DONE:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
        thread.join()


def timed(items: Iterator[T], clock: dict[str, float], key: str) -> Iterator[T]:
    """Yield what ``items`` yields, adding the seconds spent producing each item to ``clock[key]`` (a phase's
    busy time in the thread that consumes the result; the pipeline's timings report them per phase).

    >>> clock = {}
    >>> list(timed(iter([1, 2]), clock, "read")), clock["read"] >= 0.0
    ([1, 2], True)
    """
    import time

    clock.setdefault(key, 0.0)
    it = iter(items)
    try:
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                clock[key] += time.perf_counter() - t
                return
            clock[key] += time.perf_counter() - t
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
