"""An input rewritten with its old size and mtime put back (``cp -p``, ``rsync -a``, ``tar x``, ``touch -d``
after a same-size fix: a corrected digit, a swapped chosen/rejected pair) is new data.  Inputs were fingerprinted
by path, size and mtime alone, so such a file kept the old output (``cached``) and ``pack`` adopted the stage-cache
parts ``profile`` had tokenized from the old content: training on rows that are no longer in the file, without a
word (session 53's walk).  The inode and ctime are in the fingerprint now: the kernel sets ctime on every write and
``utime``, and a file moved into place has another inode."""

from __future__ import annotations

import json
import os
import time

import _stage_fixtures
import datasets
import pytest

from packtools import pack_files
from packtools.pipeline import stage_cache
from packtools.pipeline.profile import profile_files

# The shared fixtures (tests/_stage_fixtures.py), named here for pytest to find.
tok, cache = _stage_fixtures.tok, _stage_fixtures.cache


def _write(path, rows):
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def _rewrite_keeping_size_and_mtime(path, rows, how):
    """``path`` holds ``rows`` afterwards, with the size and mtime it had: in place (``cp -p``) or through a
    file renamed over it (``rsync -a``, ``tar x``)."""
    st = os.stat(path)
    target = path + ".new" if how == "renamed" else path
    _write(target, rows)
    assert os.path.getsize(target) == st.st_size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    for _ in range(500):  # a kernel with coarse timestamps (no multigrain ctime) ticks every few ms: the
        if how == "renamed" or os.stat(target).st_ctime_ns != st.st_ctime_ns:  # rewrite must land after one
            break
        time.sleep(0.01)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # (sets ctime to now, as the rewrite did)
    if how == "renamed":
        os.replace(target, path)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _ids(out):
    """The packed sequences of ``out``, sorted."""
    seqs = []
    for row in datasets.load_from_disk(str(out)):
        at = 0
        for n in row["seq_lengths"]:
            seqs.append(tuple(row["input_ids"][at : at + n]))
            at += n
    return sorted(seqs)


@pytest.mark.parametrize("how", ["in-place", "renamed"])
def test_a_rewritten_input_with_its_old_size_and_mtime_is_packed_again(tmp_path, how):
    src, out = str(tmp_path / "data.jsonl"), tmp_path / "out"
    _write(src, [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    first = pack_files(src, out, max_length=8)
    assert _ids(first.out) == [(1, 2, 3), (4, 5)]
    _rewrite_keeping_size_and_mtime(src, [{"input_ids": [1, 2, 7]}, {"input_ids": [4, 5]}], how)
    res = pack_files(src, out, max_length=8)
    assert not res.cached  # was: cached, and the output kept token 3 where the file now holds 7
    assert _ids(res.out) == [(1, 2, 7), (4, 5)]
    assert pack_files(src, out, max_length=8).cached  # nothing changed since: still a hit


def test_profile_parts_of_the_old_content_are_not_adopted(tok, cache, tmp_path):
    src = str(tmp_path / "prefs.jsonl")
    rows = [{"text": f"the answer to question {i} is A"} for i in range(40)]
    _write(src, rows)
    profile_files(src, tok)  # stages the part into the stage cache, for a following pack
    assert pack_files(src, tmp_path / "hit", 64, tokenizer=tok).timings["parts_from_stage_cache"] == 1
    fixed = [{"text": r["text"][:-1] + "B"} for r in rows]
    _rewrite_keeping_size_and_mtime(src, fixed, "in-place")
    res = pack_files(src, tmp_path / "packed", 64, tokenizer=tok)
    assert res.timings["parts_from_stage_cache"] == 0  # was 1: the old content's tokens, adopted
    os.environ[stage_cache.CACHE_ENV] = str(
        tmp_path / "empty"
    )  # a fresh tokenization (monkeypatch restores it)
    fresh = pack_files(src, tmp_path / "fresh", 64, tokenizer=tok)
    os.environ[stage_cache.CACHE_ENV] = cache
    assert _ids(res.out) == _ids(fresh.out)
    assert _ids(res.out) != _ids(tmp_path / "hit")


@pytest.mark.parametrize("how", ["in-place", "renamed"])
def test_an_input_rewritten_with_its_old_mtime_while_packing_is_refused(tmp_path, how):
    """The mid-run check (``files.changed_since_found``, after each part is read) compared size and mtime alone:
    a file rewritten while the run read it, its old size and mtime put back, passed it, and the run packed parts
    read from the old content with parts read from the new, without a word.  It compares inode and ctime too."""
    from packtools.errors import PackingError
    from packtools.io import files
    from packtools.io.discover import discover

    src = str(tmp_path / "data.jsonl")
    _write(src, [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    (found,) = discover([src])
    _rewrite_keeping_size_and_mtime(src, [{"input_ids": [4, 5, 6]}, {"input_ids": [1, 2]}], how)
    with pytest.raises(PackingError, match=r"changed while packing \(rewritten: .*(another file|status)"):
        list(files.iter_part(files.Part(found)))
    (again,) = discover([src])  # found again: read as it is now
    assert sum(t.num_rows for _, t in files.iter_part(files.Part(again))) == 2
