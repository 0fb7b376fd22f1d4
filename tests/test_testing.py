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
    assert out.split() == ["28", "[]"]


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
