"""U-0 (adversarial 2026-12c): a stage-cache entry read in place (the cache on another file system, where no
hard link can be made) and evicted while ``pack`` runs ended the run with a bare ``[Errno 2]``.  The run now
restages a part whose entry is gone before it reads it (with a note), marks the entries it still reads as used,
and a file that vanishes later is said to be the stage cache's, with what to do."""

from __future__ import annotations

import errno
import json
import os

import _stage_fixtures
import numpy as np
import pytest
from _pipeline_data import CORPUS

from packtools import pack_files
from packtools.errors import PackingError
from packtools.pipeline import run as run_module
from packtools.pipeline import stage_cache
from packtools.pipeline.profile import profile_files

# The shared fixture (tests/_stage_fixtures.py), named here for pytest to find.
tok = _stage_fixtures.tok


@pytest.fixture
def in_place_cache(tmp_path, monkeypatch):
    """A stage cache that pack must read in place: hard links fail as across file systems."""
    folder = str(tmp_path / "stage-cache")
    monkeypatch.setenv(stage_cache.CACHE_ENV, folder)

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)

    monkeypatch.setattr(stage_cache.os, "link", no_link)
    return folder


def _data(tmp_path) -> str:
    rng = np.random.default_rng(0)
    words = " ".join(CORPUS).split()
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 12))}) + "\n" for _ in range(200)))
    return str(path)


def _evict_after_staging(monkeypatch, folder):
    """Another profile trims the cache once the running pack has staged (adopted) its parts."""
    run_jobs, done = run_module.run_jobs, []

    def stage_then_evict(ex, fn, jobs, desc, *args, **kwargs):
        out = run_jobs(ex, fn, jobs, desc, *args, **kwargs)
        if desc == "stage" and not done:
            done.append(True)
            in_place = [s["data"] for s in out if os.path.dirname(s["data"]) == folder]
            assert in_place, "the run read no stage-cache entry in place: the test tests nothing"
            for path in in_place:
                os.remove(path)
        return out

    monkeypatch.setattr(run_module, "run_jobs", stage_then_evict)


def test_an_entry_evicted_mid_run_is_tokenized_again(tmp_path, tok, in_place_cache, monkeypatch):
    data = _data(tmp_path)
    profile_files(data, tok)  # stages into the cache
    _evict_after_staging(monkeypatch, in_place_cache)
    res = pack_files(data, str(tmp_path / "out"), 64, tokenizer=tok)
    assert any("were removed from the cache meanwhile" in n and "tokenized again" in n for n in res.notes)
    monkeypatch.undo()
    want = pack_files(data, str(tmp_path / "fresh"), 64, tokenizer=tok)  # no cache involved
    import datasets

    assert datasets.load_from_disk(res.out)["input_ids"] == datasets.load_from_disk(want.out)["input_ids"]


def test_an_entry_that_vanishes_while_read_is_named(tmp_path):
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", os.path.join(cache, "k.arrow"))
    said = stage_cache.evicted_error(gone, cache)
    assert isinstance(said, PackingError)
    assert "stage cache entry" in str(said) and "Run the same command again" in str(said)
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "input.jsonl"))
    assert stage_cache.evicted_error(other, cache) is None
    assert stage_cache.keep_in_place([os.path.join(cache, "k.arrow"), str(tmp_path / "x.arrow")], cache) == [
        0
    ]
