"""Every multi-process launch of the tests goes through here (``tests/test_launch.py`` checks that none bypasses it).

``torchrun(...)`` runs ``python -m torch.distributed.run --standalone``: the rendezvous store listens on a port the
kernel picks and torchrun keeps bound (``localhost:0``), and the workers reuse that store.  The launches used to
pick a port by binding port 0, closing the socket and passing the number as ``--master_port``: between the close
and torchrun's bind, seconds later (two interpreters importing torch), any other process of the machine (the other
pytest-xdist worker's gloo sockets or its own launch) could take that port.

``launch_lock()`` holds a lock shared by the pytest-xdist workers of one run (a file named after the run's
``PYTEST_XDIST_TESTRUNUID``; no lock without xdist): two multi-process jobs of one test run never overlap.  Under
``-n 2`` the tensor-parallel launch of ``tests/test_tp_training.py`` once died (rank 0 SIGABRT in a collective,
rank 1 "Connection reset by peer") while the other worker ran its own tests, and passed alone; its cause was not
found, so the jobs take turns (docs/development.md).

The whole output of a launch goes to a file; a failure names the file and shows the first error lines of every
rank (``torchrun``'s own summary is the last lines, the cause usually far above it), with Python's
faulthandler on in the workers so a fatal signal prints every thread's stack.
A launch expected to pass whose worker died of SIGABRT from native code (torch's C++ side: "terminate called
...") is launched once more (``native_abort``); the same abort was seen under load in one process too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: Lines of a failed launch's log shown first: where the cause usually is.
_CAUSE_MARKS = (
    "Traceback",
    "Error",
    "error:",
    "Fatal Python",
    "terminate called",
    "what():",
    "Aborted",
    "Signal",
)


def lock_path() -> Path | None:
    """The lock file the xdist workers of this test run share; None outside pytest-xdist (one process)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    return Path(tempfile.gettempdir()) / f"packtools-tests-launch-{run}.lock"


@contextlib.contextmanager
def launch_lock() -> Iterator[None]:
    """Hold the run's launch lock (blocks while the other xdist worker's multi-process job runs)."""
    path = lock_path()
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def env(**extra: str) -> dict[str, str]:
    """The launched processes' environment: packtools and ``tests/`` importable, one intra-op thread, faulthandler."""
    out = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p
    )
    out.update(extra)
    return out


def torchrun_command(nproc: int, script: str | Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node N script args`` (no fixed port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(script), *map(str, args)]  # fmt: skip


def failure(log: Path, text: str, limit: int = 6000) -> str:
    """What a failed launch's assertion shows: the log's first error lines, then its tail."""
    lines = text.splitlines()
    first = [ln for ln in lines if any(m in ln for m in _CAUSE_MARKS)][:40]
    tail = "\n".join(lines)[-limit:]
    return (
        f"launch failed (whole output: {log})\n-- first error lines:\n"
        + "\n".join(first)
        + "\n-- tail:\n"
        + tail
    )


def run(
    cmd: list[str],
    log: Path,
    timeout: float,
    environ: dict[str, str] | None = None,
    check: bool = True,
    lock: bool = True,
):
    """Run ``cmd`` (under the launch lock unless ``lock`` is false: one process); ``(returncode, stdout, stderr)``,
    both also kept in ``log``.

    The output goes to files, not pipes: a leftover worker holding a pipe can never keep the test waiting.  On a
    timeout the launcher gets SIGTERM (torchrun forwards it to its workers), then SIGKILL, and the test fails
    saying so."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log.with_name(log.name + ".stdout"), log.with_name(log.name + ".stderr")
    with (
        launch_lock() if lock else contextlib.nullcontext(),
        open(out_path, "w") as out,
        open(err_path, "w") as err,
    ):
        proc = subprocess.Popen(cmd, env=environ or env(), stdout=out, stderr=err, text=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    log.write_text(f"$ {' '.join(cmd)}\n-- stdout:\n{stdout}\n-- stderr:\n{stderr}")
    if code is None:
        raise AssertionError(f"launch timed out after {timeout} s\n" + failure(log, stdout + "\n" + stderr))
    if check:
        assert code == 0, failure(log, stdout + "\n" + stderr)
    return code, stdout, stderr


def torchrun(nproc: int, script: str | Path, *args: str, log: Path, timeout: float = 600, check: bool = True,
             environ: dict[str, str] | None = None):  # fmt: skip
    """``nproc`` processes of ``script`` (a path, or a file name in ``tests/``) under torchrun; see ``run``."""
    script = Path(script)
    if not script.is_absolute():
        script = TESTS / script
    cmd = torchrun_command(nproc, script, *args)
    if not check:  # a launch expected to fail: never retried
        return run(cmd, log, timeout, environ, check)
    code, stdout, stderr = run(cmd, log, timeout, environ, check=False)
    if code != 0 and native_abort(stdout + "\n" + stderr):
        # One more launch, only for a worker killed by torch's C++ side (SIGABRT, "terminate called ..."): seen
        # under load on the 2-core CI machine, never alone (docs/development.md). The first log is kept beside.
        log.rename(log.with_name(log.name + ".aborted"))
        code, stdout, stderr = run(cmd, log, timeout, environ, check=False)
    assert code == 0, failure(log, stdout + "\n" + stderr)
    return code, stdout, stderr


def native_abort(text: str) -> bool:
    """Whether a launch's output says a worker died of SIGABRT from native code (not a Python exception)."""
    return "terminate called" in text or "Signal 6 (SIGABRT)" in text or "exitcode  : -6" in text
