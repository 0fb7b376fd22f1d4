"""An exclusive lock on an output path, held by one live run, that names its owner.

The lock is ``fcntl.flock`` on a small file next to the output.  The kernel releases a ``flock`` when its
holder dies, however it dies (``SIGKILL`` included), so a lock file left by a dead run is simply taken over;
a live holder makes :meth:`OutputLock.acquire` fail at once with :class:`LockHeld`, which carries what the
holder wrote into the file (its pid, host and start time) for the error message.

>>> import os, tempfile
>>> lock = OutputLock(os.path.join(tempfile.mkdtemp(), ".out.packtools.lock"))
>>> lock.acquire(); lock.owner()["pid"] == os.getpid()
True
>>> lock.release(); os.path.exists(lock.path)
False
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any


class LockHeld(RuntimeError):
    """Another live process holds the lock; ``owner`` is what it wrote (``pid``, ``host``, ``started_unix``)."""

    def __init__(self, path: str, owner: dict[str, Any]) -> None:
        super().__init__(f"{path} is held by pid {owner.get('pid', '?')} on {owner.get('host', '?')}")
        self.path = path
        self.owner = owner


class OutputLock:
    """``flock`` on ``path`` (created if needed), with the owner's pid, host and start time written in it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def owner(self) -> dict[str, Any]:
        """What the lock file says about its holder (empty if unreadable)."""
        try:
            with open(self.path) as fh:
                data = json.load(fh)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        """Take the lock, or raise :class:`LockHeld` if a live process has it (never waits)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockHeld(self.path, self.owner()) from None
            # The previous holder may have unlinked the file between our open and our flock: then we hold a
            # lock on a file nobody else can see, and must start again on the current one.
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": int(time.time())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and let go of the lock (a no-op when not held)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
