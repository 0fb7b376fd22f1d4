"""The fast tokenizer engine: same ids and assistant masks as transformers on several tokenizer kinds and on the
adversarial set, refusal of tokenizers it does not reproduce, and the fallback taken (and reported) when it
disagrees with transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from _pipeline_data import (
    CHATML_GENERATION,
    CHATML_PLAIN,
    CORPUS,
    EOS,
    IM_END,
    IM_START,
    build_tokenizer,
    corrupt_fast_engine,
    fail_fast_engine,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from packtools.errors import PackingError
from packtools.pipeline.prefetch import prefetch
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer.adversarial import adversarial_conversations, adversarial_texts
from packtools.pipeline.tokenizer.batch import BatchTokenizer

# Tests marked with this need the engine; the others (refusals, fallbacks, plumbing) run without it too.
needs_engine = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
BOS = "<|begin_of_text|>"


def _save(tok: Tokenizer, path: str, **kwargs) -> str:
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(path)
    return path


def _bpe_trainer(specials: list[str]) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )


def llama3_style(path: str) -> str:
    """Regex split + byte-level without regex, ignore_merges, NFC, and a BOS added by the post-processor."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, _bpe_trainer([BOS, EOS]))
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]),
        ]
    )
    return _save(tok, path, bos_token=BOS, eos_token=EOS)


