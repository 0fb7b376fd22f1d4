"""The compatibility matrix (benchmarks/model_matrix.py): no cell silently wrong, and docs/models.md is its output.

The fast subset (Llama, GPT-2, Falcon-H1 with sdpa and eager) runs by default; the whole matrix (15
architectures x sdpa, eager, flex_attention, under a minute on one core) is marked slow.
"""

from pathlib import Path

import pytest
from _hf_models import model_matrix

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"


matrix = model_matrix()


def check_against_doc(cells):
    documented = matrix.parse_table(DOC.read_text())
    for cell in cells:
        assert not cell.silent, cell.detail
        assert documented[(cell.arch, cell.backend)] == (cell.status, cell.needs), (cell.arch, cell.backend)


def test_fast_subset_matches_the_document():
    archs = [a for a in matrix.ARCHS if a.name in matrix.FAST]
    cells = matrix.run_matrix(archs, ("sdpa", "eager"))
    by_key = {(c.arch, c.backend): c for c in cells}
    assert by_key[("Llama", "sdpa")].status == "exact" and by_key[("Llama", "sdpa")].max_diff < 1e-5
    assert by_key[("GPT-2", "eager")].needs == "position_ids"
    assert by_key[("Falcon-H1", "sdpa")].status == "refused"
    assert "leak" in by_key[("Falcon-H1", "sdpa")].detail and "mamba" in by_key[("Falcon-H1", "sdpa")].detail
    check_against_doc(cells)


def test_document_covers_the_required_architectures():
    documented = matrix.parse_table(DOC.read_text())
    archs = {a for a, _ in documented}
    assert len(archs) >= 12 and {"Llama", "Mistral", "Qwen3-MoE", "Gemma 3", "GPT-2", "Falcon-H1"} <= archs
    assert {b for _, b in documented} >= {"sdpa", "eager", "flex_attention"}
    assert all(result in ("exact", "exact (forward)", "refused", "n/a") for result, _ in documented.values())


def test_markdown_round_trips_through_parse_table():
    cells = [matrix.Cell("Llama", "sdpa", "exact", "position_ids", 1e-7, "a | b")]
    text = matrix.markdown(cells, matrix.ARCHS)
    assert matrix.parse_table(text) == {("Llama", "sdpa"): ("exact", "position_ids")}


def test_main_writes_the_document(tmp_path, capsys):
    out = tmp_path / "models.md"
    assert matrix.main(["--archs", "Llama", "--backends", "eager", "--write", str(out)]) == 0
    assert matrix.parse_table(out.read_text()) == {("Llama", "eager"): ("exact", "position_ids")}
    assert "Llama" in capsys.readouterr().out


@pytest.mark.slow
def test_whole_matrix_matches_the_document():
    cells = matrix.run_matrix(matrix.ARCHS, matrix.BACKENDS)
    assert len(cells) == len(matrix.ARCHS) * len(matrix.BACKENDS)
    check_against_doc(cells)
    assert len(matrix.parse_table(DOC.read_text())) == len(cells)
