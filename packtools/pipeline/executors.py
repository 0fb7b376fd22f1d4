"""Executors: run one function over many jobs, in-process, in a process pool, or as Ray tasks; and
:func:`run_jobs`, the pipeline's two parallel stages (staging, writing) run on one.

They share one interface, :meth:`Executor.run`, which yields ``(index, outcome)`` pairs as jobs finish, where
``outcome`` is the function's return value or the exception it raised.  An executor never retries and never
raises a job's exception: :func:`run_jobs` retries a job whose worker was lost and raises any other, so every
executor behaves the same way.

>>> with get_executor("local") as ex:
...     sorted(ex.run(abs, [-1, 2, -3])), run_jobs(ex, abs, [-1, 2, -3], "stage", True, 0)
([(0, 1), (1, 2), (2, 3)], [1, 2, 3])
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from .._optional import require
from .._progress import progress
from ..compat.futures import pool_broken, pool_processes
from ..errors import PackingError
from .workspace import checkpoint

EXECUTORS: tuple[str, ...] = ("local", "pool", "ray")


class Executor:
    """Runs ``fn(job)`` for every job and yields ``(index, result or exception)`` in completion order."""

    name = "base"

    def run(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the executor holds (processes, a Ray runtime it started)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TwoSteps:
    """A job function made of two steps, ``second(job, first(job))`` (picklable when both steps are).

    The local executor runs the first step of the next job in a thread while the second step of this one runs
    (see :func:`run_overlapped`); the other executors call it as one function.  Worth it when one step
    releases the GIL (file writes, ``nogil`` kernels), as gathering and writing a shard do.
    """

    first: Callable[[Any], Any]
    second: Callable[[Any, Any], Any]

    def __call__(self, job: Any) -> Any:
        return self.second(job, self.first(job))


class LocalExecutor(Executor):
    """In this process, one job after another (the default; no extra dependency).  A :class:`TwoSteps`
    function overlaps its two steps of consecutive jobs (:func:`run_overlapped`)."""

    name = "local"

    def run(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        if isinstance(fn, TwoSteps):
            yield from run_overlapped(fn, jobs)
            return
        for i, job in enumerate(jobs):
            try:
                yield i, fn(job)
            except Exception as exc:  # noqa: BLE001 - reported to the caller as the job's outcome
                yield i, exc


def run_overlapped(fn: TwoSteps, jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """``(index, outcome)`` of every job in job order, as :class:`LocalExecutor` yields them; ``fn.first`` of
    job ``i + 1`` runs in a thread while ``fn.second`` of job ``i`` runs here.

    At most one first step runs ahead, so at most two jobs' intermediate results are alive at once.  A job
    whose first step failed yields that exception (its second step does not run).  When the caller stops
    early (an error, Ctrl-C), the step running ahead is waited for and its result dropped.
    """
    if not jobs:
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="packtools-ahead")
    try:
        ahead: Future[Any] = pool.submit(fn.first, jobs[0])
        for i, job in enumerate(jobs):
            done = ahead
            if i + 1 < len(jobs):
                ahead = pool.submit(fn.first, jobs[i + 1])
            try:
                outcome = fn.second(job, done.result())
            except Exception as exc:  # noqa: BLE001 - either step's error, reported as the job's outcome
                outcome = exc
            del done  # its result: not kept while the caller handles the outcome
            yield i, outcome
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class PoolExecutor(Executor):
    """A local pool of ``workers`` processes started with ``spawn`` (safe with threads and Numba).

    ``fn`` and the jobs must be picklable and importable (module-level), and a script using it needs the usual
    ``if __name__ == "__main__":`` guard.  The pool is started on the first :meth:`run` and kept for the next
    ones (worker start-up, the import of packtools and a tokenizer, is paid once); a pool that lost a worker
    (e.g. one killed for memory) fails the jobs in flight and is replaced by a fresh one on the next call.
    Workers ignore Ctrl-C (the driver handles it and stops them) and exit within :data:`PARENT_CHECK_S` seconds
    of the driver's death, however it died (see :func:`die_with_parent`).
    """

    name = "pool"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = _check_workers(workers) or os.cpu_count() or 1
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is not None and pool_broken(self._pool):
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_worker_init
            )
        return self._pool

    def run(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        if not jobs:
            return
        pool = self._get_pool()
        finished = False
        try:
            futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                try:
                    yield futures[fut], fut.result()
                except Exception as exc:  # noqa: BLE001 - includes BrokenProcessPool
                    yield futures[fut], exc
            finished = True
        finally:
            if not finished:  # interrupted, or the caller stopped on an error: stop the workers now
                self._terminate()

    def _terminate(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in pool_processes(pool):
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _worker_init() -> None:
    """In each pool worker: leave Ctrl-C to the driver (which stops the pool), tokenize on one thread (the pool
    is the parallelism), and die with the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    die_with_parent()


#: How often a pool worker checks that its driver is still alive (seconds).
PARENT_CHECK_S = 0.5


