"""The recorded verdict of the fast engine's adversarial proof (packtools.pipeline.tokenizer.proof_cache): taken only for the
same tokenizer, data kind, reference (or one against transformers itself) and versions; a changed tokenizer runs the proof again (negative control:
a key that ignored the tokenizer would take the stale verdict); failures are not recorded; the per-part proof of
the data still runs."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from _pipeline_data import CORPUS, build_tokenizer, corrupt_fast_engine, load

from packtools.pipeline.tokenizer import adversarial, proof_cache
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer.batch import BatchTokenizer

pytestmark = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")
ADVERSARIAL_ONLY = "x" * 2000  # in the adversarial set, never in CORPUS


def _corrupt_adversarial(monkeypatch) -> None:
    """The fast engine gives a wrong id on one adversarial text only (the data rows stay right)."""
    corrupt_fast_engine(monkeypatch, lambda t: t == ADVERSARIAL_ONLY)


def _verdicts(cache) -> list[str]:
    folder = os.path.join(cache, "engine-proof")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _change(path: str) -> None:
    tok = load(path)
    tok.add_tokens(["<|brand-new|>"])
    tok.save_pretrained(path)


@pytest.mark.parametrize("broken_key", [False, True], ids=["keyed-by-tokenizer", "broken-key-control"])
def test_a_recorded_verdict_skips_the_fixed_set_only_for_the_same_tokenizer(
    tmp_path, monkeypatch, broken_key
):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", cache)
    path = build_tokenizer(str(tmp_path / "tok"))
    # the first run records the reference verdict (transformers vs tokenizers) and proves against transformers;
    # the second, on the tokenizers library it now uses, takes that verdict (one against transformers itself)
    assert not BatchTokenizer(path, "text").proof_recorded and len(_verdicts(cache)) == 1
    first = BatchTokenizer(path, "text")
    assert first.reference_engine.startswith("tokenizers")
    assert first.fast is not None and first.proof_recorded and len(_verdicts(cache)) == 1

    _corrupt_adversarial(monkeypatch)  # from here the engine is wrong on the adversarial set
    real, seen = proof_cache.verdict_path, []
    monkeypatch.setattr(proof_cache, "verdict_path", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    second = BatchTokenizer(path, "text")
    assert second.fast is not None and second.proof_recorded  # the recorded verdict: the fixed set is skipped
    assert second.report.checked == first.report.checked  # the report (and so the manifest) is the same
    second.start_part("p")
    second(pa.table({"text": CORPUS[:20]}))
    assert second.part_report()["checked"]["proof_rows"] == 20  # the data's own proof still runs

    if (
        broken_key
    ):  # deliberately broken variant: a key that ignores the tokenizer would take the stale verdict
        found = seen[-1]  # the key whose verdict the second run took
        monkeypatch.setattr(proof_cache, "verdict_path", lambda *a, **k: real(*found[0], **found[1]))
    _change(path)
    third = BatchTokenizer(path, "text")
    if broken_key:
        assert third.proof_recorded and third.fast is not None  # the stale verdict: the bug this test guards
        return
    assert not third.proof_recorded and third.fast is None  # proven again: the corrupt engine is refused
    assert "differ from transformers' on the built-in adversarial set" in third.report.reason
    assert len(_verdicts(cache)) == 1  # a failed proof is not recorded


def test_chat_and_text_verdicts_are_apart_and_the_cache_can_be_off(tmp_path, monkeypatch):
    texts = adversarial.adversarial_texts(["<|x|>"])
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    text = proof_cache.verdict_path("0" * 64, "text", "transformers", texts)
    assert text != proof_cache.verdict_path("0" * 64, "messages", "transformers", texts)
    assert text != proof_cache.verdict_path("0" * 64, "text", "tokenizers", texts)
    assert text != proof_cache.verdict_path("0" * 64, "text", "transformers", texts[:-1])
    assert proof_cache.load(text) is None
    proof_cache.record(text, {"adversarial_texts": 2})
    assert proof_cache.load(text) == {"adversarial_texts": 2}
    whole = open(text).read()
    for damaged in (
        whole.replace('"adversarial_texts": 2', '"adversarial_texts": 3'),  # content changed, checksum kept
        whole[: len(whole) // 2],  # cut
        whole.replace(', "sha256"', ', "x"'),  # no checksum (as written before there was one)
    ):
        with open(text, "w") as fh:
            fh.write(damaged)
        assert proof_cache.load(text) is None  # no verdict: the proof runs again
    with open(text, "w") as fh:
        fh.write('{"same": false, "checked": {"adversarial_texts": 2}}')
    assert proof_cache.load(text) is None
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", "")
    path = build_tokenizer(str(tmp_path / "tok"))
    assert not BatchTokenizer(path, "text").proof_recorded
    assert not BatchTokenizer(path, "text").proof_recorded  # nothing was recorded
