"""Options that cannot change anything for the command or the data are refused by name (adversarial 2026-12c,
"Unclear"), as the ``--processor`` path refuses its unused options: a user who gave one expected an effect.

Refused before any work from the command line alone: ``--split-at tokens`` without ``bfd_split``, ``--seed``
without ``--shuffle``, ``--workers`` with ``--executor local``, ``--address`` without Ray.  Refused once the
data's format is known (before tokenizing): ``--keep-unlabeled`` / ``--drop-unlabeled`` on text,
``--max-prompt-length`` on anything but preference pairs, ``--tokenizer`` with tokenized input.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.pipeline import pack_files

pytest.importorskip("transformers")
from _pipeline_data import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    tok = build_tokenizer(str(d / "tok"))
    text = d / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"packing sequences {i}"}) + "\n" for i in range(6)))
    tokenized = d / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [list(range(1, n)) for n in (3, 12, 5, 20)]}), tokenized)
    return {"tok": tok, "text": str(text), "tokenized": str(tokenized)}


def pack(capsys, *argv) -> tuple[int, str]:
    code = main(["pack", *argv, "--max-length", "32", "--quiet"])
    return code, capsys.readouterr().err


CASES = [
    ("text", ["--tokenizer", "{tok}", "--split-at", "tokens"], "error (--split-at): --split-at 'tokens' with strategy='bfd'"),
    ("text", ["--tokenizer", "{tok}", "--seed", "3"], "error (--seed): --seed 3 without --shuffle"),
    ("text", ["--tokenizer", "{tok}", "--workers", "4"], "error (--workers): --workers 4 with --executor 'local'"),
    ("text", ["--tokenizer", "{tok}", "--address", "ray://x:1"], "error (--address): --address 'ray://x:1' with --executor 'local'"),
    ("text", ["--tokenizer", "{tok}", "--keep-unlabeled"], "error (--drop-unlabeled): --keep-unlabeled on text data"),
    ("text", ["--tokenizer", "{tok}", "--drop-unlabeled"], "error (--drop-unlabeled): --drop-unlabeled on text data"),
    ("text", ["--tokenizer", "{tok}", "--max-prompt-length", "8"], "error (--max-prompt-length): --max-prompt-length 8 on text data"),
    ("tokenized", ["--tokenizer", "{tok}"], "error (--tokenizer): --tokenizer '"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "extra", "said"), CASES)
def test_an_option_without_effect_is_refused_by_name(inputs, tmp_path, capsys, data, extra, said):
    argv = [inputs[data], "--out", str(tmp_path / "out"), *(a.format(**inputs) for a in extra)]
    code, err = pack(capsys, *argv)
    assert code == 1 and said in err, err
    assert "would change nothing" in err or "never used" in err
    assert not (tmp_path / "out").exists()


def test_the_same_options_where_they_act_are_accepted(inputs, tmp_path, capsys):
    tok = inputs["tok"]
    ok = [
        [inputs["text"], "--tokenizer", tok, "--strategy", "bfd_split", "--split-at", "tokens"],
        [inputs["text"], "--tokenizer", tok, "--shuffle", "--seed", "3"],
        [inputs["tokenized"], "--drop-unlabeled"],  # tokenized rows may carry labels
        [inputs["tokenized"]],
    ]
    for i, argv in enumerate(ok):
        code, err = pack(capsys, *argv, "--out", str(tmp_path / f"out{i}"))
        assert code == 0, err


def test_the_api_refuses_them_too(inputs, tmp_path):
    with pytest.raises(PackingError, match="tokenizer=.* with tokenized data") as err:
        pack_files(inputs["tokenized"], str(tmp_path / "o"), 32, tokenizer=inputs["tok"])
    assert err.value.param == "tokenizer"
    with pytest.raises(PackingError, match="workers=2 with executor='local'"):
        pack_files(inputs["tokenized"], str(tmp_path / "o"), 32, workers=2)


def test_a_bad_max_length_or_workers_names_its_flag(inputs, tmp_path, capsys):
    """Both were refused without the flag's name (the library's ``max_length`` / ``workers=0`` words only)."""
    out = str(tmp_path / "out")
    code = main(["pack", inputs["tokenized"], "--out", out, "--max-length", "0", "--quiet"])
    assert code == 1 and "error (--max-length): max_length must be >= 1" in capsys.readouterr().err
    code = main(
        [
            "pack",
            inputs["tokenized"],
            "--out",
            out,
            "--max-length",
            "32",
            "--executor",
            "pool",
            "--workers",
            "0",
        ]
    )
    assert code == 1 and "error (--workers): --workers 0 must be a positive int" in capsys.readouterr().err
    assert not os.path.exists(out)
