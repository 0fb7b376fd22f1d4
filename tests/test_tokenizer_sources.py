"""Transformers' ids come from transformers' own reading of the folder (issue 29: S5, S6).

- Tokens transformers adds from ``added_tokens.json`` or ``tokenizer_config.json``'s ``added_tokens_decoder``
  but tokenizer.json lacks: every engine choice gives ``AutoTokenizer``'s ids, on the first run and the second.
- The fast engine's derived copy of tokenizer.json (``"a b"`` merges) is checked by content before it is
  loaded; a damaged copy is removed, never trusted.  The reference loads it only where the run that checked
  tokenizer.json against transformers found the copy identical to it (their serialized states equal), with the
  SHA-256 it was found with: a copy rewritten since (its own ``.sha256`` rewritten too) or one that was not
  identical is never the reference.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from _pipeline_data import CORPUS, EOS, build_tokenizer, load

from packtools import pack_files
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer import load as tokenizer_load
from packtools.pipeline.tokenizer import reference
from packtools.pipeline.tokenizer.batch import BatchTokenizer
from packtools.pipeline.tokenizer.folder import file_sha256

needs_engine = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="fastokens not installed")


def _docs(out) -> list[list[int]]:
    from datasets import load_from_disk

    from packtools.core import unpack

    return [list(map(int, s)) for s in unpack(load_from_disk(str(out)).data.table)["input_ids"]]


def _expected(tok_dir, texts) -> list[list[int]]:
    tok = load(tok_dir)
    eos = tok.convert_tokens_to_ids(EOS)
    return [ids + [eos] for ids in tok(texts)["input_ids"]]


def _write(path, texts):
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


@pytest.fixture
def tok_extra(tmp_path):
    """A tokenizer whose ``<extra_tok>`` is only in added_tokens.json (transformers adds it; tokenizer.json and
    so the tokenizers library and the fast engine know nothing of it)."""
    path = build_tokenizer(str(tmp_path / "tok"))
    size = len(json.load(open(os.path.join(path, "tokenizer.json")))["model"]["vocab"])
    with open(os.path.join(path, "added_tokens.json"), "w") as fh:
        json.dump({"<extra_tok>": size + 3}, fh)
    assert "<extra_tok>" in load(path).get_added_vocab()  # transformers reads it
    return path


@pytest.fixture
def tok_decoder(tmp_path):
    """The same through tokenizer_config.json's ``added_tokens_decoder``."""
    path = build_tokenizer(str(tmp_path / "tok"))
    size = len(json.load(open(os.path.join(path, "tokenizer.json")))["model"]["vocab"])
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["added_tokens_decoder"] = {
        str(size + 5): {"content": "<extra_tok>", "lstrip": False, "rstrip": False, "normalized": False,
                        "single_word": False, "special": True}
    }  # fmt: skip
    json.dump(cfg, open(cfg_path, "w"))
    assert "<extra_tok>" in load(path).get_added_vocab()
    return path


@pytest.mark.parametrize("which", ["added_tokens.json", "added_tokens_decoder"])
@pytest.mark.parametrize("engine", ["auto", "transformers"])
def test_tokens_transformers_adds_from_other_files_are_in_the_ids(which, engine, request, tmp_path):
    tok = request.getfixturevalue("tok_extra" if which == "added_tokens.json" else "tok_decoder")
    # past the run's first rows (the driver's proof), where only the audit (0.001) could see a difference
    texts = [CORPUS[i % 5] + (" <extra_tok> end" if i >= 1000 and i % 50 == 10 else "") for i in range(3000)]
    src = _write(tmp_path / "data.jsonl", texts)
    want = _expected(tok, texts)
    # the second run finds what the first (auto, as S6's) recorded
    for run, eng in (("first", "auto"), ("second", engine)):
        res = pack_files(src, tmp_path / run, 4096, tokenizer=tok, tokenizer_engine=eng)
        assert sorted(_docs(res.out)) == sorted(want), run
        assert res.stats["tokenizer"]["engine"] == "transformers"
        if eng == "auto":
            assert "<extra_tok>" in res.stats["tokenizer"]["reason"]


def test_chat_markers_only_in_added_tokens_json_are_transformers_tokens(tmp_path):
    """ChatML markers that only added_tokens.json declares: every conversation keeps them as single tokens."""
    path = build_tokenizer(str(tmp_path / "tok"))
    spec = json.load(open(os.path.join(path, "tokenizer.json")))
    moved = {a["content"]: a["id"] for a in spec["added_tokens"] if a["content"] != EOS}
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] == EOS]
    json.dump(spec, open(os.path.join(path, "tokenizer.json"), "w"))
    json.dump(moved, open(os.path.join(path, "added_tokens.json"), "w"))
    tok = load(path)
    rows = [
        {
            "messages": [
                {"role": "user", "content": CORPUS[i % 5]},
                {"role": "assistant", "content": CORPUS[i % 3]},
            ]
        }
        for i in range(40)
    ]
    with open(tmp_path / "chat.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    want = sorted(
        tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"] for r in rows
    )
    for run in ("first", "second"):
        res = pack_files(str(tmp_path / "chat.jsonl"), tmp_path / run, 4096, tokenizer=path)
        got = sorted(
            d[:-1] if d[-1] == tok.convert_tokens_to_ids(EOS) and d[:-1] in want else d
            for d in _docs(res.out)
        )
        assert got == want, run
        assert moved["<|im_start|>"] in {i for d in got for i in d}


