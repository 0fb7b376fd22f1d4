"""What a run loads before its data (packtools.pipeline.tokenizer.load): the recorded facts of tokenizer.json are
the parsed file's facts and spare later runs the parse (negative control: with the cache off the file is parsed
every time); a damaged record is parsed again; the fast engine's copy with "a b" merges gives the same ids as
tokenizer.json, is written only when that spelling means the same, and is named in the proof's verdict key."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _pipeline_data import CORPUS, build_tokenizer, hold_fast_engine_load

from packtools.pipeline.tokenizer import adversarial, proof_cache
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer import load as tokenizer_load
from packtools.pipeline.tokenizer.batch import BatchTokenizer
from packtools.pipeline.tokenizer.folder import tokenizer_fingerprint
from packtools.pipeline.tokenizer.spec import IdsSpec

pytestmark = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")


@pytest.fixture
def tok(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    return build_tokenizer(str(tmp_path / "tok"))


def _count_parses(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = fast_tokenize.read_spec

    def read_spec(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(fast_tokenize, "read_spec", read_spec)
    return calls


@pytest.mark.parametrize("cache_on", [True, False], ids=["recorded", "cache-off-control"])
def test_recorded_facts_spare_the_parse_and_equal_the_parsed_ones(tok, monkeypatch, cache_on):
    if not cache_on:
        monkeypatch.setenv("PACKTOOLS_CACHE_DIR", "")
    first = BatchTokenizer(tok, "text")
    calls = _count_parses(monkeypatch)
    second = BatchTokenizer(tok, "text")
    assert second.fast is not None
    assert (calls == []) is cache_on  # the control parses tokenizer.json again
    fp = tokenizer_fingerprint(tok)
    recorded = tokenizer_load.load_facts(tok, fp)
    parsed = tokenizer_load.TokenizerFacts.from_spec(fast_tokenize.read_spec(tok))
    assert recorded.recorded is cache_on and not parsed.recorded
    assert recorded._meta() == parsed._meta()
    assert np.array_equal(recorded.byte_lengths, parsed.byte_lengths)
    texts = CORPUS[:20]
    assert first.encode(texts, True).values.tolist() == second.encode(texts, True).values.tolist()


def test_a_damaged_facts_record_is_parsed_again(tok):
    fp = tokenizer_fingerprint(tok)
    good = tokenizer_load.load_facts(tok, fp)
    path = tokenizer_load.facts_path(fp)
    assert os.path.isfile(path)
    whole = open(path, "rb").read()
    for damaged in (b"not an npz", whole[: len(whole) // 2]):  # garbage; cut (a zip without its directory)
        with open(path, "wb") as fh:
            fh.write(damaged)
        again = tokenizer_load.load_facts(tok, fp)
        assert not again.recorded and again._meta() == good._meta()
        assert tokenizer_load.load_facts(tok, fp).recorded  # and recorded anew


def test_the_compact_copy_gives_the_same_ids_and_is_keyed_by_its_source(tok, tmp_path):
    import fastokens

    bt = BatchTokenizer(tok, "text")
    assert bt.fast_source == "compact"  # written by the first run's parse, before the engine loads
    compact = tokenizer_load.compact_path(bt.fingerprint)
    with open(compact, encoding="utf-8") as fh:
        merges = json.load(fh)["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    texts = adversarial.adversarial_texts(["<|endoftext|>"]) + CORPUS
    original = fastokens.Tokenizer.from_file(os.path.join(tok, "tokenizer.json"))
    copy = fastokens.Tokenizer.from_file(compact)
    for special in (True, False):
        a = original.encode_batch_flat(texts, add_special_tokens=special)
        b = copy.encode_batch_flat(texts, add_special_tokens=special)
        assert a == b
    from tokenizers import Tokenizer  # the reference reads the copy too (reference.LiteReference)

    ref_original, ref_copy = (
        Tokenizer.from_file(os.path.join(tok, "tokenizer.json")),
        Tokenizer.from_file(compact),
    )
    for special in (True, False):
        want = [e.ids for e in ref_original.encode_batch(texts, add_special_tokens=special)]
        assert [e.ids for e in ref_copy.encode_batch(texts, add_special_tokens=special)] == want
    assert BatchTokenizer(tok, "text").reference_engine.startswith("tokenizers")  # its verdict names the copy
    keys = {
        s: proof_cache.verdict_path("0" * 64, "text", "t", ["a"], source=s)
        for s in ("compact", "tokenizer.json")
    }
    assert keys["compact"] != keys["tokenizer.json"]


def test_no_compact_copy_when_a_merge_piece_has_a_space(tmp_path):
    spec = {"model": {"type": "BPE", "merges": [["a", "b"], ["a b", "c"]]}}
    path = str(tmp_path / "c.json")
    assert not tokenizer_load.write_compact(path, spec) and not os.path.exists(path)
    spec["model"]["merges"] = [["a", "b"], ["ab", "c"]]
    assert tokenizer_load.write_compact(path, spec)
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh)["model"]["merges"] == ["a b", "ab c"]


def test_a_failed_background_load_is_a_refusal_under_auto(tok, monkeypatch):
    def broken(self):
        self._error = ValueError("model error: simulated")

    monkeypatch.setattr(tokenizer_load.FastLoad, "_load", broken)
    bt = BatchTokenizer(tok, "text")
    assert bt.fast is None and "cannot load" in bt.report.reason
    assert bt.encode(["hello world"], True).num_rows == 1


@pytest.mark.parametrize("wait", [False, True], ids=["overlapped", "wait-control"])
def test_batches_before_the_fast_engine_has_loaded_go_to_the_reference(tok, monkeypatch, wait):
    import threading

    BatchTokenizer(tok, "text")  # records the verdicts
    BatchTokenizer(tok, "text")
    release = hold_fast_engine_load(monkeypatch)
    if wait:
        threading.Timer(0.2, release.set).start()
    bt = BatchTokenizer(tok, "text", wait_for_engine=wait)
    assert bt.proof_recorded and bt.report.engine.startswith("fastokens")
    assert (bt.pending is None and bt.fast is not None) is wait
    texts = CORPUS[:30]
    ref = bt.reference_ids(texts, True)
    bt.start_part("p")
    first = bt.encode(texts, True)  # overlapped: the reference's ids, counted as such
    assert ragged_lists(first) == ref
    only_reference = bt.part_report()  # a part that ended here had no batch on the fast engine: it says so
    assert (only_reference["engine"] == "transformers") is (not wait)
    assert not wait or only_reference["engine"].startswith("fastokens")
    if not wait:
        assert only_reference["reason"].startswith(
            "every batch of this part: the fast engine was still loading"
        )
        threading.Timer(0.2, release.set).start()
    second = bt.encode(
        texts, True, column="text"
    )  # still loading: waits for it (one batch on the reference only)
    assert ragged_lists(second) == ref and bt.fast is not None
    report = bt.part_report()
    checked = report["checked"]
    assert report["engine"].startswith("fastokens")  # the second batch was the fast engine's
    assert checked.get("batches_on_transformers", 0) == (0 if wait else 1)
    assert checked["proof_rows"] == (60 if wait else 30)


def ragged_lists(r) -> list[list[int]]:
    return [r.values[r.offsets[i] : r.offsets[i + 1]].tolist() for i in range(r.num_rows)]


def test_token_columns_are_built_without_importing_pandas():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, pyarrow as pa\n"
        "from packtools.core.arrow import list_array\n"
        "a = list_array(np.array([0, 2, 5]), np.arange(5, dtype=np.int32), False, pa.int32())\n"
        "assert a.to_pylist() == [[0, 1], [2, 3, 4]]\n"
        "print('pandas' in sys.modules)\n"
        "pa.array(np.arange(3))\n"  # the control: pyarrow's own NumPy conversion does import it
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.parametrize("extra", [0, 1], ids=["small", "one-byte-more-control"])
def test_a_small_input_of_a_large_vocabulary_is_tokenized_by_the_reference_alone(tok, monkeypatch, extra):
    """Up to SMALL_INPUT_BYTES of input, the pipeline's tokenizer starts no fast-engine load (it would only compete
    with the reference for the cores and hold the exit) and says why; every id is the reference's."""
    BatchTokenizer(tok, "text")  # records the verdicts
    monkeypatch.setattr(tokenizer_load, "OVERLAP_MIN_BYTES", 0)  # the test tokenizer is small
    started = []
    real = tokenizer_load.FastLoad.__init__

    def counting(self, *args, **kwargs):
        started.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(tokenizer_load.FastLoad, "__init__", counting)
    size = tokenizer_load.SMALL_INPUT_BYTES + extra
    bt = BatchTokenizer(tok, "text", wait_for_engine=False, input_bytes=size)
    texts = CORPUS[:40]
    bt.start_part("p")
    got = bt.encode(texts, True)
    assert ragged_lists(got) == bt.reference_ids(texts, True)
    if extra:  # over the limit: the fast engine loads and tokenizes, as before
        assert len(started) == 1 and bt.report.engine.startswith("fastokens")
        bt.encode(texts, True)
        assert bt.fast is not None
    else:
        assert started == [] and bt.fast is None and bt.pending is None
        assert bt.report.engine == "transformers" and bt.report.requested == "auto"
        assert "smaller than 4 MiB" in bt.report.reason and "not loaded" in bt.report.reason
    # a workers' copy adopts the choice: no load either
    again = BatchTokenizer(tok, "text", proven=bt.report.to_dict())
    assert (again.fast is None) is (not extra) and len(started) == 2 * extra


