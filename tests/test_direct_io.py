"""Files written past the page cache (``packtools.io.direct``) hold exactly the bytes written, whichever way they
reach the disk; a staged part is read back into the page cache ahead of the gather (``io.pages.read_ahead``); the
gather's blocks reuse a run's buffers (``pipeline.gather.BlockBuffers``) without changing a byte."""

from __future__ import annotations

import errno
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packtools.io.direct as direct
import packtools.io.pages as pages
import packtools.pipeline.gather as gather
from packtools import pack_files
from packtools.io.direct import ALIGN, DIRECT_ENV, DirectFile, arrow_sink
from packtools.io.pages import read_ahead

CHUNK = 4 * ALIGN  # small, so that a few KB cross several chunk boundaries


def _written(path: str, pieces: list[bytes], chunk: int = CHUNK) -> DirectFile:
    f = DirectFile(path, chunk)
    for piece in pieces:
        assert f.write(piece) == len(piece)
    assert f.tell() == sum(map(len, pieces))
    f.close()
    return f


def _open_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as fh:
        return next(int(line.split()[1], 8) for line in fh if line.startswith("flags:"))


def _direct_taken(folder) -> bool:
    """Whether the file system of ``folder`` takes O_DIRECT (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, is_direct = direct._open_direct(str(folder / "probe"))
    os.close(fd)
    os.unlink(folder / "probe")
    return is_direct


SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + ALIGN // 2]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("plain", [False, True], ids=["direct-if-taken", "plain"])
def test_the_file_holds_exactly_the_bytes_written(tmp_path, monkeypatch, size, plain):
    if plain:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = str(tmp_path / "f")
    f = _written(path, [data[: size // 3], data[size // 3 :]])
    assert open(path, "rb").read() == data and os.path.getsize(path) == size
    assert f.direct == (not plain and _direct_taken(tmp_path))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=3 * CHUNK), max_size=6))
def test_any_sequence_of_writes_gives_their_concatenation(tmp_path_factory, pieces):
    path = str(tmp_path_factory.mktemp("direct") / "f")
    f = DirectFile(path, CHUNK)
    for i, piece in enumerate(pieces):
        f.write(memoryview(piece))
        assert f.tell() == sum(map(len, pieces[: i + 1]))
    f.close()
    assert open(path, "rb").read() == b"".join(pieces)


def test_the_file_is_written_with_o_direct_where_the_file_system_takes_it(tmp_path):
    if not _direct_taken(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (the plain path is tested above)")
    f = DirectFile(str(tmp_path / "f"), CHUNK)
    assert f.direct and _open_flags(f._fd) & os.O_DIRECT
    f.write(b"x" * (CHUNK + 5))
    f.close()
    # written past the page cache: a read that may not wait for the disk finds nothing cached
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            os.preadv(fd, [bytearray(ALIGN)], 0, os.RWF_NOWAIT)
    finally:
        os.close(fd)


def test_direct_writes_can_be_turned_off(tmp_path, monkeypatch):
    """``PACKTOOLS_DIRECT_IO=0``: the file goes through the page cache (a read that may not wait finds it), the
    same bytes; negative control: unset, the same file is written past the cache where that is taken."""
    if not _direct_taken(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (the plain path is tested above)")
    data = b"y" * (CHUNK + 5)
    monkeypatch.setenv(DIRECT_ENV, "0")
    with DirectFile(str(tmp_path / "plain"), CHUNK) as f:
        assert not f.direct and not _open_flags(f._fd) & os.O_DIRECT
        f.write(data)
    fd = os.open(tmp_path / "plain", os.O_RDONLY)
    try:
        assert os.preadv(fd, [bytearray(ALIGN)], 0, os.RWF_NOWAIT) == ALIGN
    finally:
        os.close(fd)
    assert open(tmp_path / "plain", "rb").read() == data
    monkeypatch.delenv(DIRECT_ENV)
    with DirectFile(str(tmp_path / "direct"), CHUNK) as f:
        assert f.direct
        f.write(data)
    assert open(tmp_path / "direct", "rb").read() == data


def test_a_direct_write_the_file_system_refuses_goes_on_plainly(tmp_path, monkeypatch):
    if not _direct_taken(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real, refused = os.write, []

    def write(fd, data):
        if not refused and _open_flags(fd) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "block size")
        return real(fd, data)

    monkeypatch.setattr(direct.os, "write", write)
    data = bytes(range(256)) * (3 * CHUNK // 256 + 7)
    f = _written(str(tmp_path / "f"), [data])
    assert refused and not f.direct
    assert open(tmp_path / "f", "rb").read() == data


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_that_refuses_o_direct_at_open_gets_plain_writes(tmp_path, monkeypatch, code):
    """The open with ``O_DIRECT`` refused by either errno a file system uses for it: the file is opened again
    without it and holds the same bytes; negative control: another errno from that open is raised."""
    monkeypatch.delenv(DIRECT_ENV, raising=False)
    real_open, tried = os.open, []

    def refusing(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            tried.append(path)
            raise OSError(code, "O_DIRECT not supported", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(direct.os, "open", refusing)
    data = bytes(range(256)) * (CHUNK // 256 + 3)
    f = _written(str(tmp_path / "f"), [data])
    assert tried and not f.direct
    assert open(tmp_path / "f", "rb").read() == data

    def failing(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EACCES, "permission denied", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(direct.os, "open", failing)
    with pytest.raises(PermissionError):
        DirectFile(str(tmp_path / "g"), CHUNK)


def test_another_error_is_raised(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "no space left", "f")

    monkeypatch.setattr(direct.os, "write", full)
    f = DirectFile(str(tmp_path / "f"), CHUNK)
    with pytest.raises(OSError, match="no space"):
        f.write(b"x" * CHUNK)
    f.close()  # closes the descriptor


def test_a_chunk_that_is_not_aligned_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of"):
        DirectFile(str(tmp_path / "f"), ALIGN + 1)


@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_arrow_writes_through_it_the_bytes_it_writes_to_a_plain_file(tmp_path, fmt):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 3000, 400)
    values = rng.integers(0, 128_256, int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, values)})
    new = pa.ipc.new_stream if fmt == "stream" else pa.ipc.new_file
    for path, sink in (
        (tmp_path / "direct", arrow_sink(str(tmp_path / "direct"))),
        (tmp_path / "plain", None),
    ):
        with sink or pa.OSFile(str(path), "wb") as out, new(out, table.schema) as writer:
            writer.write_table(table.slice(0, 150))
            writer.write_table(table.slice(150))
    assert open(tmp_path / "direct", "rb").read() == open(tmp_path / "plain", "rb").read()


# -- read back ahead ---------------------------------------------------------------------------------------
def test_read_ahead_brings_a_file_written_past_the_cache_into_it(tmp_path):
    if not _direct_taken(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: its files are cached when written")
    data = os.urandom(3 * CHUNK)
    _written(str(tmp_path / "f"), [data])
    thread = read_ahead(str(tmp_path / "f"))
    assert thread is not None
    thread.join()
    buf = bytearray(len(data))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert os.preadv(fd, [buf], 0, os.RWF_NOWAIT) == len(data)  # cached: no wait for the disk
    finally:
        os.close(fd)
    assert bytes(buf) == data


@pytest.mark.parametrize("name", ["missing", "empty"])
def test_read_ahead_of_a_missing_or_empty_file_does_nothing(tmp_path, name):
    if name == "empty":
        open(tmp_path / name, "wb").close()
    pages._populate(str(tmp_path / name))  # the thread's work, here: an error would fail this test
    thread = read_ahead(str(tmp_path / name))
    assert thread is not None
    thread.join()


# -- the gather's buffers --------------------------------------------------------------------------------
def test_block_buffers_keep_at_most_two_sets_and_a_copy_starts_empty():
    buffers = gather.BlockBuffers()
    sets = [buffers.take() for _ in range(3)]
    assert all(s == {} for s in sets) and len({id(s) for s in sets}) == 3
    for s in sets:
        buffers.give(s)
    assert {id(buffers.take()), id(buffers.take())} == {id(sets[0]), id(sets[1])}
    buffers.give(sets[0])
    assert pickle.loads(pickle.dumps(buffers)).take() == {}
    steps = pickle.loads(pickle.dumps(gather.block_steps()))  # picklable, for the pool and Ray executors
    assert steps.first.keywords["buffers"].take() == {}


def _shards(folder) -> list[bytes]:
    return [open(folder / n, "rb").read() for n in sorted(os.listdir(folder)) if n.endswith(".arrow")]


def test_blocks_are_gathered_into_the_buffers_of_written_blocks(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 50_000, k).tolist() for k in rng.integers(1, 120, 400)]
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), src, row_group_size=100)
    into_earlier: list[bool] = []
    real = gather.gather_block

    def recording(job, scratch=None):
        held = dict(scratch) if scratch else {}
        table = real(job, scratch)
        values = np.asarray(table.column("input_ids").chunk(0).values)
        into_earlier.append(bool(held) and np.shares_memory(values, held["input_ids"]))
        return table

    monkeypatch.setattr(gather, "gather_block", recording)
    blocks = pack_files(src, str(tmp_path / "reused"), 128, shard_tokens=2000, part_rows=100).stats["shards"]
    assert blocks >= 6 and len(into_earlier) == blocks
    assert into_earlier[:2] == [False, False]  # the first two blocks take new buffers, later ones reuse them
    assert sum(into_earlier) >= (blocks - 2) // 2, into_earlier
    monkeypatch.setattr(gather, "BlockBuffers", lambda: None)  # every block into fresh memory, as before
    pack_files(src, str(tmp_path / "fresh"), 128, shard_tokens=2000, part_rows=100)
    assert _shards(tmp_path / "reused") == _shards(tmp_path / "fresh")
