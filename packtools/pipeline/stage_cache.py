"""The shared stage cache: tokenized parts that ``packtools profile`` staged, found again by ``packtools pack``.

``packtools profile --tokenizer`` has no ``--out``, so it stages into one folder per user, :func:`cache_dir`.
An entry's file names are its cache key (:func:`packtools.pipeline.stage.stage_key`), so it can never be
stale: a changed input or tokenizer has another key.  Before staging, ``pack`` looks each of its parts up here
(:func:`adopt_cached`): a hit is **hard-linked** into the run's own ``stage/`` folder, so the run tokenizes
nothing for it and an eviction here cannot pull the file from under it (across file systems the run reads the
entry in place; entries used in the last :data:`MIN_AGE_S` seconds are never evicted).

Safety: entries are written under temporary names and renamed (the sidecar last, so its presence means the
entry is complete); writers hold a shared ``flock`` on ``.lock`` while staging and adopting, and eviction
(:func:`evict`, least recently used first, down to ``$PACKTOOLS_STAGE_CACHE_MAX_GB``) runs only under the
exclusive lock, taken without waiting.  ``rm -rf`` of the folder is always safe when no packtools run is going
(``docs/pipeline.md``, "Profile first, then pack").

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> cache_dir(d) == d, evict(d, budget=0)
(True, (0, 0))
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Sequence
from typing import Any

from .._atomic import atomic_path, discard
from ..errors import PackingError
from ..io.files import Part
from .stage import StageJob, stage_key
from .staged import (
    damage,
    load_sidecar,
    relink_sidecar,
)
from .tokenizer.spec import IdsSpec

CACHE_ENV, MAX_GB_ENV = "PACKTOOLS_STAGE_CACHE", "PACKTOOLS_STAGE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
#: An entry used (staged or adopted) this recently is never evicted.
MIN_AGE_S = 3600.0


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> str:
    """The stage cache folder: ``explicit``, else ``$PACKTOOLS_STAGE_CACHE``, else the user cache folder."""
    if explicit is not None:
        return os.path.abspath(os.fspath(explicit))
    env = os.environ.get(CACHE_ENV)
    if env:
        return os.path.abspath(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home_folder(), ".cache")
    return os.path.join(base, "packtools", "stage")


def home_folder() -> str:
    """The user's home folder, or a clear error where it cannot be found (``HOME`` unset and no passwd entry,
    as in containers run under an arbitrary uid): ``os.path.expanduser`` would return ``~`` itself, a folder
    named ``~`` in the current folder."""
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isabs(home):
        raise PackingError(
            f"cannot find the home folder for packtools' caches (HOME is unset and this user has no passwd "
            f"entry): set ${CACHE_ENV} (the stage cache) and $PACKTOOLS_CACHE_DIR (tokenizer verdicts) to "
            f"folders you can write, or HOME.",
            param="stage_cache",
        )
    return home


#: written into the cache folder: tools that honour the Cache Directory Tagging Specification (backups, and
#: packtools' own input discovery) leave it out
TAG = "Signature: 8a477f597d28d172789f06886806bc55\n# packtools stage cache: staged parts; safe to delete\n"


def prepare(folder: str) -> None:
    """Create the cache folder with its ``CACHEDIR.TAG`` (raises OSError where it cannot be written)."""
    os.makedirs(folder, exist_ok=True)
    tag = os.path.join(folder, "CACHEDIR.TAG")
    if not os.path.exists(tag):
        with atomic_path(tag) as tmp, open(tmp, "w", encoding="ascii") as fh:
            fh.write(TAG)


def max_bytes() -> int:
    """The cache's size budget in bytes (``$PACKTOOLS_STAGE_CACHE_MAX_GB``)."""
    raw = os.environ.get(MAX_GB_ENV)
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        raise PackingError(
            f"${MAX_GB_ENV}={raw!r} is not a number of gigabytes; set it to e.g. 20, or unset it."
        ) from None
    return int(gb * 1e9)