def with_added_tokens(path: str) -> str:
    """GPT-2 style plus added tokens, special and not, some sharing characters with ordinary text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, _bpe_trainer([EOS]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=CHATML_GENERATION)
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, "<tool>"]})
    fast.add_tokens(["<think>", "</think>", "quick brown"])
    fast.save_pretrained(path)
    return path


def unigram(path: str) -> str:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=[EOS, "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _save(tok, path, eos_token=EOS, unk_token="<unk>")


KINDS = {
    "gpt2": lambda p: build_tokenizer(p, CHATML_GENERATION),
    "llama3": llama3_style,
    "added": with_added_tokens,
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def bpe(request, tmp_path_factory) -> str:
    return KINDS[request.param](str(tmp_path_factory.mktemp(request.param)))


def _texts() -> list[str]:
    specials = [EOS, IM_START, IM_END, BOS, "<tool>", "<think>", "quick brown"]
    return adversarial_texts(specials) + CORPUS[:5] + ["ends with eos " + EOS, "  x  "]


def _same(a: pa.Table, b: pa.Table) -> None:
    assert a.schema == b.schema
    for name in a.column_names:
        assert a.column(name).to_pylist() == b.column(name).to_pylist(), name


@needs_engine
def test_fast_engine_is_chosen_and_gives_transformers_ids(bpe):
    fast = BatchTokenizer(bpe, "text")
    ref = BatchTokenizer(bpe, "text", engine="transformers")
    assert fast.report.engine.startswith("fastokens "), fast.report.reason
    assert ref.report.engine == "transformers"
    table = pa.table({"text": _texts() * 3})
    _same(fast(table), ref(table))
    checked = fast.part_report()["checked"]
    assert checked["proof_rows"] == fast_tokenize.PROOF_ROWS <= checked["rows_checked"] < table.num_rows
    assert fast.fast is not None  # still on the fast engine after the proof and the audit


@needs_engine
def test_encoder_returns_flat_int32_buffers(bpe):
    enc = fast_tokenize.FastEncoder(bpe)
    texts = _texts()
    got = enc.encode(texts, special=True)
    assert got.values.dtype == np.int32 and got.offsets.dtype == np.int64 and got.num_rows == len(texts)
    tok = BatchTokenizer(bpe, "text", engine="transformers").tok
    assert fast_tokenize.first_difference(got, tok(texts)["input_ids"]) is None
    assert enc.encode([], special=True).num_rows == 0


@needs_engine
@pytest.mark.parametrize(
    "template", [CHATML_GENERATION, CHATML_PLAIN], ids=["generation-tags", "incremental"]
)
def test_chat_ids_and_assistant_masks_match(tmp_path, template):
    path = build_tokenizer(str(tmp_path), template)
    convs = adversarial_conversations(_texts())
    table = pa.table({"messages": convs})
    fast = BatchTokenizer(path, "messages")
    assert fast.report.engine.startswith("fastokens"), fast.report.reason
    assert fast.report.checked["adversarial_conversations"] > 50
    ref = BatchTokenizer(path, "messages", engine="transformers")(table)
    for _ in range(4):  # past the proof, small batches are audited (some batches have no audited row)
        out = fast(table)
        _same(out, ref)
    assert fast.fast is not None
    labels = out.column("labels").to_pylist()
    assert any(x != -100 for row in labels for x in row) and any(x == -100 for row in labels for x in row)


@needs_engine
@pytest.mark.parametrize("fmt", ["prompt_completion", "preference"])
def test_prompt_completion_and_preference_match(bpe, fmt):
    texts = _texts()
    n = len(texts) // 3
    cols = {"prompt": texts[:n], "completion": texts[n : 2 * n]}
    if fmt == "preference":
        cols = {"prompt": texts[:n], "chosen": texts[n : 2 * n], "rejected": texts[2 * n : 3 * n]}
    table = pa.table(cols)
    _same(BatchTokenizer(bpe, fmt)(table), BatchTokenizer(bpe, fmt, engine="transformers")(table))


@needs_engine
def test_unigram_is_refused(tmp_path):
    path = unigram(str(tmp_path))
    tok = BatchTokenizer(path, "text")
    assert tok.report.engine == "transformers" and tok.fast is None
    assert "Unigram" in tok.report.reason
    with pytest.raises(PackingError, match="Unigram") as err:
        BatchTokenizer(path, "text", engine="fast")
    assert err.value.param == "tokenizer_engine"


def test_refusal_reasons():
    base = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}
    assert fast_tokenize.refusal(base) is None
    assert "dropout" in fast_tokenize.refusal({**base, "model": {"type": "BPE", "dropout": 0.1}})
    assert "byte-level" in fast_tokenize.refusal({**base, "pre_tokenizer": {"type": "Whitespace"}})
    assert "NFC" in fast_tokenize.refusal({**base, "normalizer": {"type": "Lowercase"}})
    assert "WordPiece" in fast_tokenize.refusal({**base, "model": {"type": "WordPiece"}})


def test_adversarial_set_covers_the_hard_cases():
    texts = adversarial_texts([EOS])
    assert "" in texts and any(EOS in t and t != EOS for t in texts)
    assert any(len(t) >= 2000 and not t.strip() for t in texts)  # a long whitespace run
    assert any(any(ord(c) > 0xFFFF for c in t) for t in texts)  # astral plane
    assert any(t.isdigit() and len(t) > 10 for t in texts)
    assert texts == adversarial_texts([EOS])  # deterministic


@needs_engine
def test_fallback_when_the_adversarial_set_differs(tmp_path, monkeypatch):
    path = build_tokenizer(str(tmp_path))
    corrupt_fast_engine(monkeypatch, lambda t: EOS in t)
    tok = BatchTokenizer(path, "text")
    assert tok.report.engine == "transformers" and tok.fast is None
    assert "adversarial" in tok.report.reason
    with pytest.raises(PackingError, match="adversarial"):
        BatchTokenizer(path, "text", engine="fast")


@needs_engine
def test_fallback_when_the_data_differs(tmp_path, monkeypatch):
    path = build_tokenizer(str(tmp_path))
    corrupt_fast_engine(monkeypatch, lambda t: "zebra" in t)
    table = pa.table({"text": ["a zebra crossing", *CORPUS[:10]]})
    tok = BatchTokenizer(path, "text")
    assert tok.fast is not None  # the adversarial set has no zebra
    out = tok(table)
    assert (
        tok.report.engine == "transformers"
        and "fallback" in tok.report.reason
        and "zebra" in tok.report.reason
    )
    _same(out, BatchTokenizer(path, "text", engine="transformers")(table))
    forced = BatchTokenizer(path, "text", engine="fast")
    with pytest.raises(PackingError, match="zebra"):
        forced(table)


@needs_engine
def test_audit_after_the_proof_stops_on_a_difference(tmp_path, monkeypatch):
    path = build_tokenizer(str(tmp_path))
    corrupt_fast_engine(monkeypatch, lambda t: "zebra" in t)
    tok = BatchTokenizer(path, "text")
    n = fast_tokenize.PROOF_ROWS
    tok(pa.table({"text": CORPUS[:5] * (n // 5 + 1)}))  # the proof passes
    batch = ["zebra"] * 5000  # the 0.001 random audit samples some of these rows (seeded: always the same)
    with pytest.raises(PackingError, match="tokenizer_engine='transformers'") as err:
        tok(pa.table({"text": batch}), first_row=1000)
    import re

    assert int(re.match(r"row (\d+):", str(err.value)).group(1)) >= 1000  # the audited row that differs


def test_without_the_engine_installed_transformers_is_used(tmp_path, monkeypatch):
    path = build_tokenizer(str(tmp_path))
    monkeypatch.setattr(fast_tokenize, "engine_version", lambda: None)
    tok = BatchTokenizer(path, "text")
    assert tok.report.engine == "transformers" and "packtools[fast]" in tok.report.reason
    with pytest.raises(PackingError, match="not installed"):
        BatchTokenizer(path, "text", engine="fast")
    monkeypatch.setitem(__import__("sys").modules, "fastokens", None)
    with pytest.raises(ImportError, match=r"packtools\[fast\]"):
        fast_tokenize.FastEncoder(path)


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(PackingError, match="tokenizer_engine"):
        BatchTokenizer(build_tokenizer(str(tmp_path)), "text", engine="turbo")


@needs_engine
def test_pipeline_reports_the_engine_in_manifest_and_summary(tmp_path):
    from packtools.cli.main import main
    from packtools.constants import MANIFEST

    path = build_tokenizer(str(tmp_path / "tok"))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts() * 2))
    outs = {}
    for engine in ("auto", "transformers"):
        out = tmp_path / f"out-{engine}"
        assert main(["pack", str(src), "--tokenizer", path, "--out", str(out), "--max-length", "64",
                     "--tokenizer-engine", engine, "--quiet"]) == 0  # fmt: skip
        with open(os.path.join(out, MANIFEST)) as fh:
            outs[engine] = json.load(fh)
    assert outs["auto"]["stats"]["tokenizer"]["engine"].startswith("fastokens")
    assert outs["transformers"]["stats"]["tokenizer"]["engine"] == "transformers"
    # the same data, but another engine is another fingerprint (a rerun with the other engine is not a cache hit)
    assert outs["auto"]["fingerprint"] != outs["transformers"]["fingerprint"]
    for key in ("tokens_in", "rows_out", "tokens_kept"):
        assert outs["auto"]["stats"][key] == outs["transformers"]["stats"][key]
    from packtools.io.files import read_table

    a = [
        read_table(str(tmp_path / "out-auto" / f))
        for f in sorted(os.listdir(tmp_path / "out-auto"))
        if f.endswith(".arrow")
    ]
    b = [read_table(str(tmp_path / "out-transformers" / f)) for f in sorted(os.listdir(tmp_path / "out-transformers")) if f.endswith(".arrow")]  # fmt: skip
    assert [t.to_pydict() for t in a] == [t.to_pydict() for t in b]

    from packtools.pipeline.summary import format_pipeline_summary

    assert "tokenizer engine" in format_pipeline_summary(outs["auto"]["stats"], "x")


def test_prefetch_keeps_order_and_raises_where_the_source_failed():
    def source():
        yield 1
        yield 2
        raise ValueError("boom")

    got = []
    with pytest.raises(ValueError, match="boom"):
        for x in prefetch(source()):
            got.append(x)
    assert got == [1, 2]
    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.append(True)

    it = prefetch(endless(), depth=1)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert closed == [True]


@needs_engine
def test_an_engine_error_tokenizes_that_batch_with_transformers(tmp_path, monkeypatch):
    path = build_tokenizer(str(tmp_path))
    tok = BatchTokenizer(path, "text")
    fail_fast_engine(monkeypatch, lambda t: "boom" in t, RuntimeError, "match limit exceeded")
    table = pa.table({"text": ["boom " + t for t in CORPUS[:20]]})
    _same(tok(table), BatchTokenizer(path, "text", engine="transformers")(table))
    report = tok.part_report()
    assert report["checked"]["batches_on_transformers"] == 1 and tok.fast is not None
    assert "match limit exceeded" in report["batches_on_transformers_why"]  # says why
