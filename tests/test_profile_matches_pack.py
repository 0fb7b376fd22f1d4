"""``packtools profile`` says what ``pack`` would do (adversarial 2026-12c, "Unclear"): with ``--context-parallel N``
it refuses the ``--max-length`` pack refuses and audits the rows pack writes (planned at CP-padded lengths), and
characters the tokenizer cannot encode are reported as pack reports them."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools.cli.main import main
from packtools.core.cp_budget import plan_for_cp
from packtools.core.plan import plan
from packtools.profiling.cp_audit import audit_plan


@pytest.fixture
def tokenized(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 120, 300)
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [list(range(1, n + 1)) for n in lengths]}), path)
    return str(path), lengths


def test_profile_refuses_the_max_length_pack_refuses_for_cp(tokenized, tmp_path, capsys):
    path, _ = tokenized
    assert main(["profile", path, "--context-parallel", "3", "--max-length", "128"]) == 1
    err = capsys.readouterr().err
    assert "error (--max-length)" in err and "multiple of 6" in err
    assert (
        main(["pack", path, "--out", str(tmp_path / "o"), "--max-length", "128", "--context-parallel", "3"])
        == 1
    )
    assert "multiple of 6" in capsys.readouterr().err


def test_profile_cp_audit_is_on_the_rows_pack_writes(tokenized, capsys):
    path, lengths = tokenized
    assert (
        main(["profile", path, "--context-parallel", "2", "--max-length", "128", "--candidates", "128"]) == 0
    )
    out = capsys.readouterr().out
    strategy = next(s for s in ("bfd_split", "bfd", "wrapped") if f"rows packed with {s} " in out)
    budgeted = audit_plan(plan_for_cp(lengths, 128, strategy, 2), 2).to_text()
    plain = audit_plan(plan(lengths, 128, strategy), 2).to_text()
    assert budgeted != plain  # the negative control: the plain plan's audit reads otherwise
    assert budgeted in out and plain not in out


def test_profile_reports_unencodable_characters_like_pack(tmp_path, capsys):
    pytest.importorskip("transformers")
    from _pipeline_data import CORPUS, EOS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())  # trained without the byte alphabet: no token for a tab
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(tmp_path / "tok")
    src = tmp_path / "tabs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a\tb c", "no tabs here", "two\t\ttabs"]))
    argv = [str(src), "--tokenizer", str(tmp_path / "tok")]
    assert main(["profile", *argv, "--no-stage-cache"]) == 0
    profiled = capsys.readouterr().out
    assert main(["pack", *argv, "--out", str(tmp_path / "o"), "--max-length", "64"]) == 0
    packed = capsys.readouterr().out
    said = "3 characters in 2 rows left out of the ids"
    assert said in packed and said in profiled
    assert "'\\t' x3" in profiled and "tabs.jsonl' line 1" in profiled
