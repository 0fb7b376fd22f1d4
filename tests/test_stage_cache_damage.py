"""Stage-cache entries are checked by content on adoption (issue 29: S2, T1, T2, U2, U3, L2): a damaged entry
is dropped and the part staged again, with a note, never packed as it is and never a traceback; an orphan
left by a kill during eviction is counted and evicted."""

from __future__ import annotations

import glob
import json
import os
import time
import zlib

import _stage_fixtures
import numpy as np
import pytest
from _pipeline_data import CORPUS

from packtools import pack_files
from packtools.pipeline import stage_cache
from packtools.pipeline.profile import profile_files

# The shared fixtures (tests/_stage_fixtures.py), named here for pytest to find.
tok, cache, data = _stage_fixtures.tok, _stage_fixtures.cache, _stage_fixtures.data


def _shards(out):
    names = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    return [open(os.path.join(out, n), "rb").read() for n in names]


def _flip_a_token_bit(arrow):
    import pyarrow as pa

    raw = bytearray(open(arrow, "rb").read())
    with pa.memory_map(arrow) as src:
        values = pa.ipc.open_file(src).get_batch(0).column(0).values
        first = int(values[0].as_py())
    needle = np.array([first], np.int32).tobytes()
    at = raw.index(needle, 8)
    raw[at] ^= 1
    open(arrow, "wb").write(bytes(raw))


