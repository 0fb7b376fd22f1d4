"""A first run of plain text checks the lite reference against transformers in a child process (issue 42).

The child imports transformers (and torch with it) on another core while the driver reads tokenizer.json's facts
and loads the fast engine; the driver waits for it before it loads any reference, and trusts only a whole
recorded verdict: a check that finds a difference means transformers in the driver, a child that fails or is
stopped records nothing and the driver checks in-process as before.  The ids are transformers' in every case.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest
from _pipeline_data import CORPUS, EOS, build_tokenizer, load

from packtools.pipeline import adversarial, reference, tokenizer_load
from packtools.pipeline.tokenize import BatchTokenizer
from packtools.pipeline.tokenizer_dir import tokenizer_fingerprint


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("child-tok")))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _table():
    return pa.table({"text": adversarial.adversarial_texts([EOS]) + CORPUS[:8]})


def _transformers_ids(tok_dir) -> dict:
    return BatchTokenizer(tok_dir, "text", engine="transformers")(_table()).to_pydict()


def _verdict(tok_dir):
    return reference._whole_verdict(reference._verdict_path(tokenizer_fingerprint(tok_dir)))


def test_the_first_run_records_the_check_in_a_child_and_never_loads_transformers(tok_dir, cache):
    assert _verdict(tok_dir) is None
    first = BatchTokenizer(tok_dir, "text")
    verdict = _verdict(tok_dir)
    assert verdict is not None and verdict["same"] is True and verdict["eos_id"] == load(tok_dir).eos_token_id
    assert first._tok is None and first.reference_engine.startswith("tokenizers")
    assert first(_table()).to_pydict() == _transformers_ids(tok_dir)


def test_a_check_that_finds_a_difference_means_transformers_in_the_driver(tok_dir, cache, monkeypatch):
    tok = load(tok_dir)

    class Shifted:  # transformers' tokenizer with other ids, as the child would load it
        eos_token_id = tok.eos_token_id

        def __call__(self, texts, add_special_tokens=True):
            ids = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
            return {"input_ids": [[i + 1 for i in row] for row in ids]}

    from packtools.pipeline import tokenizer_dir

    monkeypatch.setattr(tokenizer_dir, "load_tokenizer", lambda path: Shifted())
    assert (
        tokenizer_load.check_in_child(tok_dir, tokenizer_fingerprint(tok_dir)) == 0
    )  # the child's own code, in-process
    monkeypatch.undo()
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(cache))
    assert _verdict(tok_dir)["same"] is False
    # a recorded verdict, passing or not, starts no child; "different" loads transformers in the driver
    assert reference.record_in_child(tok_dir, tokenizer_fingerprint(tok_dir)) is None
    bt = BatchTokenizer(tok_dir, "text")
    assert bt._tok is not None and bt.reference_engine == "transformers"
    assert bt(_table()).to_pydict() == _transformers_ids(tok_dir)


def test_a_child_that_records_nothing_leaves_the_check_to_the_driver(tok_dir, cache, monkeypatch):
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    monkeypatch.setattr(reference, "record_in_child", lambda *a: failing)
    bt = BatchTokenizer(tok_dir, "text")
    assert failing.returncode == 3
    # no verdict from the child: the driver loaded transformers and checked (and recorded) as before
    assert bt._tok is not None and bt.reference_engine == "transformers"
    assert _verdict(tok_dir)["same"] is True
    assert bt(_table()).to_pydict() == _transformers_ids(tok_dir)


def test_a_damaged_verdict_is_no_verdict_and_is_checked_again(tok_dir, cache):
    fp = tokenizer_fingerprint(tok_dir)
    BatchTokenizer(tok_dir, "text")
    path = reference._verdict_path(fp)
    with open(path) as fh:
        saved = json.load(fh)
    with open(path, "w") as fh:  # as if cut or rewritten: its checksum no longer matches
        json.dump({**saved, "eos_id": saved["eos_id"] + 1}, fh)
    assert reference.read_verdict(path) is None
    # not a verdict: checked again (in a child), and the damaged one replaced by a whole one
    child = reference.record_in_child(tok_dir, fp)
    assert child is not None
    reference.wait_child(child)
    assert reference.read_verdict(path)["eos_id"] == saved["eos_id"]


def test_a_failed_load_stops_the_child(tok_dir, cache, monkeypatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(reference, "record_in_child", lambda *a: sleeper)

    def broken(*a, **k):
        raise OSError("tokenizer.json unreadable")

    monkeypatch.setattr(BatchTokenizer, "_facts_and_fast_load", broken)
    with pytest.raises(OSError, match="unreadable"):
        BatchTokenizer(tok_dir, "text")
    assert sleeper.returncode is not None and sleeper.returncode != 0  # ended, not left running


def test_no_child_for_transformers_or_chat_formats_or_without_a_cache(tok_dir, cache, monkeypatch):
    started = []
    real = reference.record_in_child
    monkeypatch.setattr(reference, "record_in_child", lambda *a: started.append(a) or real(*a))
    BatchTokenizer(tok_dir, "text", engine="transformers")
    BatchTokenizer(tok_dir, "messages")
    assert started == []
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", "")
    assert real(tok_dir, tokenizer_fingerprint(tok_dir)) is None
