"""``packtools demo``: profile, recommendation, three strategies, plot and packed folder on the stdlib corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packtools.cli.main import main
from packtools.pipeline.demo import run_demo, stdlib_definitions
from packtools.pipeline.sample import byte_level_table, stdlib_files


def test_definitions_cut_sources_before_each_def():
    pieces = stdlib_definitions(limit=5)
    assert len(pieces) > 5
    joined = b"".join(pieces)
    assert len(joined) == sum(os.path.getsize(p) for p in stdlib_files(5))
    starts = (b"def ", b"class ", b"async def ", b"    def ", b"    class ", b"    async def ")
    assert sum(not p.startswith(starts) for p in pieces) <= 5  # only each file's header
    table = byte_level_table(pieces)
    assert table.num_rows == len(pieces)
    assert bytes(table.column("input_ids")[0].values.to_numpy().astype("uint8")) == pieces[0]


@pytest.mark.slow
def test_demo_small_corpus(tmp_path):
    pytest.importorskip("datasets")
    lines: list[str] = []
    out = str(tmp_path / "demo")
    result = run_demo(out, limit=20, echo=lines.append, quiet=True)
    text = "\n".join(lines)
    assert "percentiles:" in text and "recommended: max_length=" in text
    assert "both rules (* = recommended):" in text and "kernels compiled or loaded in" in text
    for strategy in ("bfd", "bfd_split", "wrapped"):
        assert strategy in text
    assert [p.strategy for p in result["plans"]] == ["bfd", "bfd_split", "wrapped"]
    assert result["max_length"] == result["recommendation"].max_length
    if result["plot"] is not None:
        assert os.path.getsize(result["plot"]) > 1000
    import datasets

    ds = datasets.load_from_disk(os.path.join(out, "packed"))
    split = result["plans"][1]  # the demo packs with bfd_split by default: every token kept
    assert ds.num_rows == split.num_rows and split.tokens_dropped == 0
    assert sum(map(sum, ds["seq_lengths"])) == split.tokens_in
    rec = result["recommendation"]  # bfd_split: the length that holds 99% of the sequences whole
    assert rec.keep_sequences == 0.99 and rec.truncated_share <= 0.01
    assert rec.max_length == result["profile"].recommend(keep_sequences=0.99).max_length
    again = run_demo(out, limit=20, echo=lines.append, quiet=True)
    assert again["packed"].cached
    lines.clear()
    bfd = run_demo(str(tmp_path / "bfd"), limit=20, echo=lines.append, quiet=True, strategy="bfd")
    assert bfd["recommendation"].keep_tokens == 0.99  # bfd: the token rule
    dropped = bfd["packed"].stats["tokens_dropped"]
    assert dropped == bfd["plans"][0].tokens_dropped
    assert (f"dropped {dropped:,} tokens" in "\n".join(lines)) == (dropped > 0)


@pytest.mark.slow
def test_demo_command_full_corpus(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "recommended: max_length=" in out and "packed dataset" in out
    assert os.path.isfile(tmp_path / "d" / "packed" / "manifest.json")


def test_demo_writes_to_a_temporary_folder_by_default(monkeypatch, tmp_path):
    import tempfile

    import packtools.pipeline.demo as demo

    seen = {}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: seen.setdefault("out", out))
    assert main(["demo", "--quiet"]) == 0
    assert seen["out"] == str(tmp_path / "packtools-demo")  # not the working directory (a clone)
    ignored = (Path(__file__).parents[1] / ".gitignore").read_text().split()
    assert "packtools-demo/" in ignored  # and a named ./packtools-demo stays out of git


def test_demo_rerun_with_another_tokenizer_tokenizes_again(tmp_path):
    """A second demo into the same --out with another tokenizer packs that tokenizer's ids (the corpus kept by
    the first run was reused whatever the tokenizer: the packed rows held the first tokenizer's ids)."""
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from packtools.testing import TOKENIZER_CORPUS, tiny_tokenizer

    first = tiny_tokenizer(str(tmp_path / "tok400"))  # 378 ids
    pre = tokenizers.pre_tokenizers.ByteLevel
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = pre(add_prefix_space=False)
    bpe.train_from_iterator(
        TOKENIZER_CORPUS,
        tokenizers.trainers.BpeTrainer(
            vocab_size=280, special_tokens=["<eos>"], initial_alphabet=pre.alphabet(), show_progress=False
        ),
    )
    second = str(tmp_path / "tok280")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(second)
    out = str(tmp_path / "demo")
    for tok in (first, second):
        run_demo(out, tokenizer=tok, limit=2, echo=lambda _: None, quiet=True)
    ids = datasets.load_from_disk(os.path.join(out, "packed"))["input_ids"]
    assert max(map(max, ids)) < 280  # the second tokenizer's ids only
    tok = transformers.AutoTokenizer.from_pretrained(second)
    expected = sum(len(tok(t.decode())["input_ids"]) + 1 for t in stdlib_definitions(limit=2))  # + EOS
    assert sum(map(len, ids)) == expected


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--keep", "0"], "--keep"), (["--keep", "1.5"], "--keep"), (["--max-length", "0"], "--max-length")],
)
def test_demo_flags_are_checked_first_in_their_own_names(tmp_path, capsys, monkeypatch, argv, flag):
    """--keep 0 was refused as '--keep-sequences' (a flag the demo does not have), and --max-length 0 only after
    the corpus was built and profiled."""
    import packtools.pipeline.demo as demo

    monkeypatch.setattr(demo, "stdlib_definitions", lambda limit=None: pytest.fail("built the corpus first"))
    assert main(["demo", "--out", str(tmp_path / "d"), "--quiet", *argv]) == 1
    err = capsys.readouterr().err
    assert f"error ({flag}):" in err and "--keep-sequences" not in err, err


def test_demo_corpus_is_tokenized_again_when_what_decides_the_ids_changes(tmp_path, monkeypatch):
    """The kept corpus was named by the tokenizer's files alone: after an upgrade of transformers/tokenizers (or a
    change to packtools' tokenizing code or the fast engine) a rerun packed the ids tokenized before.  It is named
    by what decides the ids in any run (IdsSpec: libraries, engine, code), as the stage cache is."""
    pytest.importorskip("transformers")
    import packtools.pipeline.demo as demo
    import packtools.pipeline.tokenizer.spec as spec
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    built = []
    real = demo.tokenized_table
    monkeypatch.setattr(demo, "tokenized_table", lambda *a, **k: built.append(1) or real(*a, **k))
    out = str(tmp_path / "demo")
    for _ in range(2):
        run_demo(out, tokenizer=tok, limit=1, echo=lambda _: None, quiet=True)
    assert len(built) == 1  # the same ids: kept
    versions = spec.library_versions()
    monkeypatch.setattr(spec, "library_versions", lambda: (*versions, ("tokenizers-upgraded", "9")))
    run_demo(out, tokenizer=tok, limit=1, echo=lambda _: None, quiet=True)
    assert len(built) == 2
