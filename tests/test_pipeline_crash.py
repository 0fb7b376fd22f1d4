"""Crash safety of ``packtools pack`` with real signals on a subprocess.

The run is stopped at a chosen point by a test-only wrapper (``tests/_paused_run.py``, an observer of the run's
checkpoints; production code has no pause hook): it waits there until it gets the signal.  After SIGKILL the output is absent (or the previous output whole), a rerun
removes what the dead run left, reuses its finished parts and writes the same bytes as a run never
interrupted; SIGTERM / Ctrl-C clean up, print one line and exit 143 / 130; a second run into an ``--out`` that
a live run holds refuses, naming its pid.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools.pipeline.workspace import MARKER

pytestmark = pytest.mark.slow  # kills and restarts processes; in .ci/run, not in the README's quick command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAUSED = os.path.join(ROOT, "tests", "_paused_run.py")


def digest(folder: str) -> dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(folder))
    }


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tokenized parquet file of 4 parts (1000 rows each), the command and the uninterrupted output."""
    root = tmp_path_factory.mktemp("crash")
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, k).tolist() for k in rng.integers(1, 300, 4000)]
    src = str(root / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), src, row_group_size=500)
    cmd = [sys.executable, "-m", "packtools.cli", "pack", src, "--max-length", "512", "--part-rows", "1000"]
    cmd += ["--shard-tokens", "50000"]
    ref = str(root / "ref")
    subprocess.run([*cmd, "--out", ref, "--quiet"], env=env(), check=True, capture_output=True)
    return cmd, digest(ref)