class CacheLock:
    """``flock`` on ``DIR/.lock``: shared while staging or adopting, exclusive (never waited for) to evict."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, ".lock")
        self._fd: int | None = None

    def shared(self) -> CacheLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return self

    def try_exclusive(self) -> bool:
        """Upgrade to exclusive if no other process holds the lock (a no-op ``False`` otherwise)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            return False

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CacheLock:
        return self.shared()

    def __exit__(self, *exc: object) -> None:
        self.release()


def stage_jobs(
    parts: Sequence[Part],
    ids: IdsSpec,
    columns: Sequence[str],
    types: Sequence[str],
    folder: str,
    *,
    tokenizer: str | None,
    single_threaded: bool = False,
    known_columns: tuple[str, ...] | None = None,
    engine_proven: tuple[tuple[str, Any], ...] | None = None,
    checksum: bool = False,
) -> list[StageJob]:
    """One :class:`StageJob` per part, its files named by their cache key in ``folder`` (as ``pack`` names
    them); the other arguments are the :class:`StageJob` fields every job shares (``ids``: the run's
    :class:`~packtools.pipeline.tokenizer.spec.IdsSpec`, handed to every job as it is)."""
    jobs = []
    for part in parts:
        key = stage_key(part, tuple(columns), tuple(types), ids, known_columns)
        jobs.append(
            StageJob(
                part,
                ids,
                tuple(columns),
                tuple(types),
                tokenizer,
                os.path.join(folder, key + ".arrow"),
                os.path.join(folder, key + ".npz"),
                single_threaded=single_threaded,
                known_columns=known_columns,
                engine_proven=engine_proven,
                checksum=checksum,
            )
        )
    return jobs


def _entry(folder: str, job: StageJob) -> tuple[str, str]:
    name = os.path.basename(job.sidecar)[: -len(".npz")]
    return os.path.join(folder, name + ".arrow"), os.path.join(folder, name + ".npz")


def adopt_cached(jobs: Sequence[StageJob], folder: str | None = None) -> tuple[set[str], list[str]]:
    """For each job not yet staged, take a finished entry of the stage cache (hard link, or in place), with its
    tokenizer engine report; returns the sidecars of the parts that came from the cache, and notes.  An entry
    whose content is not what it was written with (:func:`packtools.pipeline.staged.damage`: a cut or empty
    file, a flipped bit) is removed from the cache and the part staged again, with a note.  A missing or
    unreadable cache is no error: the parts are staged."""
    adopted: set[str] = set()
    notes: list[str] = []
    folder = _cache_or_none(folder)
    if folder is None or not os.path.isdir(folder):
        return adopted, notes
    try:
        lock = CacheLock(folder).shared()
    except OSError:
        return adopted, notes
    try:
        for job in jobs:
            if os.path.exists(job.sidecar):
                continue
            arrow, sidecar = _entry(folder, job)
            if not (os.path.exists(sidecar) and os.path.exists(arrow)):
                continue
            why = damage(sidecar)
            if why is not None:
                notes.append(
                    f"stage cache entry {sidecar!r} was damaged ({why}): removed, and the part staged again"
                )
                discard(sidecar, arrow)
                continue
            if os.path.abspath(load_sidecar(sidecar)[2]) != arrow:
                continue  # an entry that points elsewhere (an as-is input): stage it normally
            target = arrow
            try:
                os.makedirs(os.path.dirname(job.staged), exist_ok=True)
                if os.path.exists(job.staged):
                    os.unlink(job.staged)
                os.link(arrow, job.staged)
                target = job.staged
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
            # the entry's engine report comes with it (the characters it left out, the rows it compared)
            relink_sidecar(sidecar, job.sidecar, target)
            now = time.time()
            for path in (arrow, sidecar):
                with contextlib.suppress(OSError):
                    os.utime(path, (now, now))  # used: the last to be evicted
            adopted.add(job.sidecar)
    finally:
        lock.release()
    return adopted, notes


def _cache_or_none(folder: str | None) -> str | None:
    try:
        return cache_dir(folder)
    except PackingError:
        return None


