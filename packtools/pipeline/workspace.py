"""Where a run works: a lock next to ``--out``, a hidden work folder, and the atomic install of the result.

For an output ``DIR/out`` a run holds ``DIR/.out.packtools.lock`` (see :class:`packtools.io.lock.OutputLock`)
and works in ``DIR/.out.packtools/``:

- ``stage/``: staged parts (kept across interrupted runs: a rerun reuses the finished ones);
- ``build/``: the output being written, renamed to ``DIR/out`` when complete;
- ``old/``: the previous output while it is being replaced.

So ``DIR/out`` is always absent, the previous complete output or the new complete output, whatever kills the
run and when.  The next run in that place takes the lock over from a dead run (the kernel released it), puts
back a previous output that a kill caught mid-replacement, and removes everything else a dead run left except
finished staged parts.  A successful run removes the whole work folder.

>>> import os, tempfile
>>> parent = tempfile.mkdtemp()
>>> ws = Workspace(os.path.join(parent, "out"))
>>> ws.acquire()
>>> sorted(os.listdir(parent))
['.out.packtools', '.out.packtools.lock']
>>> os.makedirs(ws.build); ws.install(); ws.finish(ok=True, keep_stage=False)
>>> sorted(os.listdir(parent))
['out']
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from typing import Any

from ..errors import PackingError
from ..io.lock import LockHeld, OutputLock

#: Test hooks (the crash tests kill a run at a chosen point): with ``$PACKTOOLS_CHECKPOINTS`` naming a file,
#: :func:`checkpoint` appends each point's name to it; the point named by ``$PACKTOOLS_PAUSE_AT`` then waits
#: there until the process is signalled.
CHECKPOINTS_ENV, PAUSE_ENV = "PACKTOOLS_CHECKPOINTS", "PACKTOOLS_PAUSE_AT"


def checkpoint(name: str) -> None:
    """Mark that the run reached ``name`` (a no-op unless the test hooks above are set)."""
    path = os.environ.get(CHECKPOINTS_ENV)
    if not path:
        return
    with open(path, "a") as fh:
        fh.write(name + "\n")
    if os.environ.get(PAUSE_ENV) == name:
        while True:
            time.sleep(0.05)


class Workspace:
    """The lock and work folder of one run into ``out`` (use as a context manager around the run)."""

    def __init__(self, out: str) -> None:
        self.out = out
        parent, name = os.path.split(out)
        self.root = os.path.join(parent, f".{name}.packtools")
        self.stage = os.path.join(self.root, "stage")
        self.build = os.path.join(self.root, "build")
        self.old = os.path.join(self.root, "old")
        self.lock = OutputLock(self.root + ".lock")
        self.took_over: dict[str, Any] | None = None

    # -- entering --------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock (or refuse, naming the live run that holds it) and clean up after a dead run."""
        parent = os.path.dirname(self.out)
        try:
            os.makedirs(parent, exist_ok=True)
            stale = self.lock.owner() if os.path.exists(self.lock.path) else None
            self.lock.acquire()
        except LockHeld as exc:
            o = exc.owner
            since = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["started_unix"]))
                if "started_unix" in o
                else "?"
            )
            raise PackingError(
                f"out={self.out!r} is being written by another packtools run (pid {o.get('pid', '?')} on host "
                f"{o.get('host', '?')}, since {since}); wait for it to finish, stop it, or choose another out.",
                param="out",
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise PackingError(
                f"out={self.out!r}: cannot write in {parent!r} ({exc.strerror}); choose a folder you can write to.",
                param="out",
            ) from None
        self.took_over = stale
        try:
            self._recover()
            os.makedirs(self.stage, exist_ok=True)
            checkpoint("locked")
        except BaseException:
            self.lock.release()
            raise

    def _recover(self) -> None:
        if os.path.isdir(self.old):
            if os.path.exists(self.out):
                shutil.rmtree(self.old)
            else:  # a kill between moving the old output aside and installing the new one: put it back
                os.replace(self.old, self.out)
        if os.path.exists(self.build):
            shutil.rmtree(self.build)
        if os.path.isdir(self.stage):
            for name in os.listdir(self.stage):
                if ".tmp-" in name:
                    os.unlink(os.path.join(self.stage, name))
        # leftovers of packtools versions before the work folder existed
        parent, name = os.path.split(self.out)
        for entry in os.listdir(parent):
            if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)

    # -- leaving ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Move the finished ``build/`` to ``out``, replacing a previous output there."""
        checkpoint("install")
        if os.path.exists(self.out):
            os.replace(self.out, self.old)
            checkpoint("rename")
        os.replace(self.build, self.out)
        if os.path.exists(self.old):
            shutil.rmtree(self.old)

    def staged_parts(self) -> int:
        """Finished staged parts in ``stage/`` (what an interrupted run keeps for the next one)."""
        if not os.path.isdir(self.stage):
            return 0
        return sum(name.endswith(".npz") for name in os.listdir(self.stage))

    def finish(self, ok: bool, keep_stage: bool) -> None:
        """Remove the work folder (all of it, or all but finished staged parts) and release the lock."""
        try:
            if os.path.isdir(self.old) and not os.path.exists(self.out):
                os.replace(self.old, self.out)  # stopped in the middle of install(): keep the previous output
            if ok or not keep_stage:
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                shutil.rmtree(self.build, ignore_errors=True)
                if os.path.isdir(self.stage):
                    for name in os.listdir(self.stage):
                        if ".tmp-" in name:
                            os.unlink(os.path.join(self.stage, name))
                if not self.staged_parts():
                    shutil.rmtree(self.root, ignore_errors=True)
        finally:
            self.lock.release()