def test_the_pipeline_tokenizer_follows_the_input_size_class(tok, monkeypatch):
    """One process, a small run then a large one: the large run gets a tokenizer with the fast engine, not the
    small run's reference-only one (and a stage job, which passes no size, takes the driver's)."""
    from packtools.pipeline import stage

    monkeypatch.setattr(stage, "_TOKENIZERS", {})
    BatchTokenizer(tok, "text")  # records the verdicts
    monkeypatch.setattr(tokenizer_load, "OVERLAP_MIN_BYTES", 0)
    ids = IdsSpec.of(tokenizer_fingerprint(tok), "text", True, "auto", "report", 0.001)
    small = stage.preload_tokenizer(tok, ids, input_bytes=10)
    assert small.small_input == 10 and stage.preload_tokenizer(tok, ids) is small
    large = stage.preload_tokenizer(tok, ids, input_bytes=tokenizer_load.SMALL_INPUT_BYTES + 1)
    assert large is not small and large.small_input is None
    assert large.report.engine.startswith("fastokens")
    assert stage.preload_tokenizer(tok, ids) is large


def test_the_fingerprint_is_taken_once_per_process_and_follows_every_write(tok):
    import hashlib

    first = tokenizer_fingerprint(tok)
    calls = []
    real = hashlib.sha256

    def counting(*args):
        calls.append(1)
        return real(*args)

    try:
        hashlib.sha256 = counting
        assert tokenizer_fingerprint(tok) == first and calls == []  # memo: no file read again
        path = os.path.join(tok, "tokenizer_config.json")
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({**config, "model_max_length": 7}, fh)
        changed = tokenizer_fingerprint(tok)
        assert changed != first and calls  # the write changed the stat: hashed again, a new fingerprint
    finally:
        hashlib.sha256 = real


