"""The write stage on the local executor: the next block is gathered while one is written, which changes no
byte, no order and no error; the kernels the plan and write call are loaded while the run stages."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packtools.pipeline.gather as gather
import packtools.pipeline.run as run
from packtools import pack_files
from packtools.errors import PackingError
from packtools.pipeline.executors import LocalExecutor, TwoSteps, run_jobs
from packtools.pipeline.planning import load_kernels_ahead

BLOCKS = 10


def digest(folder: str) -> dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(folder))
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """Tokenized rows over 3 row groups (parts), packed into :data:`BLOCKS` shards with ``shard_tokens=2000``."""
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 50_000, k).tolist() for k in rng.integers(1, 120, 300)]
    path = str(tmp_path_factory.mktemp("write") / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), path, row_group_size=100)
    return path


def pack(source: str, out: str) -> dict[str, str]:
    res = pack_files(source, out, 128, shard_tokens=2000, part_rows=100, shuffle=True)
    assert res.stats["shards"] == BLOCKS
    return digest(out)


def block_of(path: str) -> int:
    return int(os.path.basename(path).split("-of-")[0][-5:])


def sequential(job: gather.WriteJob) -> dict:
    return gather.save_block(job, gather.gather_block(job))


# -- the overlap itself --------------------------------------------------------------------------------
def test_two_steps_run_in_job_order_once_each_with_one_block_ahead():
    alive, most, seconds = [0], [0], []
    lock = threading.Lock()

    def first(job: int) -> int:
        time.sleep((job * 7 % 5) / 500)  # uneven, so a reordering would show
        with lock:
            alive[0] += 1
            most[0] = max(most[0], alive[0])
        return job * 10

    def second(job: int, made: int) -> int:
        time.sleep((job * 3 % 4) / 500)
        seconds.append(job)
        with lock:
            alive[0] -= 1
        return made + 1

    got = list(LocalExecutor().run(TwoSteps(first, second), list(range(9))))
    assert got == [(i, i * 10 + 1) for i in range(9)]
    assert seconds == list(range(9)) and most[0] <= 2


def test_a_failing_step_is_that_jobs_outcome_and_the_first_one_is_raised():
    def first(job: int) -> int:
        if job in (2, 4):
            raise ValueError(f"gather of block {job}")
        return job

    def second(job: int, made: int) -> int:
        if job == 3:
            raise OSError(errno.ENOSPC, "full", f"block-{job}")
        return made

    outcomes = dict(LocalExecutor().run(TwoSteps(first, second), list(range(6))))
    assert [outcomes[i] for i in (0, 1, 5)] == [0, 1, 5]
    assert str(outcomes[2]) == "gather of block 2" and str(outcomes[4]) == "gather of block 4"
    assert outcomes[3].filename == "block-3"
    with pytest.raises(ValueError, match="gather of block 2"):
        run_jobs(LocalExecutor(), TwoSteps(first, second), list(range(6)), "write", True, 2)


# -- in the pipeline -----------------------------------------------------------------------------------
def test_overlapped_write_is_byte_identical_to_one_block_at_a_time(source, tmp_path, monkeypatch):
    written: list[str] = []
    real = gather.write_shard

    def recording(path: str, table: pa.Table) -> None:
        written.append(os.path.basename(path).split(".tmp-")[0])
        real(path, table)

    monkeypatch.setattr(gather, "write_shard", recording)
    overlapped = pack(source, str(tmp_path / "overlapped"))
    assert written == sorted(set(written)) and len(written) == BLOCKS
    monkeypatch.setattr(run, "block_steps", lambda: sequential)
    assert pack(source, str(tmp_path / "sequential")) == overlapped


def test_a_failed_write_is_reported_naming_its_shard(source, tmp_path, monkeypatch):
    real_write, real_gather = gather.write_shard, gather.gather_block

    def full_at_block_1(path: str, table: pa.Table) -> None:
        if "-00001-of-" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real_write(path, table)

    def gathers_fail_from_block_2(job: gather.WriteJob) -> pa.Table:
        if block_of(job.path) >= 2:
            raise PackingError(f"gather failed for {os.path.basename(job.path)}")
        return real_gather(job)

    monkeypatch.setattr(gather, "write_shard", full_at_block_1)
    monkeypatch.setattr(run, "block_steps", lambda: TwoSteps(gathers_fail_from_block_2, gather.save_block))
    with pytest.raises(PackingError, match=r"no space left .*-00001-of-00010\.arrow\.tmp-"):
        pack(source, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == []


def test_a_failed_gather_is_reported_naming_its_shard(source, tmp_path, monkeypatch):
    real = gather.gather_block

    def failing_from_block_3(job: gather.WriteJob) -> pa.Table:
        if block_of(job.path) >= 3:
            raise PackingError(f"gather failed for {os.path.basename(job.path)}")
        return real(job)

    monkeypatch.setattr(run, "block_steps", lambda: TwoSteps(failing_from_block_3, gather.save_block))
    with pytest.raises(PackingError, match=r"gather failed for data-\w+-00003-of-00010\.arrow"):
        pack(source, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == []


# -- kernels loaded while the run stages ---------------------------------------------------------------
def test_the_kernels_loaded_ahead_are_all_the_plan_and_write_call(source, tmp_path):
    """In a fresh process: after the thread, a whole run (local executor) compiles or loads nothing new."""
    code = f"""
import sys
from packtools.pipeline.planning import load_kernels_ahead
load_kernels_ahead("bfd", ["int32"]).join()
assert "pandas" not in sys.modules  # pa.array imports it: 0.25 CPU seconds beside the run's engine load
from packtools.core import kernels
names = ("make_items", "bfd_assign", "plan_violation", "copy_all_segments")
before = {{k: set(getattr(kernels, k).signatures) for k in names}}
from packtools import pack_files
pack_files({source!r}, {str(tmp_path / "out")!r}, 128, shard_tokens=2000, part_rows=100)
after = {{k: set(getattr(kernels, k).signatures) for k in names}}
assert all(before[k] for k in names), before
assert after == before, {{k: after[k] - before[k] for k in names}}
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_loading_kernels_ahead_ignores_its_failures(capsys):
    load_kernels_ahead("no such strategy", ["int32"]).join()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("threshold", [0, 1 << 40])
def test_kernels_load_ahead_only_for_an_input_large_enough_to_hide_it(
    source, tmp_path, monkeypatch, threshold
):
    started = []
    monkeypatch.setattr(run, "KERNELS_AHEAD_MIN_BYTES", threshold)
    monkeypatch.setattr(run, "load_kernels_ahead", lambda *a: started.append(a) or load_kernels_ahead(*a))
    pack(source, str(tmp_path / "out"))
    assert len(started) == (1 if threshold == 0 else 0)
