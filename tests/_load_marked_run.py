"""Test-only entry point for ``tests/test_interrupt_load.py``: ``python tests/_load_marked_run.py LOG AHEAD ARGS...``.

Runs ``packtools ARGS...`` (``packtools.cli.main.main``) and appends to ``LOG`` the word ``numba`` when the
import of Numba starts (the start of the kernels' load, which the test times its Ctrl-C from) and the name of
each checkpoint of the run; at the first write job it waits (up to a minute) to be signalled, so that a Ctrl-C
sent late in the load still finds the run going.  ``AHEAD=1`` loads the kernels in their thread beside the stage
whatever the input's size (:data:`packtools.pipeline.run.KERNELS_AHEAD_MIN_BYTES` set to 0).  Production code has
no such hooks: they live here only.
"""

import signal
import sys
import time

from packtools.cli.main import main
from packtools.pipeline import run as pipeline_run
from packtools.pipeline import workspace


class NumbaImportMark:
    """A finder that finds nothing and notes when ``numba`` is first looked for."""

    def __init__(self, log: str) -> None:
        self.log, self.seen = log, False

    def find_spec(self, name, path=None, target=None):
        if name == "numba" and not self.seen:
            self.seen = True
            with open(self.log, "a") as fh:
                fh.write("numba\n")
        return None


def run(log: str, ahead: bool, args: list[str]) -> int:
    def observe(name: str) -> None:
        with open(log, "a") as fh:
            fh.write(name + "\n")
        if name == "write:1":
            end = time.monotonic() + 60
            while time.monotonic() < end:
                time.sleep(0.05)

    # Ctrl-C raises, as in a terminal, even where this process was started with SIGINT ignored (a background job
    # of a non-interactive shell, which Python then leaves ignored): the tests send it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if ahead:
        pipeline_run.KERNELS_AHEAD_MIN_BYTES = 0
    sys.meta_path.insert(0, NumbaImportMark(log))
    workspace.CHECKPOINT_OBSERVERS.append(observe)
    return main(args)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2] == "1", sys.argv[3:]))
