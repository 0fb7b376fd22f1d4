"""Stage-cache entries are checked by content on adoption (issue 29: S2, T1, T2, U2, U3, L2): a damaged entry
is dropped and the part staged again, with a note, never packed as it is and never a traceback; an orphan
left by a kill during eviction is counted and evicted."""

from __future__ import annotations

import glob
import json
import os
import time

import numpy as np
import pytest
from _pipeline_data import CORPUS, build_tokenizer

from packtools import pack_files
from packtools.pipeline import stage_cache
from packtools.pipeline.profile import profile_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = str(tmp_path / "stage-cache")
    monkeypatch.setenv(stage_cache.CACHE_ENV, folder)
    return folder


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"text": f"{CORPUS[i % 5]} {i}"}) + "\n" for i in range(300))
    return str(path)


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
