"""The tokenizer engine's proof and its reports: the tokenizer taken as it is (truncation blocks ignored as
transformers' __call__ does), engine errors and byte-incomplete vocabularies (fall back or a clear error, dropped
characters counted), a proof per column and per part counted honestly, engine and version in every cache key,
reports kept across reruns, workers taking the driver's engine.  Findings S14, S15, S16, T1, U11, U12, U13."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pipeline_data import CORPUS, EOS, build_tokenizer, corrupt_fast_engine, fail_fast_engine, load
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from packtools import PackingError, pack_files
from packtools.constants import MANIFEST
from packtools.core import unpack
from packtools.io.discover import discover
from packtools.io.files import Part
from packtools.pipeline.stage import StageJob, stage_key, stage_part
from packtools.pipeline.tokenizer import adversarial
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer.batch import BatchTokenizer
from packtools.pipeline.tokenizer.char_drops import DropCounter, missing_bytes
from packtools.pipeline.tokenizer.folder import tokenizer_fingerprint
from packtools.pipeline.tokenizer.proof import Proof
from packtools.pipeline.tokenizer.spec import IdsSpec

needs_engine = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")


@pytest.fixture(scope="module")
def tok_bl(tmp_path_factory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("bl")))


@pytest.fixture(scope="module")
def tok_trunc(tmp_path_factory) -> str:
    """A tokenizer whose tokenizer.json carries a truncation block (one truncating call before save_pretrained)."""
    path = build_tokenizer(str(tmp_path_factory.mktemp("trunc")))
    tok = load(path)
    tok("hello " * 100, truncation=True, max_length=32)
    tok.save_pretrained(path)
    with open(os.path.join(path, "tokenizer.json")) as fh:
        assert json.load(fh)["truncation"]["max_length"] == 32
    return path


@pytest.fixture(scope="module")
def tok_noalpha(tmp_path_factory) -> str:
    """A byte-level BPE trained without the byte alphabet: no token for a tab (and many other bytes)."""
    path = str(tmp_path_factory.mktemp("noalpha"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(path)
    return path


def _jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _manifest(out) -> dict:
    with open(os.path.join(out, MANIFEST)) as fh:
        return json.load(fh)


def _docs(out) -> list[list[int]]:
    from datasets import load_from_disk

    return [list(map(int, s)) for s in unpack(load_from_disk(str(out)).data.table)["input_ids"]]


# -- S14: truncation blocks ------------------------------------------------------------------------------
@needs_engine
def test_a_truncation_block_does_not_truncate(tok_trunc, tmp_path):
    import fastokens

    long = " ".join(CORPUS[:40])
    raw = fastokens.Tokenizer.from_file(os.path.join(tok_trunc, "tokenizer.json"))
    assert len(raw.encode(long)) == 32  # negative control: the engine as the file configures it truncates
    ref = load(tok_trunc)(long)["input_ids"]
    assert len(ref) > 32  # transformers' __call__ does not
    fast = BatchTokenizer(tok_trunc, "text")
    assert fast.fast is not None, fast.report.reason
    got = fast(pa.table({"text": [long, "short"]})).column("input_ids").to_pylist()
    assert got[0] == ref + [load(tok_trunc).eos_token_id]
    src = _jsonl(tmp_path / "long.jsonl", [{"text": long}] * 3 + [{"text": t} for t in CORPUS[:20]])
    outs = {}
    for engine in ("auto", "transformers"):
        res = pack_files(src, tmp_path / engine, 4096, tokenizer=tok_trunc, tokenizer_engine=engine)
        outs[engine] = _docs(res.out)
        assert res.stats["tokens_in"] > 3 * len(ref)
    assert outs["auto"] == outs["transformers"]


def test_the_adversarial_set_has_a_text_longer_than_8k_tokens(tok_bl):
    texts = adversarial.adversarial_texts([EOS])
    lengths = [
        len(ids) for ids in BatchTokenizer(tok_bl, "text", engine="transformers").reference_ids(texts, False)
    ]
    assert max(lengths) > 8192


# -- T1: byte-incomplete vocabularies ---------------------------------------------------------------------
def test_missing_bytes_are_found_and_counted(tok_noalpha, tok_bl):
    spec = fast_tokenize.read_spec(tok_noalpha)
    assert 9 in missing_bytes(spec)
    assert missing_bytes(fast_tokenize.read_spec(tok_bl)) == []  # control: the full alphabet
    counter = DropCounter(missing_bytes(spec), [a["content"] for a in spec["added_tokens"]])
    counter.scan(["a\tb\t", "plain", f"x{EOS}"], lambda i: f"row {i}")
    rep = counter.report()
    assert rep["chars"]["\\t"] == 2 and rep["rows"] == 1 and rep["first_rows"] == ["row 0"]


def test_byte_incomplete_tokenizer_runs_with_transformers_ids_and_reports_drops(tok_noalpha, tmp_path):
    auto = BatchTokenizer(tok_noalpha, "text")
    if fast_tokenize.engine_version() is not None:
        assert auto.fast is None and "tab" in auto.report.reason
        with pytest.raises(PackingError, match=r"no token for .*tab") as err:
            BatchTokenizer(tok_noalpha, "text", engine="fast")
        assert "tokenizer.json" in str(err.value) and err.value.param == "tokenizer_engine"
    texts = ["a\tb c", "no tabs here", "two\t\ttabs", *CORPUS[:5]]
    src = _jsonl(tmp_path / "tabs.jsonl", [{"text": t} for t in texts])
    res = pack_files(src, tmp_path / "out", 64, tokenizer=tok_noalpha)
    tok = load(tok_noalpha)
    want = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert sorted(_docs(res.out)) == sorted(want)  # transformers' ids (packing reorders the documents)
    assert "\t" not in tok.decode(tok("a\tb")["input_ids"])  # what is being reported: transformers drops it
    dropped = _manifest(res.out)["stats"]["tokenizer"]["unencodable"]
    assert dropped["chars"] == {"\\t": 3} and dropped["rows"] == 2
    assert "tabs.jsonl" in dropped["first_rows"][0] and "line 1" in dropped["first_rows"][0]
    from packtools.pipeline.summary import format_pipeline_summary

    assert "\\t" in format_pipeline_summary(res.stats, res.out)
    with pytest.raises(PackingError, match=r"line 1.*'\\t'") as err:
        pack_files(src, tmp_path / "strict", 64, tokenizer=tok_noalpha, on_unencodable="error")
    assert err.value.param == "on_unencodable"


@needs_engine
def test_an_engine_error_under_fast_names_the_row(tok_bl, monkeypatch):
    tok = BatchTokenizer(tok_bl, "text", engine="fast")
    fail_fast_engine(
        monkeypatch, lambda t: "boom" in t, ValueError, "model error: byte 0x09 has no token in vocabulary"
    )
    with pytest.raises(PackingError, match=r"row 12: the fast tokenizer engine cannot encode.*0x09"):
        tok(pa.table({"text": ["fine"] * 2 + ["boom"] + ["fine"]}), first_row=10)


@needs_engine
def test_an_engine_error_in_the_proof_falls_back_under_auto(tok_bl, monkeypatch):
    def encode(self, texts, special):
        raise ValueError("model error")

    monkeypatch.setattr(fast_tokenize.FastEncoder, "encode", encode)
    tok = BatchTokenizer(tok_bl, "text")
    assert tok.fast is None and "fails on the built-in adversarial set" in tok.report.reason
    with pytest.raises(PackingError, match="fails on the built-in adversarial set"):
        BatchTokenizer(tok_bl, "text", engine="fast")


NO_SYSTEM = (  # refuses a system turn as Gemma's official template does
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@needs_engine
def test_a_template_that_refuses_some_adversarial_conversations_keeps_the_fast_path(tmp_path):
    """The proof compares the conversations the template renders; one the template refuses fails on either path
    (a data row with a system turn: the same error).  A template that refuses them all leaves nothing to prove:
    transformers tokenizes, saying why."""
    tok = BatchTokenizer(build_tokenizer(str(tmp_path / "nosys"), chat_template=NO_SYSTEM), "messages")
    assert tok.fast is not None, tok.report.reason
    assert (
        0
        < tok.report.checked["adversarial_conversations"]
        < len(adversarial.adversarial_conversations(adversarial.adversarial_texts([EOS])))
    )
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    out = tok(pa.table({"messages": [ok]}))
    ref = load(str(tmp_path / "nosys"))
    assert out.column("input_ids").to_pylist() == [
        ref.apply_chat_template(ok, tokenize=True, return_dict=True)["input_ids"]
    ]
    with pytest.raises(PackingError, match="row 1.*System role not supported"):
        tok(pa.table({"messages": [ok, [{"role": "system", "content": "s"}, *ok]]}))
    refuse_all = "{{ raise_exception('never') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = BatchTokenizer(build_tokenizer(str(tmp_path / "none"), chat_template=refuse_all), "messages")
    assert tok.fast is None and "refuses every one" in tok.report.reason


# -- proof per column, per part, per run; counted right (U11, U12) -----------------------------------------


@needs_engine
def test_completions_get_their_own_proof(tok_bl, monkeypatch):
    corrupt_fast_engine(monkeypatch, lambda t: "zebra" in t)
    n = 600
    table = pa.table(
        {"prompt": ["question"] * n, "completion": ["a zebra answer" if i == 10 else "ok" for i in range(n)]}
    )
    tok = BatchTokenizer(tok_bl, "prompt_completion")
    out = tok(
        table
    )  # the prompts' 256 proof rows used to be all there was; row 10 of the completions is in their own
    assert tok.fast is None and "zebra" in tok.report.reason
    ref = BatchTokenizer(tok_bl, "prompt_completion", engine="transformers")(table)
    assert out.to_pydict() == ref.to_pydict()


@needs_engine
def test_rows_checked_counts_the_runs_proof_once_and_a_second_run_is_proven(tok_bl, tmp_path):
    src = tmp_path / "pc.parquet"
    rows = [{"prompt": f"q {i} " + CORPUS[i % 5], "completion": CORPUS[(i + 1) % 5]} for i in range(900)]
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=300)
    for run in ("first", "second"):  # the second run in this process gets its proof too
        res = pack_files(str(src), tmp_path / run, 128, tokenizer=tok_bl, part_rows=300, tokenizer_audit=0.0)
        checked = res.stats["tokenizer"]["checked"]
        assert res.stats["tokenizer"]["parts_by_engine"] == {res.stats["tokenizer"]["engine"]: 3}
        assert checked["proof_rows"] == checked["rows_checked"] == 2 * 256, (
            run
        )  # the run's first part x 2 columns


def test_the_audit_is_a_seeded_random_sample():
    a, b, c = Proof(0.01), Proof(0.01), Proof(0.01)
    for p, seed in ((a, "part-1"), (b, "part-1"), (c, "part-2")):
        p.start_part(seed)
        p.count("text", 256, 256)
    picks = [p.sample("text", 20_000)[0] for p in (a, b, c)]
    assert np.array_equal(picks[0], picks[1]) and not np.array_equal(picks[0], picks[2])
    assert 100 < picks[0].size < 300  # about 1% of 20,000, not every 1000th row
    assert np.diff(picks[0]).std() > 0  # not a stride
    full = Proof(1.0)
    full.count("text", 250, 250)
    rows, proof = full.sample("text", 50)  # 6 rows left of the proof, then every row audited
    assert proof == 6 and rows.tolist() == list(range(50))
    with pytest.raises(PackingError, match="tokenizer_audit"):
        Proof(1.5)


# -- S15, S16, U13: engine in every key; reports kept with staged parts --------------------------------------
def test_engine_and_version_are_in_the_fingerprint_and_stage_keys(tok_bl, tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in CORPUS[:10]])
    out = tmp_path / "out"
    first = pack_files(src, out, 64, tokenizer=tok_bl)
    again = pack_files(src, out, 64, tokenizer=tok_bl, tokenizer_engine="transformers")
    assert not again.cached and again.stats["tokenizer"]["engine"] == "transformers"
    assert pack_files(src, out, 64, tokenizer=tok_bl, tokenizer_engine="transformers").cached
    assert first.manifest["fingerprint"] != again.manifest["fingerprint"]
    part = Part(discover([src])[0])

    def key(engine, audit=0.001):
        spec = IdsSpec.of("fp", "text", True, engine, "report", audit)
        return stage_key(part, ("input_ids",), ("int32",), spec)

    keys = {key(e) for e in ("auto", "fast", "transformers")}
    assert len(keys) == 3
    assert key("auto", audit=1.0) not in keys  # U6: the audit rate decides which runs stop
    monkeypatch.setattr(fast_tokenize, "engine_version", lambda: "9.9.9")
    assert key("auto") not in keys  # another engine version


def test_a_reused_part_keeps_its_tokenizer_report(tok_bl, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in CORPUS[:10]])
    ids = IdsSpec.of(tokenizer_fingerprint(tok_bl), "text", True, "auto", "report", 0.001)
    job = StageJob(Part(discover([src])[0]), ids, ("input_ids",), ("int32",), tok_bl,
                   str(tmp_path / "s.arrow"), str(tmp_path / "s.npz"))  # fmt: skip
    done = stage_part(job)
    reused = stage_part(job)
    assert reused["reused"] and reused["tokenizer"] == done["tokenizer"]
    assert done["tokenizer"]["checked"]["rows_checked"] == 10 or done["tokenizer"]["engine"] == "transformers"


def test_a_worker_takes_the_drivers_engine(tok_bl):
    driver = {
        "engine": "transformers",
        "requested": "auto",
        "reason": "fallback: the driver said so",
        "checked": {},
    }
    worker = BatchTokenizer(tok_bl, "text", proven=driver)
    assert worker.fast is None and worker.report.reason == driver["reason"]
    if fast_tokenize.engine_version() is not None:
        proven = BatchTokenizer(tok_bl, "text").report.to_dict()
        worker = BatchTokenizer(tok_bl, "text", proven=proven)
        assert worker.fast is not None and worker.report.to_dict() == proven


# -- the lite reference: transformers' ids without importing transformers, once checked -----------------------
def test_the_lite_reference_is_used_only_after_a_recorded_check(tok_bl, tmp_path, monkeypatch):
    from packtools.pipeline.tokenizer import reference
    from packtools.pipeline.tokenizer.folder import tokenizer_fingerprint

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    table = pa.table({"text": adversarial.adversarial_texts([EOS]) + CORPUS[:5]})
    first = BatchTokenizer(tok_bl, "text")
    assert first._tok is not None and first.reference_engine == "transformers"  # no verdict yet: transformers
    second = BatchTokenizer(tok_bl, "text")
    assert second._tok is None and second.reference_engine.startswith("tokenizers")  # the recorded verdict
    assert second(table).to_pydict() == first(table).to_pydict()
    assert second.eos_id == load(tok_bl).eos_token_id
    # S5/S6: tokenizer_engine='transformers' is transformers, whatever was recorded
    asked = BatchTokenizer(tok_bl, "text", engine="transformers")
    assert asked._tok is not None and asked.reference_engine == "transformers"
    # a verdict that says "different" (or none, or another tokenizer) means transformers again
    fp = tokenizer_fingerprint(tok_bl)
    path = reference._verdict_path(fp)  # the reference loads the folder's own tokenizer.json, never a copy
    with open(path) as fh:
        verdict = json.load(fh)
    assert verdict["same"] is True
    with open(path, "w") as fh:
        json.dump({**verdict, "same": False}, fh)
    assert BatchTokenizer(tok_bl, "text")._tok is not None
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", "")
    assert reference.load_verified(tok_bl, tokenizer_fingerprint(tok_bl)) is None


def test_record_says_different_when_the_ids_differ(tok_bl, tmp_path, monkeypatch):
    from packtools.pipeline.tokenizer import reference

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    tok = load(tok_bl)

    class Shifted:  # transformers' tokenizer with other ids: the check must see it
        eos_token_id = tok.eos_token_id

        def __call__(self, texts, add_special_tokens=True):
            ids = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
            return {"input_ids": [[i + 1 for i in row] for row in ids]}

    assert reference.record(tok_bl, "fp-x", tok, CORPUS[:5]) is True
    assert reference.record(tok_bl, "fp-y", Shifted(), CORPUS[:5]) is False
    assert (
        reference.load_verified(tok_bl, "fp-y") is None
        and reference.load_verified(tok_bl, "fp-x") is not None
    )


@needs_engine
def test_a_fallback_on_the_proof_holds_for_the_rest_of_the_run(tok_bl, tmp_path, monkeypatch):
    """The run's later part has no proof rows of its own: after the first part's proof failed it stays on
    transformers (the fast engine proved wrong on this data), and the output is transformers'."""
    corrupt_fast_engine(monkeypatch, lambda t: "zebra" in t)
    src = tmp_path / "two.parquet"
    texts = ["a zebra crossing"] + CORPUS[:99] + CORPUS[:100]
    pq.write_table(pa.table({"text": texts}), src, row_group_size=100)
    res = pack_files(str(src), tmp_path / "out", 64, tokenizer=tok_bl, part_rows=100)
    engines = res.stats["tokenizer"]["parts_by_engine"]
    assert engines == {"transformers": 2}, engines
    assert "zebra" in res.stats["tokenizer"]["reason"]
    ref = pack_files(
        str(src), tmp_path / "ref", 64, tokenizer=tok_bl, part_rows=100, tokenizer_engine="transformers"
    )
    assert sorted(_docs(res.out)) == sorted(_docs(ref.out))