def keep_in_place(data: Sequence[str], folder: str | None = None) -> list[int]:
    """The indices of ``data`` (the staged files a run is about to read) that are cache entries read in place
    (a cache on another file system) and are gone: evicted since the run adopted them (an entry is safe for
    :data:`MIN_AGE_S` after its last use; a run can be longer).  Those still there are marked used now."""
    folder, gone, now = _cache_or_none(folder), [], time.time()
    for i, path in enumerate(data):
        if folder is None or os.path.dirname(os.path.abspath(path)) != folder:
            continue
        try:
            os.utime(path, (now, now))
            os.utime(path[: -len(".arrow")] + ".npz", (now, now))
        except FileNotFoundError:
            if not os.path.exists(path):
                gone.append(i)
        except OSError:
            pass
    return gone


def evicted_error(exc: OSError, folder: str | None = None) -> PackingError | None:
    """A run's ``FileNotFoundError`` on a stage-cache entry it read in place, said as what it is (else None)."""
    folder, path = _cache_or_none(folder), getattr(exc, "filename", None)
    if folder is None or not path or os.path.dirname(os.path.abspath(os.fspath(path))) != folder:
        return None
    return PackingError(
        f"the stage cache entry {os.fspath(path)!r} (a part `packtools profile` tokenized, read in place: the "
        f"cache is on another file system) was removed while this run read it: another run trimmed the cache "
        f"({MAX_GB_ENV}), or it was deleted. Run the same command again: the part is tokenized again. To keep "
        f"long runs off the cache, put ${CACHE_ENV} on the file system of --out."
    )


def _entries(folder: str) -> list[tuple[float, int, str]]:
    """``(last use, bytes, key)`` of each complete entry."""
    out = []
    for name in os.listdir(folder):
        if not name.endswith(".npz") or ".tmp-" in name:
            continue
        key = name[: -len(".npz")]
        size, used = 0, 0.0
        for suffix in (".npz", ".arrow"):
            try:
                st = os.stat(os.path.join(folder, key + suffix))
            except FileNotFoundError:
                continue
            size += st.st_size
            used = max(used, st.st_mtime)
        out.append((used, size, key))
    for key in _orphans(folder):  # not evictable as entries, but they take room
        try:
            st = os.stat(os.path.join(folder, key + ".arrow"))
        except FileNotFoundError:
            continue
        out.append((float("inf"), st.st_size, key))
    return out


def _orphans(folder: str) -> list[str]:
    """Keys of ``.arrow`` files without a sidecar (counted in the cache's size, evicted once old)."""
    names = set(os.listdir(folder))
    return [
        n[: -len(".arrow")]
        for n in names
        if n.endswith(".arrow") and ".tmp-" not in n and n[: -len(".arrow")] + ".npz" not in names
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def evict(folder: str, keep: Sequence[str] = (), budget: int | None = None) -> tuple[int, int]:
    """Remove least recently used entries (never ``keep``, never one used in the last :data:`MIN_AGE_S`) until
    the cache holds at most ``budget`` bytes, and temporary files of dead runs; returns ``(evicted, bytes)``.
    Runs only if the exclusive lock is free right now."""
    budget = max_bytes() if budget is None else budget
    lock = CacheLock(folder)
    if not lock.try_exclusive():
        lock.release()
        return 0, sum(e[1] for e in _entries(folder))
    try:
        for name in os.listdir(folder):
            if ".tmp-" in name:
                pid = name.rsplit(".tmp-", 1)[1]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, name))
        keep_set, now, evicted = set(keep), time.time(), 0
        # a data file whose sidecar never came (a kill while staging or evicting)
        for key in _orphans(folder):
            path = os.path.join(folder, key + ".arrow")
            with contextlib.suppress(FileNotFoundError):
                if key not in keep_set and now - os.stat(path).st_mtime >= MIN_AGE_S:
                    os.unlink(path)
                    evicted += 1
        entries = sorted(_entries(folder))
        total = sum(e[1] for e in entries)
        for used, size, key in entries:
            if total <= budget:
                break
            if key in keep_set or now - used < MIN_AGE_S:
                continue
            for suffix in (".npz", ".arrow"):  # the sidecar first: without it the entry is not complete
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, key + suffix))
            total -= size
            evicted += 1
        return evicted, total
    finally:
        lock.release()