def die_with_parent(interval: float = PARENT_CHECK_S) -> threading.Thread:
    """Exit this process as soon as its parent is gone.

    A driver killed with SIGKILL (the OOM killer's signal) cannot stop its workers; they would be re-parented
    and block forever on their task pipe, holding the driver's stdout/stderr (so a caller waiting for EOF
    hangs).  A daemon thread watches the parent pid and ends the process when it changes; it works on every
    POSIX system and whatever thread started the worker (Linux's ``PR_SET_PDEATHSIG`` fires when the *thread*
    that forked exits, which would kill a healthy pool started from a short-lived thread)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="packtools-parent-watch", daemon=True)
    thread.start()
    return thread


class RayExecutor(Executor):
    """One Ray task (1 CPU) per job.  Needs ``pip install 'packtools[ray]'``.

    Uses the running Ray runtime if there is one; otherwise calls ``ray.init(address=address)`` (``None``:
    start a local runtime with ``workers`` CPUs) and shuts it down again on :meth:`close`.  On a cluster,
    packtools must be importable on the workers (installed there, or through a ``runtime_env``).  Ray's own
    retries are turned off: the caller retries, the same way for every executor.
    """

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, **init_kwargs: Any) -> None:
        self.ray = require("ray", "the Ray executor")
        self.workers = _check_workers(workers)
        self._started = False
        if not self.ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
                **init_kwargs,
            }
            if address is None and self.workers is not None:
                kwargs.setdefault("num_cpus", self.workers)
            self.ray.init(address=address, **kwargs)
            self._started = True

    def run(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        ray = self.ray
        task = ray.remote(num_cpus=1, max_retries=0, retry_exceptions=False)(_call)
        pending = {task.remote(fn, job): i for i, job in enumerate(jobs)}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    i = pending.pop(ref)
                    try:
                        yield i, ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - RayTaskError, WorkerCrashedError, ...
                        yield i, getattr(exc, "cause", None) or exc
        finally:
            for ref in pending:  # interrupted, or the caller stopped on an error
                with contextlib.suppress(Exception):  # already finished or gone
                    ray.cancel(ref, force=True)

    def close(self) -> None:
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
        self._started = False


def _call(fn: Callable[[Any], Any], job: Any) -> Any:
    """The Ray task: any picklable callable (``ray.remote`` itself takes only Python functions)."""
    return fn(job)


def _check_workers(workers: int | None) -> int | None:
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise PackingError(
            f"workers={workers!r} must be a positive int (or None for all cores).", param="workers"
        )
    return workers


def executor_name(executor: str | Executor) -> str:
    """The name of ``executor``: one of :data:`EXECUTORS` as given, or an :class:`Executor`'s own; anything else is
    refused by name.  Where a run asks how its stages run (load ahead in the driver, single-threaded jobs), it
    reads this, one way.

    >>> executor_name("pool"), executor_name(LocalExecutor())
    ('pool', 'local')
    """
    if isinstance(executor, Executor):
        return executor.name
    if isinstance(executor, str) and executor in EXECUTORS:
        return executor
    if isinstance(executor, str):
        raise PackingError(
            f"executor={executor!r} is unknown; use one of {', '.join(EXECUTORS)}.", param="executor"
        )
    raise PackingError(
        f"executor={executor!r} is not an executor: pass one of {', '.join(EXECUTORS)}, or an instance of "
        f"packtools.pipeline.executors.Executor (a subclass with its name and run method).",
        param="executor",
    )


def get_executor(
    name: str | Executor = "local", workers: int | None = None, address: str | None = None
) -> Executor:
    """The executor called ``name`` (``local``, ``pool`` or ``ray``); an :class:`Executor` is returned as is, and
    anything else refused by name (:func:`executor_name`)."""
    if isinstance(name, Executor):
        return name
    executor_name(name)
    if name == "local" and workers is not None:
        raise PackingError(
            f"workers={workers} with executor='local': the local executor runs every stage in this process, so "
            f"it would change nothing. Use executor='pool' (a process pool of that many workers) or 'ray', or "
            f"leave workers out.",
            param="workers",
        )
    if address is not None and name != "ray":
        raise PackingError(
            f"address={address!r} with executor={name!r}: only the Ray executor connects to a cluster, so it "
            f"would change nothing. Use executor='ray', or leave address out.",
            param="address",
        )
    if name == "local":
        return LocalExecutor()
    if name == "pool":
        return PoolExecutor(workers)
    return RayExecutor(address, workers)  # (executor_name let only the three names through)


#: Exceptions that a lost worker raises rather than the job itself: worth trying again.
TRANSIENT = frozenset(
    {
        "BrokenProcessPool",
        "WorkerCrashedError",
        "NodeDiedError",
        "LocalRayletDiedError",
        "OwnerDiedError",
        "ObjectLostError",
        "ActorDiedError",
        "RaySystemError",
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says a worker was lost (retry) rather than the job failing (deterministic: report)."""
    return any(cls.__name__ in TRANSIENT for cls in type(exc).__mro__)


def run_jobs(
    ex: Executor,
    fn: Callable[[Any], Any],
    jobs: Sequence[Any],
    desc: str,
    quiet: bool,
    retries: int,
    *,
    finished: list[float] | None = None,
) -> list[Any]:
    """Run ``fn`` over ``jobs`` on ``ex``; results in job order.  A job whose worker was lost is tried again
    (up to ``retries`` times); any other exception is raised at once (it would fail again).  ``finished``
    gets the wall-clock time (``time.time()``) each job's result reached the driver, in that order."""
    results: list[Any] = [None] * len(jobs)
    todo = list(range(len(jobs)))
    bar = progress(len(jobs), desc, unit="parts" if desc == "stage" else "shards", quiet=quiet)
    try:
        for attempt in range(retries + 1):
            lost = []
            outcomes = ex.run(fn, [jobs[i] for i in todo])
            try:
                for k, outcome in outcomes:
                    i = todo[k]
                    if isinstance(outcome, BaseException):
                        if is_transient(outcome) and attempt < retries:
                            lost.append(i)
                            continue
                        raise outcome
                    results[i] = outcome
                    if finished is not None:
                        finished.append(time.time())
                    bar.update(1)
                    checkpoint(f"{desc}:{sum(r is not None for r in results)}")
            finally:  # on an error: the executor stops the jobs still running before the caller goes on
                close = getattr(outcomes, "close", None)
                if close is not None:
                    close()
            todo = sorted(lost)
            if not todo:
                break
    finally:
        bar.close()
    return results