def _cut(path):
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[: len(raw) // 2])


@pytest.mark.parametrize(
    "damage",
    [
        ("arrow", _flip_a_token_bit),  # S2: one bit of one token id
        ("arrow", _cut),  # U2
        ("arrow", lambda p: open(p, "wb").close()),  # T2: what a crash after an unsynced rename leaves
        ("npz", _cut),  # T1
    ],
    ids=["bit-flip", "cut-arrow", "empty-arrow", "cut-sidecar"],
)
def test_a_damaged_entry_is_staged_again_with_a_note(tok, cache, data, tmp_path, damage):
    suffix, do = damage
    fresh = pack_files(data, tmp_path / "fresh", 128, tokenizer=tok)  # the cache is empty yet
    profile_files(data, tok)
    (entry,) = glob.glob(os.path.join(cache, f"*.{suffix}"))
    do(entry)
    res = pack_files(data, tmp_path / "packed", 128, tokenizer=tok)
    assert res.timings["parts_from_stage_cache"] == 0
    assert any("damaged" in n and "staged again" in n for n in res.notes), res.notes
    assert _shards(res.out) == _shards(fresh.out)
    # the damaged entry left the cache; profile stages the part into it again, and pack takes that one
    assert profile_files(data, tok).profile.count == 300
    assert pack_files(data, tmp_path / "again", 128, tokenizer=tok).timings["parts_from_stage_cache"] == 1


@pytest.mark.parametrize("flip", [False, True])
def test_a_part_a_killed_run_left_is_checked_by_content_before_reuse(tok, data, tmp_path, flip):
    """A run's own staged parts were checked by size only before a rerun reused them: one flipped bit in a token
    id of a part a killed run left was packed as it was.  Their CRC-32, taken as they are written, finds it:
    the part is staged again and the output is the clean run's; an intact part is still reused."""
    from packtools.pipeline import workspace

    fresh = pack_files(data, tmp_path / "fresh", 128, tokenizer=tok)

    def killed(name):
        if name == "plan":
            raise KeyboardInterrupt  # as Ctrl-C: the finished parts are kept for the next run

    workspace.CHECKPOINT_OBSERVERS.append(killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            pack_files(data, tmp_path / "packed", 128, tokenizer=tok)
    finally:
        workspace.CHECKPOINT_OBSERVERS.remove(killed)
    (part,) = glob.glob(os.path.join(tmp_path, ".packed.packtools", "stage", "*.arrow"))
    if flip:
        _flip_a_token_bit(part)
    res = pack_files(data, tmp_path / "packed", 128, tokenizer=tok)
    assert res.timings["parts_reused"] == (0 if flip else 1)
    said = [n for n in res.notes if "interrupted run left was damaged (its data file is not the one" in n]
    assert len(said) == flip, res.notes
    assert _shards(res.out) == _shards(fresh.out)


def test_an_entry_swapped_with_another_is_not_adopted(tok, cache, data, tmp_path):
    """U3: an .arrow of another entry under this entry's name is caught by its checksum."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": CORPUS[i % 5]}) + "\n" for i in range(50)))
    profile_files(data, tok)
    profile_files(str(other), tok)
    a, b = sorted(glob.glob(os.path.join(cache, "*.arrow")))
    os.replace(a, b)  # b's name now holds a's data, and a's entry has none
    for src, name in ((data, "d"), (str(other), "o")):
        res = pack_files(src, tmp_path / name, 128, tokenizer=tok)
        os.environ[stage_cache.CACHE_ENV] = str(tmp_path / f"empty-{name}")  # (monkeypatch restores it)
        fresh = pack_files(src, tmp_path / (name + "-fresh"), 128, tokenizer=tok)
        os.environ[stage_cache.CACHE_ENV] = cache
        assert _shards(res.out) == _shards(fresh.out)


def test_an_orphan_data_file_is_counted_and_evicted(tok, cache, data):
    """L2: a kill during eviction (or between the data file's rename and its sidecar) leaves an .arrow alone."""
    profile_files(data, tok)
    (sidecar,) = glob.glob(os.path.join(cache, "*.npz"))
    os.unlink(sidecar)  # what the kill left
    (arrow,) = glob.glob(os.path.join(cache, "*.arrow"))
    size = os.path.getsize(arrow)
    assert stage_cache.evict(cache, budget=10**12) == (0, size)  # young: counted, kept
    old = time.time() - 2 * stage_cache.MIN_AGE_S
    os.utime(arrow, (old, old))
    assert stage_cache.evict(cache, budget=10**12) == (1, 0)
    assert not os.path.exists(arrow)


# -- where the caches live (L1, S3, T3, U5) ----------------------------------------------------------------
def test_no_home_folder_is_a_clear_error_never_a_folder_named_tilde(tok, data, tmp_path, monkeypatch):
    from packtools.errors import PackingError

    monkeypatch.delenv(stage_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("PACKTOOLS_CACHE_DIR", raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)  # HOME unset, no passwd entry
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PackingError, match=r"\$PACKTOOLS_STAGE_CACHE.*\$PACKTOOLS_CACHE_DIR"):
        profile_files(data, tok)
    res = pack_files(data, tmp_path / "packed", 128, tokenizer=tok)  # pack needs no cache
    assert res.stats["rows_in"] == 300
    assert not os.path.exists(tmp_path / "~")


def test_an_unwritable_cache_is_left_out_saying_so(tok, data, cache, monkeypatch):
    """T3/U5: a read-only or full cache folder: the profile goes on in a temporary folder, with a note."""
    import errno

    def refuse(folder):
        raise OSError(errno.EROFS, "Read-only file system", folder)

    monkeypatch.setattr(stage_cache, "prepare", refuse)
    res = profile_files(data, tok)
    assert res.profile.count == 300 and not res.stage["kept"]
    assert any("cannot be written" in n and "PACKTOOLS_STAGE_CACHE" in n for n in res.notes)
    assert "cannot be written" in res.to_text()


def test_a_stage_cache_inside_the_input_folder_is_not_read_as_input(tmp_path, monkeypatch):
    """S3: the cache's staged files are tokenized Arrow files; its CACHEDIR.TAG keeps them out of the input."""
    folder = tmp_path / "tdata"
    folder.mkdir()
    with open(folder / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(100))
    monkeypatch.setenv(stage_cache.CACHE_ENV, str(folder / "cache"))
    profile_files(str(folder))  # tokenized JSON lines are staged (a tokenizer would be refused: unused)
    assert os.path.exists(folder / "cache" / "CACHEDIR.TAG")
    res = pack_files(str(folder), tmp_path / "out", 64)
    assert res.stats["rows_in"] == 100
    assert any("cache folder" in n for n in res.notes)


def test_a_sidecar_is_flushed_to_disk_before_the_rename_that_trusts_it(tmp_path, monkeypatch):
    """F7: a machine crash must not leave a renamed sidecar whose data never reached the disk."""
    from packtools.pipeline import staged

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    staged.save_sidecar(str(tmp_path / "s.npz"), np.zeros(1, np.int64), np.zeros(0, np.int64), "x")
    assert events[:2] == ["fsync", "replace"] and events[-1] == "fsync"  # the file, the rename, the folder


# -- staged.damage itself ------------------------------------------------------------------------------------
def test_damage_opens_the_sidecar_once_and_names_each_reason(tmp_path, monkeypatch):
    """``staged.damage`` reads everything from one open of the sidecar (it was opened four times), and every
    reason it gives still comes out; the sidecar readers pipeline code calls with a path see the same."""
    import hashlib

    from packtools.pipeline import staged

    data, side = tmp_path / "p.arrow", str(tmp_path / "p.npz")
    data.write_bytes(b"tokens")
    digest = hashlib.sha256(b"tokens").hexdigest()

    def write(**arrays):
        staged.save_sidecar(
            side, np.array([3, 2]), np.array([1, 0]), str(data), data_sha256=digest, data_size=6, **arrays
        )

    opened, load = [], np.load
    monkeypatch.setattr(np, "load", lambda path, **kw: opened.append(path) or load(path, **kw))

    def damage():
        opened.clear()
        why = staged.damage(side)
        assert opened == [side]
        return why

    write(trained=np.array([2, 1]), heads=np.array([1, 1]), report={"engine": "fast"})
    assert damage() is None
    with np.load(side, allow_pickle=False) as z:  # a path or the open sidecar: the same values
        for read in (
            staged.load_sidecar,
            staged.sidecar_checksum,
            staged.sidecar_report,
            staged.sidecar_turns,
        ):
            assert repr(read(z)) == repr(read(side))
    assert staged.load_sidecar(side)[0].tolist() == [3, 2] and staged.sidecar_report(side) == {
        "engine": "fast"
    }
    write(trained=np.array([2]))
    assert damage() == "its trained tokens do not match its rows (1 for 2 rows)"
    write(heads=np.array([1, 1, 1]))
    assert damage() == "its heads do not match its rows (3 for 2 rows)"
    write()
    assert damage() is None  # no labels and no heads: empty arrays, as tokenized input has
    data.write_bytes(b"tokenz")
    assert damage() == "its data file is not the one it was written with (checksum differs)"
    staged.save_sidecar(side, np.array([3, 2]), np.array([1, 0]), str(data), data_size=6, data_crc32=0)
    assert damage() == "its data file is not the one it was written with (CRC-32 differs)"
    crc = zlib.crc32(b"tokenz")
    staged.save_sidecar(side, np.array([3, 2]), np.array([1, 0]), str(data), data_size=6, data_crc32=crc)
    assert damage() is None
    write()
    data.write_bytes(b"token")
    assert damage() == "its data file is cut or not the one it was written with (size differs)"
    data.unlink()
    assert damage() == "its data file is missing"
    blob = open(side, "rb").read()
    open(side, "wb").write(blob[: len(blob) // 2])
    assert damage() == "its sidecar cannot be read (BadZipFile)"
