"""Jobs run on an executor for the pipeline's two parallel stages (staging, writing): results in job order,
a job whose worker was lost tried again, progress shown, and a checkpoint after each finished job.

>>> from packtools.pipeline.executors import get_executor
>>> with get_executor("local") as ex:
...     run_jobs(ex, abs, [-1, 2, -3], "stage", True, 0)
[1, 2, 3]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .._progress import progress
from .executors import Executor, is_transient
from .workspace import checkpoint


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
