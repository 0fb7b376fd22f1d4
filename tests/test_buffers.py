"""packtools.core.buffers: the gather's output buffers are not in memory NumPy advised for huge pages."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pyarrow as pa
import pytest

from packtools.core import buffers
from packtools.core.pack import pack_table

linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="/proc/self/smaps is Linux's")


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_small_buffers_are_numpys() -> None:
    a = buffers.empty(10, np.int32)
    assert a.shape == (10,) and a.dtype == np.int32 and a.flags.writeable and a.base is None


def test_large_buffer_is_a_writable_mapping_of_its_own() -> None:
    n = buffers.MIN_BYTES // 4 + 3
    a = buffers.empty(n, "int32")
    assert a.shape == (n,) and a.dtype == np.int32 and a.flags.writeable and a.flags.c_contiguous
    assert isinstance(a.base.obj, mmap.mmap) and a.ctypes.data % mmap.PAGESIZE == 0
    a[:] = np.arange(n, dtype=np.int32)
    assert int(a[-1]) == n - 1
    # zero-copy into Arrow and back, as the gather's list columns are made
    assert pa.array(a[:5]).to_pylist() == [0, 1, 2, 3, 4]


@linux
def test_large_buffer_is_not_advised_for_huge_pages() -> None:
    nbytes = 2 * buffers.MIN_BYTES
    ours = buffers.empty(nbytes, np.uint8)
    assert "hg" not in vm_flags(ours.ctypes.data + nbytes // 2)
    numpys = np.empty(nbytes, np.uint8)  # the allocation the gather made before
    if "hg" not in vm_flags(numpys.ctypes.data + nbytes // 2):
        pytest.skip("NumPy gives no huge page advice here (NUMPY_MADVISE_HUGEPAGE=0, or no THP)")


@linux
def test_pack_table_gathers_into_such_a_buffer() -> None:
    rows = 4096
    lengths = np.full(rows, 600, np.int64)
    values = np.arange(int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    packed = pack_table(table, 2048)
    out = packed.column("input_ids").chunk(0).values
    assert out.nbytes >= buffers.MIN_BYTES
    assert sorted(np.asarray(out).tolist()) == values.tolist()  # every token, once
    assert "hg" not in vm_flags(out.buffers()[1].address + out.nbytes // 2)


def _values_sum(table: pa.Table) -> int:
    return int(np.asarray(table.column("input_ids").combine_chunks().values).sum())


def test_packed_tables_outlive_their_gather_and_each_other() -> None:
    """The mapped buffers live as long as any Arrow table, slice or NumPy view of them: tables packed, every
    other one dropped (a slice or a view of some kept), the memory collected and reused, and what is left reads
    the same values, also pickled and through a worker process and back."""
    import gc
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    from packtools.core.pack import unpack

    rng = np.random.default_rng(0)
    tables, sums, slices, views = [], [], [], []
    for i in range(6):  # kept: 0, 2, 4; dropped: 1 (a slice of it kept), 3 (a NumPy view of it kept), 5 (all)
        lengths = rng.integers(1, 700, 3000)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        values = rng.integers(0, 1 << 40, int(offsets[-1]))
        packed = pack_table(
            pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))}), 4096
        )
        assert packed.column("input_ids").chunk(0).values.nbytes >= buffers.MIN_BYTES  # a mapping's
        tables.append(packed)
        sums.append(int(values.sum()))
        if i == 1:
            slices.append((packed.slice(3, 5), packed.slice(3, 5).to_pylist()))
        if i == 3:
            views.append(np.asarray(packed.column("input_ids").chunk(0).values)[-1000:])
    expected_views = [v.copy() for v in views]
    kept, kept_sums = tables[::2], sums[::2]
    del tables, packed
    gc.collect()
    reused = [np.full(1 << 20, -1, np.int64) for _ in range(40)]  # the freed memory, written over
    assert all(_values_sum(t) == s for t, s in zip(kept, kept_sums))
    assert all(s.to_pylist() == rows for s, rows in slices)
    assert all(np.array_equal(v, e) for v, e in zip(views, expected_views))
    assert [_values_sum(pickle.loads(pickle.dumps(t))) for t in kept] == kept_sums
    with ProcessPoolExecutor(1) as pool:
        assert list(pool.map(_values_sum, kept)) == kept_sums
    flat = unpack(kept.pop())  # unpacked into a mapping too, the packed table gone
    gc.collect()
    assert _values_sum(flat) == kept_sums[-1] and reused[-1][0] == -1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_process_writes_its_own_copy() -> None:
    """The buffer behaves as malloc's memory across a fork: a child's writes stay the child's (a shared mapping, Python's
    default for ``mmap.mmap(-1, n)``, would hand them to the parent)."""
    a = buffers.empty(buffers.MIN_BYTES, np.uint8)
    a[:] = 1
    pid = os.fork()
    if pid == 0:  # the child
        a[:] = 2
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert int(a.min()) == 1 and int(a.max()) == 1


@linux
def test_large_buffer_is_private_memory() -> None:
    a = buffers.empty(2 * buffers.MIN_BYTES, np.uint8)
    flags = vm_flags(a.ctypes.data + a.nbytes // 2)
    assert "sh" not in flags and "mr" in flags and "mw" in flags


@linux
@pytest.mark.parametrize("share_prompt", [False, True])
def test_pack_pairs_gathers_into_such_a_buffer(share_prompt) -> None:
    from packtools.core.pairs import pack_pairs

    n = 4096
    prompt = np.arange(n * 300, dtype=np.int32).reshape(n, 300)
    table = pa.table(
        {
            "prompt_ids": prompt.tolist(),
            "chosen_ids": np.full((n, 200), 7, np.int32).tolist(),
            "rejected_ids": np.full((n, 200), 9, np.int32).tolist(),
        }
    )
    rows, _ = pack_pairs(table, 4096, share_prompt=share_prompt)
    assert rows.column("input_ids").num_chunks == 1
    out = rows.column("input_ids").chunk(0).values
    assert out.nbytes >= buffers.MIN_BYTES
    assert "hg" not in vm_flags(out.buffers()[1].address + out.nbytes // 2)
