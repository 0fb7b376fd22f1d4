"""Ctrl-C while Numba loads or compiles the kernels ends the run like any Ctrl-C (:mod:`packtools._interrupts`).

Before the hold, a Ctrl-C that landed inside one of llvmlite's ctypes callbacks was dropped ("Exception ignored on
calling ctypes callback function") and the run went on to install its output with status 0, or failed with
"no compiled object yet".  Here: :func:`~packtools._interrupts.held` on its own, a compile in the main thread that
receives SIGINT, and real SIGINTs sent to real ``packtools pack`` processes at several delays after Numba's
import starts, with a cold Numba cache (compiles) and a warm one (loads), the kernels loading in the main thread
(a small input) or in their thread beside the stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools._interrupts import held

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKED = os.path.join(ROOT, "tests", "_load_marked_run.py")


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises here, as in a terminal, even where pytest was started with SIGINT ignored (a background job of
    a non-interactive shell, which Python then leaves ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_hold_is_raised_as_it_ends():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            with held():  # nested: only the outermost delivers
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, without a hold
                steps.append("inner block ran to its end")
            steps.append("outer block ran to its end")
    assert steps == ["inner block ran to its end", "outer block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_hold_records_only_handlers_written_in_python():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with held():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the OS still ends the process at once
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_ctrl_c_during_a_compile_in_the_main_thread_comes_after_it():
    numba = pytest.importorskip("numba")
    if numba.config.DISABLE_JIT:
        pytest.skip("NUMBA_DISABLE_JIT=1: nothing compiles")
    from numba.core import event
    from numba.core.compiler_lock import global_compiler_lock

    import packtools.core.kernels  # noqa: F401 - registers the hold on Numba's compiler lock

    @numba.njit
    def twice(x):
        return 2 * x

    class CtrlCWhileCompiling(event.Listener):
        def on_start(self, ev):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # without the hold, KeyboardInterrupt is raised in the compile here

        def on_end(self, ev):
            pass

    listener = CtrlCWhileCompiling()
    event.register("numba:compile", listener)
    try:
        with pytest.raises(KeyboardInterrupt):
            twice(3)
    finally:
        event.unregister("numba:compile", listener)
    assert len(twice.signatures) == 1  # the compile ended before the interrupt
    assert not global_compiler_lock.is_locked()  # and gave its lock back
    assert twice(4) == 8


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A tokenized parquet file of 4,000 rows (one small part: the kernels load in the main thread at the plan)
    and a Numba cache that one uninterrupted run filled."""
    root = tmp_path_factory.mktemp("load")
    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 300, 4000))]).astype(np.int32)
    values = rng.integers(0, 1000, int(offsets[-1])).astype(np.int32)
    src = str(root / "in.parquet")
    pq.write_table(
        pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))}), src
    )
    warm = str(root / "numba-cache-warm")  # every kernel of the run loaded from here, none compiled
    cmd = [
        sys.executable,
        "-m",
        "packtools.cli",
        "pack",
        src,
        "--out",
        str(root / "ref"),
        "--max-length",
        "512",
    ]
    subprocess.run(cmd, env=env(warm), check=True, capture_output=True)
    return src, warm


def env(cache: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    values = {**os.environ, "PYTHONPATH": path, "NUMBA_CACHE_DIR": cache}
    values.pop("NUMBA_DISABLE_JIT", None)
    return values


def interrupted_run(
    src: str, folder, cache: str, ahead: bool, delay: float, sig: int = signal.SIGINT
) -> tuple[int, str, str]:
    """Start ``packtools pack SRC``, send ``sig`` ``delay`` s after Numba's import starts; status, stderr, out."""
    log, out = str(folder / "log"), str(folder / "out")
    args = ["pack", src, "--out", out, "--max-length", "512", "--quiet"]
    proc = subprocess.Popen(
        [sys.executable, MARKED, log, "1" if ahead else "0", *args],
        env=env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (os.path.exists(log) and "numba" in open(log).read().split()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "Numba was never imported"
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, out


def check_interrupted(tokenized, tmp_path, ahead, runs, how):
    """Each of ``runs`` (cold cache?, delay) ends with ``how``'s status and line, and installs nothing."""
    src, warm = tokenized
    sig, status, name = how
    for i, (cold, delay) in enumerate(runs):
        cache = str(tmp_path / f"numba-cache-{i}") if cold else warm  # cold: every kernel compiles
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        got, err, out = interrupted_run(src, folder, cache, ahead, delay, sig)
        said = f"{'cold' if cold else 'warm'} cache, {name} {delay} s after Numba's import began: {err}"
        assert got == status, said
        assert f"interrupted by {name}" in err and "Exception ignored" not in err, said
        assert err.count("\n") == 1 and "Traceback" not in err, said
        assert not os.path.exists(out), said  # nothing installed


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True], ids=["main-thread", "kernels-thread"])
def test_ctrl_c_while_the_kernels_load_ends_the_run_with_130(tokenized, tmp_path, ahead):
    runs = [(True, d) for d in (0.0, 0.3, 1.0, 2.5)] + [(False, d) for d in (0.0, 0.1, 0.25, 0.5)]
    check_interrupted(tokenized, tmp_path, ahead, runs, (signal.SIGINT, 130, "Ctrl-C"))


@pytest.mark.slow
def test_sigterm_while_the_kernels_load_ends_the_run_with_143(tokenized, tmp_path):
    runs = [(True, 0.3), (True, 1.0), (False, 0.1), (False, 0.25)]
    check_interrupted(tokenized, tmp_path, False, runs, (signal.SIGTERM, 143, "SIGTERM"))
