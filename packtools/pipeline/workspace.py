"""Where a run works: a lock next to ``--out``, a hidden work folder, and the atomic install of the result.

For an output ``DIR/out`` a run holds ``DIR/.out.packtools.lock`` (see :class:`packtools.io.lock.OutputLock`)
and works in ``DIR/.out.packtools/``, which it marks as its own with the file :data:`MARKER`:

- ``stage/``: staged parts (kept across interrupted runs: a rerun reuses the finished ones);
- ``build/``: the output being written, renamed to ``DIR/out`` when complete;
- ``old/``: the previous output while it is being replaced.

So ``DIR/out`` is always absent, the previous complete output or the new complete output, whatever kills the
run and when.  The next run in that place takes the lock over from a dead run (the kernel released it), puts
back a previous output that a kill caught mid-replacement, and removes everything else a dead run left except
finished staged parts.  A successful run removes what it put in the work folder, and the folder once empty.
A folder of that name without the marker (someone else's) is never touched: the run stops and says so.

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
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from .._atomic import fsync_dir, fsync_tree
from ..errors import PackingError
from ..io.lock import LockHeld, OutputLock

#: The file that marks a work folder as packtools' own (what a run may remove).
MARKER = "PACKTOOLS_WORK_FOLDER"
#: What a run puts in its work folder, and so all it ever removes there.
OURS = ("stage", "build", "old", MARKER)

#: Functions called with the name of each point a run reaches (``locked``, ``stage:N``, ``plan``, ``write:N``,
#: ``install``, ``rename``, ``installed``).  Empty in a real run; the crash tests add one (in a wrapper script
#: of their own) that pauses the run there until it is killed.
CHECKPOINT_OBSERVERS: list[Callable[[str], None]] = []


def checkpoint(name: str) -> None:
    """Mark that the run reached ``name`` (tells :data:`CHECKPOINT_OBSERVERS`; nothing else)."""
    for observer in CHECKPOINT_OBSERVERS:
        observer(name)


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
        #: What could not be removed after a successful install (the new output is in place regardless).
        self.left_behind: list[str] = []

    # -- entering --------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock (or refuse, naming the live run that holds it) and clean up after a dead run."""
        parent = os.path.dirname(self.out)
        self._check_paths()
        try:
            os.makedirs(parent, exist_ok=True)
            stale = self.lock.owner() if os.path.exists(self.lock.path) else None
            self.lock.acquire()
        except LockHeld as exc:
            self._held(exc.owner)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise PackingError(
                f"out={self.out!r}: cannot write in {parent!r} ({exc.strerror}); choose a folder you can write to.",
                param="out",
            ) from None
        self.took_over = stale
        try:
            self._check_paths()  # again, now that no other run can change them
            os.makedirs(self.root, exist_ok=True)
            open(os.path.join(self.root, MARKER), "a").close()
            self._recover()
            os.makedirs(self.stage, exist_ok=True)
            checkpoint("locked")
        except BaseException:
            self.lock.release()
            raise

    def refuse_if_held(self) -> None:
        """Fail at once if a live run holds ``out`` (before the slow steps: loading the tokenizer, reading the
        inputs' schemas), with the same message as :meth:`acquire`.  Takes nothing."""
        self._check_paths()
        try:
            fd = os.open(self.lock.path, os.O_RDWR)
        except OSError:
            return  # no lock file: nobody holds it (acquire decides for good)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._held(self.lock.owner())
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _held(self, o: dict[str, Any]) -> None:
        since = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["started_unix"]))
            if "started_unix" in o
            else None
        )
        who = (
            f"pid {o.get('pid')} on host {o.get('host')}, since {since}"
            if since and o.get("pid")
            else "it is just starting, or another process holds the lock file"
        )
        raise PackingError(
            f"out={self.out!r} is being written by another packtools run ({who}; lock file "
            f"{self.lock.path!r}); wait for it to finish, stop it, or choose another out.",
            param="out",
        ) from None

    def _check_paths(self) -> None:
        """Refuse a lock path or work folder that is not packtools' (a folder, a file, someone's folder)."""
        if os.path.isdir(self.lock.path):
            raise PackingError(
                f"out={self.out!r}: {self.lock.path!r} is a folder, but packtools keeps its lock file there; "
                f"move or rename that folder, or choose another out.",
                param="out",
            )
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise PackingError(
                f"out={self.out!r}: {self.root!r} is a file, but packtools keeps its work folder there; move or "
                f"rename that file, or choose another out.",
                param="out",
            )
        if self.foreign_root():
            raise PackingError(
                f"out={self.out!r}: the folder {self.root!r} is not a packtools work folder (it has no "
                f"{MARKER!r} file) but packtools works there; move or rename it (or, if it is what an older "
                f"packtools left, delete it), or choose another out.",
                param="out",
            )

    def foreign_root(self) -> bool:
        """Whether the work folder's place holds a non-empty folder that packtools did not mark as its own."""
        if not os.path.isdir(self.root) or os.path.islink(self.root):
            return os.path.islink(self.root)
        return bool(os.listdir(self.root)) and not os.path.exists(os.path.join(self.root, MARKER))

    def _recover(self) -> None:
        if os.path.isdir(self.old):
            if os.path.exists(self.out):
                self._remove(self.old)  # what cannot be removed is noted, not fatal: the output is in place
            else:  # a kill between moving the old output aside and installing the new one: put it back
                os.replace(self.old, self.out)
        if os.path.exists(self.build):
            shutil.rmtree(self.build)
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        if os.path.isdir(self.stage):
            for name in os.listdir(self.stage):
                if ".tmp-" in name:
                    os.unlink(os.path.join(self.stage, name))

    def leftovers(self) -> bool:
        """Whether a run that died left its lock file or work folder here (what :func:`tidy_after_dead_run`
        removes)."""
        return os.path.exists(self.lock.path) or (os.path.isdir(self.root) and not self.foreign_root())

    # -- leaving ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Move the finished ``build/`` to ``out``, replacing a previous output there.  Once the new output is
        in place, failing to delete the old one does not fail the run: what is left is in :attr:`left_behind`."""
        checkpoint("install")
        if os.path.exists(self.out):
            os.replace(self.out, self.old)
            checkpoint("rename")
        fsync_tree(self.build)
        os.replace(self.build, self.out)
        fsync_dir(os.path.dirname(self.out))
        checkpoint("installed")
        if os.path.exists(self.old):
            self._remove(self.old)

    def _remove(self, path: str) -> None:
        """``rmtree(path)``, noting in :attr:`left_behind` what could not be removed instead of raising."""

        def failed(_fn: Any, name: str, _exc: Any) -> None:
            self.left_behind.append(name)

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=failed)
        else:
            shutil.rmtree(path, onerror=failed)

    def staged_parts(self) -> int:
        """Finished staged parts in ``stage/`` (what an interrupted run keeps for the next one)."""
        if not os.path.isdir(self.stage):
            return 0
        return sum(name.endswith(".npz") for name in os.listdir(self.stage))

    def _remove_ours(self) -> None:
        """Remove what packtools put in the work folder, and the folder if nothing else is in it."""
        if not os.path.isdir(self.root):
            return
        for name in OURS:
            path = os.path.join(self.root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                self._remove(path)
        if not self.left_behind and os.listdir(self.root) == [MARKER]:
            try:
                os.unlink(os.path.join(self.root, MARKER))
                os.rmdir(self.root)
            except OSError:
                pass

    def finish(self, ok: bool, keep_stage: bool) -> None:
        """Remove the work folder (all of it, or all but finished staged parts) and release the lock."""
        try:
            if os.path.isdir(self.old) and not os.path.exists(self.out):
                os.replace(self.old, self.out)  # stopped in the middle of install(): keep the previous output
            if ok or not keep_stage:
                self._remove_ours()
            else:
                shutil.rmtree(self.build, ignore_errors=True)
                self._remove_temporaries()
                if not self.staged_parts():
                    self._remove_ours()
        finally:
            self.lock.release()


def tidy_after_dead_run(out: str) -> None:
    """For a run whose output is already in place (a cache hit): remove the lock file and work folder that a
    run killed after installing it (or while cleaning up) left (take the lock, recover, remove the folder).
    A live run holding the lock is left alone."""
    ws = Workspace(out)
    if not ws.leftovers():
        return
    try:
        ws.acquire()
    except (PackingError, OSError):
        return
    ws.finish(ok=True, keep_stage=False)


def left_behind_notes(ws: Workspace) -> list[str]:
    """One line for the user if removing the previous output failed after the new one was installed."""
    if not ws.left_behind:
        return []
    return [
        f"the new output is installed in {ws.out!r}, but {len(ws.left_behind)} file(s) of the previous output could "
        f"not be deleted (e.g. {ws.left_behind[0]!r}; undeletable or busy); they stay in {ws.root!r}: delete them "
        f"when you can (the next run into this out tries again)."
    ]
