"""The tests' multi-process launches (``tests/_launch.py``): no port picked and released, one job at a time per run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import _launch
import pytest

HERE = Path(__file__).resolve().parent

#: How a launch used to get its port: bind port 0, read the number, close the socket, pass the number on.
_RELEASED_PORT = re.compile(
    r"master_port|MASTER_PORT|main_process_port: \{|\.bind\(\(\"127\.0\.0\.1\", 0\)\)"
)


def test_every_torchrun_launch_goes_through_the_helper():
    """No test file starts ``torch.distributed.run`` itself, nor picks a port and frees it for a launch to bind
    later (another process could take it meanwhile); the helper's command has torchrun keep its own port."""
    offenders = []
    for path in sorted(HERE.glob("*.py")):
        if path.name in ("_launch.py", "test_launch.py"):
            continue
        text = path.read_text()
        if '"torch.distributed.run"' in text:
            offenders.append(f"{path.name}: starts torch.distributed.run (use _launch.torchrun)")
        for line in text.splitlines():
            if _RELEASED_PORT.search(line) and "test_job_docs" not in path.name:
                offenders.append(f"{path.name}: {line.strip()}")
    assert not offenders, offenders
    cmd = _launch.torchrun_command(2, "w.py", "a")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert not any("port" in c for c in cmd)


HOLDER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import _launch
import pytest
log, go = Path(sys.argv[1]), Path(sys.argv[2])
with _launch.launch_lock():
    with open(log, "a") as f:
        f.write("enter holder\\n")
    while not go.exists():
        time.sleep(0.05)
    with open(log, "a") as f:
        f.write("exit holder\\n")
"""

WAITER = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import _launch
import pytest
log = Path(sys.argv[1])
with open(log, "a") as f:
    f.write("waiting\\n")
with _launch.launch_lock():
    with open(log, "a") as f:
        f.write("enter waiter\\n")
"""


def _wait_for(log: Path, line: str, proc: subprocess.Popen) -> None:
    while line not in log.read_text().splitlines():
        assert proc.poll() is None or line in log.read_text().splitlines(), log.read_text()
        time.sleep(0.05)


def test_two_processes_of_one_run_never_hold_the_launch_lock_together(tmp_path, monkeypatch):
    """Two processes of one test run (the same PYTEST_XDIST_TESTRUNUID, as pytest-xdist's workers): the second
    enters the lock only after the first left it.  Outside xdist there is no lock (one process)."""
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"launch-test-{tmp_path.name}")
    log, go = tmp_path / "log", tmp_path / "go"
    log.write_text("")
    holder_py, waiter_py = tmp_path / "holder.py", tmp_path / "waiter.py"
    holder_py.write_text(HOLDER.format(tests=str(HERE)))
    waiter_py.write_text(WAITER.format(tests=str(HERE)))
    holder = subprocess.Popen([sys.executable, str(holder_py), str(log), str(go)])
    try:
        _wait_for(log, "enter holder", holder)
        waiter = subprocess.Popen([sys.executable, str(waiter_py), str(log)])
        try:
            _wait_for(log, "waiting", waiter)
            time.sleep(1)  # room for the waiter to (wrongly) enter while the holder is inside
            assert "enter waiter" not in log.read_text()
            go.touch()
            assert waiter.wait(timeout=120) == 0 and holder.wait(timeout=120) == 0
        finally:
            waiter.kill()
    finally:
        go.touch()
        holder.kill()
    assert log.read_text().splitlines() == ["enter holder", "waiting", "exit holder", "enter waiter"]
    _launch.lock_path().unlink()  # this test's own run id: no one else uses its lock file
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID")
    assert _launch.lock_path() is None


def test_a_failed_launch_shows_its_first_error_lines_and_keeps_the_whole_output(tmp_path):
    """A failing launch's message leads with the error lines (torchrun's summary comes last, the cause far above
    it) and names the file holding the whole output."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('x\\n' * 5000)\nraise RuntimeError('the cause')\n")
    log = tmp_path / "run.log"
    try:
        _launch.run([sys.executable, str(script)], log, timeout=120)
    except AssertionError as err:
        message = str(err)
    else:
        raise AssertionError("the failing launch passed")
    first = message.split("-- tail:")[0]
    assert "RuntimeError: the cause" in first and str(log) in first
    assert "RuntimeError: the cause" in log.read_text() and log.read_text().count("x\n") >= 5000


_ABORTS_ONCE = """import os, sys
from pathlib import Path
marks = Path(sys.argv[1])
rank = os.environ["RANK"]
(marks / f"{rank}-{len(list(marks.glob(rank + '-*')))}").touch()
if rank == "0" and len(list(marks.glob("0-*"))) == 1 and sys.argv[2] == "abort":
    os.abort()  # what torch's C++ side does on "terminate called ..."
if sys.argv[2] == "raise":
    raise RuntimeError("a Python error")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["abort", "raise"])
def test_a_launch_is_retried_once_after_a_native_abort_and_never_after_a_python_error(tmp_path, how):
    """A worker killed by SIGABRT (native code) gets one more launch, its first log kept beside; a Python
    exception fails the test at once."""
    script = tmp_path / "worker.py"
    script.write_text(_ABORTS_ONCE)
    marks = tmp_path / "marks"
    marks.mkdir()
    log = tmp_path / "run.log"
    if how == "abort":
        _launch.torchrun(2, script, str(marks), how, log=log, timeout=300)
        assert len(list(marks.glob("0-*"))) == 2  # launched twice
        assert "SIGABRT" in (tmp_path / "run.log.aborted").read_text()
    else:
        with pytest.raises(AssertionError, match="a Python error"):
            _launch.torchrun(2, script, str(marks), how, log=log, timeout=300)
        assert len(list(marks.glob("0-*"))) == 1  # not retried