@needs_engine
def test_a_damaged_fast_engine_copy_is_not_loaded(tmp_path):
    tok = build_tokenizer(str(tmp_path / "tok"))
    texts = [CORPUS[i % 5] for i in range(400)]
    src = _write(tmp_path / "data.jsonl", texts)
    pack_files(src, tmp_path / "o0", 4096, tokenizer=tok)  # records the copy with "a b" merges
    copies = glob.glob(os.path.join(os.environ["PACKTOOLS_CACHE_DIR"], "fast-engine", "*.json"))
    assert len(copies) == 1
    spec = json.load(open(copies[0]))
    spec["model"]["merges"] = spec["model"]["merges"][1:]  # its most frequent merge gone
    json.dump(spec, open(copies[0], "w"), ensure_ascii=False)
    for engine in ("auto", "transformers"):
        res = pack_files(
            src, tmp_path / engine, 4096, tokenizer=tok, tokenizer_engine=engine, tokenizer_audit=1.0
        )
        assert sorted(_docs(res.out)) == sorted(_expected(tok, texts)), engine
    assert (
        not os.path.exists(copies[0])
        or json.load(open(copies[0]))["model"]["merges"][0] != spec["model"]["merges"][0]
    )


def _copy(cache) -> str:
    copies = glob.glob(os.path.join(str(cache), "fast-engine", "*.json"))
    assert len(copies) == 1
    return copies[0]


@needs_engine
def test_the_reference_loads_the_copy_only_as_recorded_identical(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(cache))
    tok = build_tokenizer(str(tmp_path / "tok"))
    texts = [CORPUS[i % 5] + f" {i}" for i in range(40)]
    first = BatchTokenizer(tok, "text")  # transformers, records both verdicts
    assert first.reference_source == "transformers"
    second = BatchTokenizer(tok, "text")
    assert second.reference_source == "copy"  # the recorded identical copy, checked by SHA-256
    want = load(tok)(texts)["input_ids"]
    assert [e.ids for e in second.backend.encode_batch(texts)] == want
    # rewritten since it was found identical, with a matching .sha256 of its own: tokenizer.json is loaded
    copy = _copy(cache)
    spec = json.load(open(copy))
    spec["model"]["merges"] = spec["model"]["merges"][1:]
    json.dump(spec, open(copy, "w"), ensure_ascii=False)
    open(copy + ".sha256", "w").write(file_sha256(copy))
    third = BatchTokenizer(tok, "text", engine="auto")
    assert third.reference_source == "tokenizer.json"
    assert [e.ids for e in third.backend.encode_batch(texts)] == want


@needs_engine
def test_a_copy_that_is_not_identical_is_recorded_so_and_removed(tmp_path, monkeypatch):
    """A fault in the writing of the copy (one merge dropped) is found by the whole-state comparison."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(cache))
    real = tokenizer_load.write_compact

    def faulty(path, spec):
        model = dict(spec["model"], merges=spec["model"]["merges"][1:])
        return real(path, dict(spec, model=model))

    monkeypatch.setattr(tokenizer_load, "write_compact", faulty)
    tok = build_tokenizer(str(tmp_path / "tok"))
    BatchTokenizer(tok, "text")
    assert glob.glob(os.path.join(str(cache), "fast-engine", "*.json")) == []  # removed
    verdicts = [json.load(open(p)) for p in glob.glob(os.path.join(str(cache), "reference", "*.json"))]
    assert sorted(str(v.get("identical")) for v in verdicts) == [
        "False",
        "None",
    ]  # the copy's, tokenizer.json's
    assert BatchTokenizer(tok, "text").reference_source == "tokenizer.json"


@needs_engine
@pytest.mark.parametrize("faulty", [False, True])
def test_a_removed_copy_is_said_by_the_run_and_the_warm_runs_after(tmp_path, monkeypatch, faulty):
    """copy_identical's removal of a copy that is not identical was silent: the warm runs after it load
    tokenizer.json (slower) and nothing said why.  The run's notes and timings say it, on the run that removed
    it and on the warm runs after; the normal path (the copy identical) says nothing."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    if faulty:
        real = tokenizer_load.write_compact
        monkeypatch.setattr(  # one merge dropped in the copy: not tokenizer.json's tokenizer
            tokenizer_load, "write_compact",
            lambda path, spec: real(path, dict(spec, model=dict(spec["model"], merges=spec["model"]["merges"][1:]))),
        )  # fmt: skip
    tok = build_tokenizer(str(tmp_path / "tok"))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": CORPUS[i % 5] + f" {i}"}) + "\n" for i in range(200)))
    for run in ("first", "warm"):
        res = pack_files(str(src), str(tmp_path / run), 64, tokenizer=tok)
        said = [n for n in res.notes if "compact copy of tokenizer.json" in n]
        assert len(said) == faulty and res.timings.get("tokenizer_copy_removed", False) is faulty, (
            run,
            res.notes,
        )
    assert bool(glob.glob(os.path.join(str(tmp_path / "cache"), "fast-engine", "*.json"))) is not faulty


def test_record_copy_compares_whole_states(tmp_path, monkeypatch):
    """Negative control of the comparison itself: a copy with one added token more is not identical."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    tok = build_tokenizer(str(tmp_path / "tok"))
    lite = reference.LiteReference(tok)
    spec = json.load(open(os.path.join(tok, "tokenizer.json")))
    same = tmp_path / "same.json"
    json.dump(spec, open(same, "w"))
    assert reference.record_copy("f" * 64, lite, str(same)) is True
    spec["added_tokens"].append(dict(spec["added_tokens"][0], id=len(spec["model"]["vocab"]) + 50,
                                     content="<new>"))  # fmt: skip
    other = tmp_path / "other.json"
    json.dump(spec, open(other, "w"))
    assert reference.record_copy("e" * 64, lite, str(other)) is False and not other.exists()
