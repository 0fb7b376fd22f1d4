"""Real vocabularies (Llama 3, Qwen 3; built from the rank files quicktok-v1 ships, see ``_real_vocab``): the
ids packtools writes equal transformers' on a generated multilingual adversarial corpus, and chat labels equal
the ``{% generation %}`` masks of tagged copies of five template families."""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version

import numpy as np
import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow  # real vocabularies (128k-151k tokens): slow to build and tokenize; in .ci/run, not in the README's quick command

pytest.importorskip("quicktok")
pytest.importorskip("transformers")
import _real_vocab  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from packtools.pipeline.tokenizer import fast as fast_tokenize  # noqa: E402
from packtools.pipeline.tokenizer.batch import BatchTokenizer  # noqa: E402

needs_engine = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")


@pytest.fixture(scope="session")
def vocab(request, tmp_path_factory):
    """name -> folder; built once and kept in pytest's cache, keyed by the quicktok version and the build
    (in a temporary folder when the cache plugin is off, ``-p no:cacheprovider``)."""
    key = f"packtools-vocab-{version('quicktok-v1')}-{_real_vocab.BUILD_VERSION}"
    cache = getattr(request.config, "cache", None)
    root = str(cache.mkdir(key)) if cache is not None else str(tmp_path_factory.mktemp(key))
    built = {}

    def get(name: str) -> str:
        if name not in built:
            path = os.path.join(root, name)
            if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
                tmp = path + f".tmp-{os.getpid()}"
                _real_vocab.build(name, tmp)
                try:
                    os.replace(tmp, path)
                except OSError:  # the other xdist worker built it first (a folder replaces only an empty one)
                    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
                        raise
                    shutil.rmtree(tmp)
            built[name] = path
        return built[name]

    return get


def with_template(base: str, template: str, path: str) -> str:
    """A tokenizer folder that is ``base`` (linked) with ``template`` as its chat template."""
    os.makedirs(path)
    for name in os.listdir(base):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(base, name), os.path.join(path, name))
    with open(os.path.join(path, "chat_template.jinja"), "w") as fh:
        fh.write(template)
    return path


@needs_engine
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_text_ids_equal_transformers_on_a_multilingual_corpus(vocab, name):
    path = vocab(name)
    ref = AutoTokenizer.from_pretrained(path)
    texts = _real_vocab.corpus(1500, seed=1, specials=tuple(ref.all_special_tokens[:12]))
    tok = BatchTokenizer(path, "text", audit_rate=1.0)  # every row compared as well
    assert tok.report.engine.startswith("fastokens"), tok.report.reason
    got = tok(pa.table({"text": texts})).column("input_ids").to_pylist()
    eos = ref.eos_token_id  # packtools appends EOS unless the ids already end with it
    want = [ids if ids and ids[-1] == eos else ids + [eos] for ids in ref(texts)["input_ids"]]
    assert got == want
    assert tok.fast is not None and tok.part_report()["checked"]["rows_checked"] == len(texts)
    assert max(len(r) for r in got) > 100 and any(ref.eos_token_id in r[:-1] for r in got)  # long and special


CHAT_CASES = [("llama3", "llama3"), ("qwen3-think", "qwen3"), ("mistral", "llama3"), ("gemma", "llama3"),
              ("phi", "llama3"), ("llama3-official", "llama3"), ("gemma-official", "llama3")]  # fmt: skip


@pytest.mark.parametrize(("template", "name"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_labels_equal_generation_masks_of_a_tagged_copy(vocab, tmp_path, template, name):
    import unicodedata

    plain, tagged = {**_real_vocab.TEMPLATES, **_real_vocab.OFFICIAL}[template]
    base = vocab(name)
    plain_dir = with_template(base, plain, str(tmp_path / "plain"))
    tagged_dir = with_template(base, tagged, str(tmp_path / "tagged"))
    raw = _real_vocab.conversations(_real_vocab.corpus(240, seed=2), seed=3)
    if template == "gemma-official":  # it refuses system turns (raise_exception)
        raw = [[m for m in c if m["role"] != "system"] for c in raw]
    nfc = [[{k: unicodedata.normalize("NFC", v) for k, v in m.items()} for m in c] for c in raw]
    assert nfc != raw  # the corpus has text NFC changes
    tok = BatchTokenizer(plain_dir, "messages")
    ref_tok = AutoTokenizer.from_pretrained(tagged_dir)
    engine = fast_tokenize.engine_version() is not None
    if engine:  # chat on the fast path, Qwen's NFC normalizer too
        assert tok.report.engine.startswith("fastokens"), tok.report.reason
    for convs in (nfc, raw):
        out = tok(pa.Table.from_pylist([{"messages": c} for c in convs]))
        ref = ref_tok.apply_chat_template(
            convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert out.column("input_ids").to_pylist() == ref["input_ids"]
        want = [
            np.where(np.asarray(m) == 1, i, -100).tolist()
            for i, m in zip(ref["input_ids"], ref["assistant_masks"])
        ]
        assert out.column("labels").to_pylist() == want
        assert all(any(x != -100 for x in row) for row in want)  # every conversation has assistant tokens
        assert (
            "one render per conversation" in tok.chat.render_engine
        )  # (packtools.pipeline.tokenizer.chat.local)
        on_transformers = tok.part_report()["checked"].get("batches_on_transformers", 0)
        if engine and convs is nfc:
            assert tok.fast is not None and on_transformers == 0  # NFC text: the fast path all the way
    if engine and name == "qwen3":
        assert on_transformers == 1  # the text NFC changes went to transformers (offsets would not follow it)


@needs_engine
def test_a_warm_cli_run_exits_cleanly_while_the_engine_still_loads(vocab, tmp_path):
    """A warm run of a large vocabulary on an input just over SMALL_INPUT_BYTES in one batch tokenizes it on the
    reference while the fast engine is still loading in its thread, and finishes first.  The process must still
    exit 0: with the load in a daemon thread, the interpreter's exit killed it inside the native load and the
    process aborted ("FATAL: exception not rethrown", status 134) after writing its output, on every warm run
    (negative control: daemon=True).  A one-document input starts no load at all (the reference alone), says so,
    and the summary says when the first part was ready."""
    import subprocess
    import sys

    from packtools.pipeline.tokenizer.load import SMALL_INPUT_BYTES

    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "one short document"}\n')
    big = tmp_path / "big.jsonl"
    doc = json.dumps({"text": "word " * 3000}) + "\n"
    big.write_text(doc * (SMALL_INPUT_BYTES // len(doc) + 2))  # one JSON block, one batch
    env = {**os.environ, "PACKTOOLS_CACHE_DIR": str(tmp_path / "cache")}
    for run in ["cold", "second"] + [f"warm-{i}" for i in range(4)]:  # the abort hit 3 of 5 warm runs
        for src in (one, big):
            out = tmp_path / f"out-{run}-{src.stem}"
            cmd = [sys.executable, "-m", "packtools.cli", "pack", str(src), "--tokenizer", vocab("llama3")]
            proc = subprocess.run(
                [*cmd, "--out", str(out), "--max-length", "64"], env=env, capture_output=True, text=True
            )
            assert proc.returncode == 0, (run, proc.returncode, proc.stderr[-500:])
            assert (out / "manifest.json").is_file()
            summary = " ".join(proc.stdout.split())
            assert "first part staged" in summary and "s after the process started" in summary
            small = "smaller than 4 MiB" in summary and "the fast engine is not loaded" in summary
            assert small is (src is one), summary