@pytest.mark.slow
def test_list_columns_are_read_without_importing_pandas():
    """The stage reads its token columns back (core.arrow.read_list_column) and the writer builds seq_lengths
    without pyarrow's NumPy conversion, which imports pandas (0.3 s of a short run)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, pyarrow as pa\n"
        "from packtools.core.arrow import list_array, read_list_column\n"
        "from packtools.core.plan import plan\n"
        "a = list_array(np.array([0, 2, 5, 6]), np.arange(6, dtype=np.int32), False, pa.int32()).slice(1)\n"
        "c = read_list_column(a, 'x').chunks[0]\n"
        "assert c.offsets.tolist() == [0, 3, 4] and c.values.tolist() == [2, 3, 4, 5], (c.offsets, c.values)\n"
        "assert plan([3, 2, 2], max_length=4).seq_lengths.to_pylist() == [[3], [2, 2]]\n"
        "print('pandas' in sys.modules)\n"
        "a.values.to_numpy()\n"  # the control: pyarrow's own conversion does import it
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_the_parse_runs_without_collections_and_leaves_the_collector_as_it_was(tok, monkeypatch, enabled):
    import gc

    seen: list[bool] = []
    real = fast_tokenize.read_spec

    def read_spec(path):
        seen.append(gc.isenabled())
        return real(path)

    monkeypatch.setattr(fast_tokenize, "read_spec", read_spec)
    fp = tokenizer_fingerprint(tok)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert not tokenizer_load.load_facts(tok, fp).recorded
        assert seen == [False]  # parsed with the collector paused
        assert gc.isenabled() is enabled  # and left as it was
        monkeypatch.setattr(fast_tokenize, "read_spec", lambda path: 1 / 0)
        os.remove(tokenizer_load.facts_path(fp))
        with pytest.raises(ZeroDivisionError):
            tokenizer_load.load_facts(tok, fp)
        assert gc.isenabled() is enabled  # also when the parse raises
    finally:
        (gc.enable if was else gc.disable)()
