"""`packtools._gc.paused` in several threads and across a fork: the collector ends as it was before the blocks."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from packtools import _gc


class _HeldCollector:
    """``gc`` as :mod:`packtools._gc` sees it, where the thread named ``late`` is held at its ``disable`` until
    ``release`` is set, and says when it first asks the collector's state (``asked``)."""

    def __init__(self) -> None:
        self.asked, self.release = threading.Event(), threading.Event()

    def isenabled(self) -> bool:
        if threading.current_thread().name == "late":
            self.asked.set()
        return gc.isenabled()

    def disable(self) -> None:
        if threading.current_thread().name == "late":
            self.release.wait(10)
        gc.disable()

    def enable(self) -> None:
        gc.enable()


def test_blocks_of_two_threads_leave_the_collector_on(monkeypatch):
    """Two runs loading their tokenizers at once: a block that starts while another holds the collector off
    and is turned off only after that other has ended (the worst interleaving, forced here) must not leave the
    collector off for the rest of the process."""
    held = _HeldCollector()
    monkeypatch.setattr(_gc, "gc", held)
    was = gc.isenabled()
    gc.enable()
    try:

        def late() -> None:
            with _gc.paused():
                held.asked.set()  # inside its block (a block that did not ask the state)

        thread = threading.Thread(target=late, name="late")
        with _gc.paused():
            thread.start()
            assert held.asked.wait(10)  # the late block asked the state (off, now) or is inside
        held.release.set()  # the first block has ended: the late one goes on
        thread.join(10)
        assert not thread.is_alive()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_caller_that_turned_the_collector_off_keeps_it_off():
    was = gc.isenabled()
    gc.disable()
    try:
        with _gc.paused():
            with _gc.paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_process_forked_while_another_thread_is_in_a_block_has_its_collector_on():
    """The forked process has no thread to end the block: its collector is on, as before the block, and a
    block of its own works."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with _gc.paused():
            inside.set()
            leave.wait(60)

    was = gc.isenabled()
    gc.enable()
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(60)
        pid = os.fork()
        if pid == 0:  # the forked process
            code = 1
            try:
                on = gc.isenabled()
                done = threading.Event()

                def block() -> None:
                    with _gc.paused():
                        pass
                    done.set()

                threading.Thread(target=block, daemon=True).start()
                code = 0 if on and done.wait(20) and gc.isenabled() else 1
            finally:
                os._exit(code)
    finally:
        leave.set()
        holder.join()
        (gc.enable if was else gc.disable)()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