@needs_engine
def test_a_part_takes_the_drivers_verdict_and_an_audited_difference_is_raised_not_kept(tok_bl, monkeypatch):
    """With a verdict (packtools.pipeline.tokenizer.verdict) a part is tokenized by exactly its engine, whatever the
    process tokenized before, and has no proof rows of its own; a difference the audit finds raises
    EngineDivergence (the driver restages the run), never a part-local fallback.  Without a verdict the part
    proves the engine on its own first rows."""
    from packtools.pipeline.tokenizer.proof import EngineDivergence

    monkeypatch.setattr(fast_tokenize, "PROOF_ROWS", 5)  # a part's proof: the first 5 rows of the column
    corrupt_fast_engine(monkeypatch, lambda t: "zebra" in t)
    tok = BatchTokenizer(tok_bl, "text", audit_rate=1.0)
    ref = BatchTokenizer(tok_bl, "text", engine="transformers")
    with_zebra = pa.table({"text": ["a zebra"] + CORPUS[:4]})
    clean = pa.table({"text": CORPUS[:5]})
    fast_verdict = tok.report.to_dict()
    assert fast_verdict["engine"].startswith("fastokens")
    fell_back = {**fast_verdict, "engine": "transformers", "reason": "fallback: the driver's proof"}
    tok.start_part("p1", verdict=fell_back)
    assert tok.fast is None and tok(with_zebra).equals(ref(with_zebra))
    assert tok.part_report()["engine"] == "transformers"
    tok.start_part("p2", verdict=fast_verdict)  # the same process, a part under the fast verdict
    assert tok.fast is not None and tok(clean).equals(ref(clean))
    assert tok.part_report()["checked"]["proof_rows"] == 0  # the driver proved; the part is audited
    assert tok.part_report()["checked"]["rows_checked"] == 5
    with pytest.raises(EngineDivergence, match="zebra") as err:
        tok(with_zebra)
    assert "zebra" in pickle.loads(pickle.dumps(err.value)).what  # it reaches the driver from a pool worker
    tok.start_part("p3")  # no verdict (a BatchTokenizer used directly): the part proves on its first rows
    assert tok(with_zebra).equals(ref(with_zebra)) and tok.fast is None


def test_profile_then_pack_keeps_the_characters_left_out(tok_noalpha, tmp_path, monkeypatch):
    """S1: a part adopted from the stage cache keeps its engine report, the characters left out included."""
    from packtools.pipeline.profile import profile_files

    monkeypatch.setenv("PACKTOOLS_STAGE_CACHE", str(tmp_path / "cache"))
    src = _jsonl(tmp_path / "tabs.jsonl", [{"text": f"hello\tworld {i}"} for i in range(50)])
    alone = pack_files(src, tmp_path / "alone", 64, tokenizer=tok_noalpha)
    assert alone.stats["tokenizer"]["unencodable"]["count"] >= 50  # a tab a row, at least
    profile_files(src, tok_noalpha)
    after = pack_files(src, tmp_path / "after", 64, tokenizer=tok_noalpha)
    assert after.timings["parts_from_stage_cache"] == 1
    assert after.stats["tokenizer"] == alone.stats["tokenizer"]
