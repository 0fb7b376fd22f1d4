"""Test-only entry point for the crash tests: ``python tests/_paused_run.py LOG POINT ARGS...``.

Runs ``packtools ARGS...`` (``packtools.cli.main.main``) with an observer on the run's checkpoints
(:data:`packtools.pipeline.workspace.CHECKPOINT_OBSERVERS`) that appends each point's name to ``LOG`` and, at
``POINT``, waits until the process is signalled.  Production code has no such hook: it lives here only.
"""

import signal
import sys
import time

from packtools.cli.main import main
from packtools.pipeline import workspace


def run(log: str, point: str, args: list[str]) -> int:
    def observe(name: str) -> None:
        with open(log, "a") as fh:
            fh.write(name + "\n")
        if name == point:
            while True:
                time.sleep(0.05)

    # Ctrl-C raises, as in a terminal, even where this process was started with SIGINT ignored (a background job
    # of a non-interactive shell, which Python then leaves ignored): the tests send it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    workspace.CHECKPOINT_OBSERVERS.append(observe)
    return main(args)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2], sys.argv[3:]))
