"""packtools.testing: the tiny models of the verified families -- light to import, reproducible by seed, refused by
name when unknown, the table benchmarks/model_matrix.py reports on, and docs/training.md's example runs as
written.  Its tokenizer and conversations are run by its doctests (tests/test_docs.py) and by the pipeline tests
(tests/_pipeline_data.py, tests/test_turn_split_questions.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from packtools import PackingError

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def test_import_is_light():
    code = (
        "import sys, packtools.testing as t; print(len(t.FAMILIES), "
        "sorted(m for m in ('torch', 'transformers', 'tokenizers', 'packtools.integrations') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["32", "[]"]


def test_unknown_family_is_refused_with_the_names():
    from packtools.testing import family

    with pytest.raises(PackingError, match=r"family='Lama'.*Llama, Mistral, Qwen2") as err:
        family("Lama")
    assert err.value.param == "family"


def test_same_seed_same_weights_other_seed_other_weights():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from packtools.testing import tiny_model

    a, b, c = tiny_model("Qwen3"), tiny_model("Qwen3"), tiny_model("Qwen3", seed=1)
    weights = [m.model.embed_tokens.weight for m in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert a.dtype == torch.float32 and a.config._attn_implementation == "sdpa"


def test_packtools_sdpa_is_registered_for_the_model():
    pytest.importorskip("transformers")
    from packtools.testing import tiny_model

    model = tiny_model("Llama", "packtools_sdpa")
    assert model.config._attn_implementation == "packtools_sdpa"


def test_the_matrix_reports_on_this_table():
    from _scripts import script

    from packtools import testing

    matrix = script("model_matrix")
    assert matrix.FAMILIES is testing.FAMILIES and set(matrix.FAST) <= {f.name for f in testing.FAMILIES}


def test_the_training_page_example_runs(tmp_path, monkeypatch, capsys):
    """docs/training.md's tiny-model block, as written: a prepared Trainer (its isolation probe included) trains two
    steps of a tiny Qwen3 on packed rows."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    section = DOC.read_text().split("### Your setup on a tiny model of your family first")[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(block, "docs/training.md (packtools.testing)", "exec"), namespace)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2"
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and type(trainer.model).__name__ == "Qwen3ForCausalLM"
    assert sum(len(r) for r in namespace["packed"]["seq_lengths"]) == 8  # every sequence packed, none dropped


def test_unknown_vocabulary_and_vl_family_are_refused_by_name():
    from packtools.testing import real_tokenizer, tiny_vl_config

    with pytest.raises(PackingError, match=r"vocab='gpt2'.*llama3, qwen3, o200k") as err:
        real_tokenizer("gpt2", "unused")
    assert err.value.param == "vocab"
    with pytest.raises(PackingError, match=r"family='llava'.*qwen2_vl, qwen2_5_vl, qwen3_vl") as err:
        tiny_vl_config("llava")
    assert err.value.param == "family"


def test_real_tokenizer_without_quicktok_names_the_package_and_the_extra(monkeypatch):
    from packtools.testing import real_tokenizer

    monkeypatch.setitem(sys.modules, "quicktok", None)  # as if not installed
    with pytest.raises(ImportError, match=r"'quicktok-v1'.*packtools\[testing\]"):
        real_tokenizer("llama3", "unused")


def test_tiktoken_ranks_are_converted_in_memory_with_the_specials_after_them():
    pytest.importorskip("transformers")
    from packtools.compat.transformers import tiktoken_tokenizer

    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b" ab": 257}
    tok = tiktoken_tokenizer(ranks, ["<|end|>"], r" ?\w+|\s+")
    assert tok.encode("ab ab<|end|>", add_special_tokens=False).ids == [256, 257, 258]
    assert tok.token_to_id("<|end|>") == 258


def test_a_converter_without_the_checked_keyword_is_refused(monkeypatch):
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    from packtools.compat.transformers import tiktoken_tokenizer

    class Older:  # transformers 4's keyword for the special tokens
        def __init__(self, vocab_file=None, pattern="", additional_special_tokens=None): ...

        @staticmethod
        def load_tiktoken_bpe(_url): ...

    monkeypatch.setattr(convert, "TikTokenConverter", Older)
    with pytest.raises(PackingError, match=r"TikTokenConverter\(extra_special_tokens=...\).*checked against"):
        tiktoken_tokenizer({b"a": 0}, [], r"\w+")


def test_tiny_vl_models_same_seed_same_weights_and_the_processor_ids_match(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from packtools.testing import IMAGE, VISION_END, VL_FAMILIES, tiny_processor, tiny_vl_model

    for name in VL_FAMILIES:
        a, b = tiny_vl_model(name), tiny_vl_model(name)
        c = tiny_vl_model(name, seed=1)
        assert a.config.image_token_id == IMAGE and a.config.vision_end_token_id == VISION_END
        pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
        assert all(torch.equal(pa[k], pb[k]) for k in pa) and not all(torch.equal(pa[k], pc[k]) for k in pa)
        assert (
            a.config.text_config._attn_implementation == a.config.vision_config._attn_implementation == "sdpa"
        )
    tok = transformers.AutoTokenizer.from_pretrained(tiny_processor(str(tmp_path)))
    assert tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_end|>"]) == [IMAGE, VISION_END]