def start_paused(cmd: list[str], out: str, point: str, log: str) -> subprocess.Popen:
    """Start ``cmd --out out`` and return once it waits at checkpoint ``point``."""
    assert cmd[1:3] == ["-m", "packtools.cli"]
    proc = subprocess.Popen(
        [cmd[0], PAUSED, log, point, *cmd[3:], "--out", out, "--quiet"],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (os.path.exists(log) and point in open(log).read().split()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the run never reached {point}"
        time.sleep(0.05)
    return proc


def rerun(cmd: list[str], out: str) -> str:
    done = subprocess.run([*cmd, "--out", out], env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "point",
    [
        "stage:2",
        pytest.param("plan", marks=pytest.mark.slow),
        pytest.param("write:2", marks=pytest.mark.slow),
        pytest.param("install", marks=pytest.mark.slow),
    ],
)
def test_sigkill_then_rerun_is_byte_identical(data, tmp_path, point):
    cmd, want = data
    out = str(tmp_path / "out")
    proc = start_paused(cmd, out, point, str(tmp_path / "log"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(out)  # nothing half-written where the output goes
    assert ".out.packtools" in os.listdir(tmp_path)  # what the dead run left
    summary = rerun(cmd, out)
    if point != "stage:2":
        assert "4 reused from an interrupted run" in summary
    else:
        assert "2 reused from an interrupted run" in summary
    assert digest(out) == want
    assert sorted(os.listdir(tmp_path)) == ["log", "out"]  # the rerun removed the dead run's leftovers


@pytest.mark.slow
def test_sigkill_while_replacing_keeps_the_previous_output(data, tmp_path):
    cmd, want = data
    out = str(tmp_path / "out")
    subprocess.run([*cmd, "--out", out, "--shuffle", "--quiet"], env=env(), check=True, capture_output=True)
    before = digest(out)
    proc = start_paused(cmd, out, "rename", str(tmp_path / "log"))  # old output moved aside, new not yet in
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = start_paused(
        cmd, out, "locked", str(tmp_path / "log2")
    )  # the next run puts the old one back first
    assert digest(out) == before
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rerun(cmd, out)
    assert digest(out) == want


@pytest.mark.parametrize(
    "sig, status, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]
)
def test_sigterm_and_ctrl_c_clean_up_with_one_line(data, tmp_path, sig, status, name):
    cmd, want = data
    out = str(tmp_path / "out")
    proc = start_paused(cmd, out, "write:1", str(tmp_path / "log"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"interrupted by {name}; no output was written; 4 finished part(s) kept" in err
    assert not os.path.exists(out) and not os.path.exists(str(tmp_path / ".out.packtools.lock"))
    assert sorted(os.listdir(tmp_path / ".out.packtools")) == [MARKER, "stage"]  # finished parts only
    assert "4 reused" in rerun(cmd, out)
    assert digest(out) == want and sorted(os.listdir(tmp_path)) == ["log", "out"]


def test_a_second_run_into_a_held_out_refuses_naming_the_pid(data, tmp_path):
    cmd, _ = data
    out = str(tmp_path / "out")
    proc = start_paused(cmd, out, "stage:1", str(tmp_path / "log"))
    try:
        other = subprocess.run([*cmd, "--out", out], env=env(), capture_output=True, text=True)
        assert other.returncode == 1
        assert f"being written by another packtools run (pid {proc.pid} on host" in other.stderr
        assert other.stderr.count("\n") == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rerun(cmd, out)  # the lock of the dead run is taken over


@pytest.mark.parametrize("replacing", [True, False])
def test_sigkill_during_cleanup_after_install_is_tidied_by_the_cached_rerun(data, tmp_path, replacing):
    """L1: killed after the new output was installed, while the old output / work folder is being removed: the
    rerun is a cache hit, and still removes what the dead run left (the lock and the work folder)."""
    cmd, want = data
    out = str(tmp_path / "out")
    if replacing:
        subprocess.run(
            [*cmd, "--out", out, "--shuffle", "--quiet"], env=env(), check=True, capture_output=True
        )
    proc = start_paused(cmd, out, "installed", str(tmp_path / "log"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert digest(out) == want  # the new output is in place
    left = sorted(os.listdir(tmp_path))
    assert ".out.packtools" in left and ".out.packtools.lock" in left  # what the dead run left
    if replacing:
        assert os.path.isdir(tmp_path / ".out.packtools" / "old")
    assert "cached" in rerun(cmd, out)
    assert digest(out) == want
    assert sorted(os.listdir(tmp_path)) == ["log", "out"]


def _children(pid: int) -> set[int]:
    kids = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as fh:
            kids.update(int(k) for k in fh.read().split())
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process tree from /proc")
def test_pool_workers_die_with_a_sigkilled_driver(data, tmp_path):
    """L3: the OOM killer's SIGKILL of the driver must not leave the pool's workers blocked forever (holding
    the caller's pipes): they notice their parent is gone and exit."""
    cmd, _ = data
    out = str(tmp_path / "out")
    proc = start_paused([*cmd, "--executor", "pool", "--workers", "2"], out, "stage:1", str(tmp_path / "log"))
    try:
        workers = _children(proc.pid)
        assert len(workers) >= 2  # the two workers (and the resource tracker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [w for w in workers if _alive(w)]
    for w in alive:  # do not leak them from the test either
        os.kill(w, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their driver"


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """Text input (tokenized by the run, so the manifest carries the tokenizer engine's report) in 4 parts."""
    from _pipeline_data import build_tokenizer

    root = tmp_path_factory.mktemp("crash-text")
    tok = build_tokenizer(str(root / "tok"))
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "hello", "world", "packing", "tokens"]
    src = str(root / "in.parquet")
    texts = [" ".join(rng.choice(words, k)) for k in rng.integers(1, 40, 600)]
    pq.write_table(pa.table({"text": texts}), src, row_group_size=200)
    cmd = [sys.executable, "-m", "packtools.cli", "pack", src, "--max-length", "256", "--part-rows", "200"]
    cmd += ["--tokenizer", tok]
    ref = str(root / "ref")
    subprocess.run([*cmd, "--out", ref, "--quiet"], env=env(), check=True, capture_output=True)
    return cmd, digest(ref)


@pytest.mark.parametrize("point", ["stage:2"])
def test_the_manifest_after_a_kill_and_rerun_is_byte_identical(text_data, tmp_path, point):
    """U13: reused parts keep their tokenizer engine report, and the manifest holds nothing that depends on
    which process tokenized what, so every file of the output (manifest.json included) equals a clean run's."""
    cmd, want = text_data
    out = str(tmp_path / "out")
    proc = start_paused(cmd, out, point, str(tmp_path / "log"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert "reused from an interrupted run" in rerun(cmd, out)
    got = digest(out)
    assert got["manifest.json"] == want["manifest.json"], open(os.path.join(out, "manifest.json")).read()
    assert got == want
