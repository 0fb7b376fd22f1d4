"""The compatibility matrix (benchmarks/model_matrix.py): no cell silently wrong, and docs/models.md is its output.

The fast subset (Llama, GPT-2, Falcon-H1, Qwen3.5, GPT-OSS with sdpa and eager) runs by default; the whole
matrix (28 architectures x sdpa, eager, flex_attention, packtools_sdpa, a few minutes on one core, flex_attention's
compilation most of it) is marked slow.
"""

from pathlib import Path

import pytest
from _scripts import script

from packtools.testing import FAMILIES

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"


matrix = script("model_matrix")  # the program under test


#: The families issue 39 names: each exact on sdpa, eager and packtools_sdpa (where transformers offers them).
FAMILIES_2026 = (
    "Qwen3.5",
    "Qwen3.5-MoE",
    "LFM2",
    "Nemotron-H",
    "Kimi Linear",
    "GPT-OSS",
    "Gemma 4",
    "Llama 4",
    "DeepSeek V3",
    "OLMo 3",
    "SmolLM3",
    "Seed-OSS",
    "GLM-4.5 MoE",
)


def check_against_doc(cells):
    documented = matrix.parse_table(DOC.read_text())
    for cell in cells:
        assert not cell.silent, cell.detail
        want = (cell.status, cell.needs, cell.dpo.split(" ")[0])
        assert documented[(cell.arch, cell.backend)] == want, (cell.arch, cell.backend)


def test_fast_subset_matches_the_document():
    archs = [a for a in FAMILIES if a.name in matrix.FAST]
    cells = matrix.run_matrix(archs, ("sdpa", "eager"))
    by_key = {(c.arch, c.backend): c for c in cells}
    assert by_key[("Llama", "sdpa")].status == "exact" and by_key[("Llama", "sdpa")].max_diff < 1e-5
    assert by_key[("GPT-2", "eager")].needs == "position_ids"
    for key in (
        ("Falcon-H1", "sdpa"),
        ("Qwen3.5", "eager"),
        ("GPT-OSS", "eager"),
    ):  # mixers / masks per document
        cell = by_key[key]
        assert (cell.status, cell.needs, cell.dpo) == ("exact", "position_ids", "exact"), key
        assert cell.max_diff < 1e-5 and cell.dpo_diff < 1e-5
    assert by_key[("GPT-OSS", "sdpa")].status == "n/a"  # transformers offers GPT-OSS no sdpa
    check_against_doc(cells)


def test_document_covers_the_required_architectures():
    documented = matrix.parse_table(DOC.read_text())
    archs = {a for a, _ in documented}
    assert len(archs) >= 28 and {"Llama", "Mistral", "Qwen3-MoE", "Gemma 3", "GPT-2", "Falcon-H1"} <= archs
    assert set(FAMILIES_2026) <= archs
    assert {b for _, b in documented} >= {"sdpa", "eager", "flex_attention", "packtools_sdpa"}
    assert all(
        result in ("exact", "exact (forward)", "refused", "n/a") for result, _, _ in documented.values()
    )
    assert all(dpo in ("exact", "refused", "n/a", "") for _, _, dpo in documented.values())


def test_no_family_is_refused_for_a_leak():
    """Every cell of the 2026 families on sdpa, eager and packtools_sdpa is exact (SFT and DPO) or not offered by
    transformers on the CPU; none is refused."""
    documented = matrix.parse_table(DOC.read_text())
    for family in FAMILIES_2026:
        for backend in ("sdpa", "eager", "packtools_sdpa"):
            result, needs, dpo = documented[(family, backend)]
            assert result in ("exact", "n/a"), (family, backend, result)
            assert result == "n/a" or needs == "position_ids", (family, backend)
            assert dpo in ("exact", "") or (family, dpo) == ("Llama 4", "refused"), (family, backend, dpo)
        assert any(documented[(family, b)][0] == "exact" for b in ("sdpa", "eager")), family
    assert not [k for k, v in documented.items() if v[0] == "refused"]
    # Llama 4's DPO is refused by name, not for a leak: TRL's fused head finds no backbone in it.
    dpo_refused = [line for line in DOC.read_text().splitlines() if "| refused | DPO refused:" in line]
    assert len(dpo_refused) == 3  # sdpa, eager, packtools_sdpa
    assert all("TRL's fused LM head cannot run Llama4ForCausalLM" in line for line in dpo_refused)


def test_markdown_round_trips_through_parse_table():
    cells = [matrix.Cell("Llama", "sdpa", "exact", "position_ids", 1e-7, "a | b", "exact", 2e-7)]
    text = matrix.markdown(cells, FAMILIES)
    assert matrix.parse_table(text) == {("Llama", "sdpa"): ("exact", "position_ids", "exact")}


def test_main_writes_the_document(tmp_path, capsys):
    out = tmp_path / "models.md"
    assert matrix.main(["--archs", "Llama", "--backends", "eager", "--write", str(out)]) == 0
    assert matrix.parse_table(out.read_text()) == {("Llama", "eager"): ("exact", "position_ids", "exact")}
    assert "Llama" in capsys.readouterr().out


def test_the_document_has_a_row_for_every_family_and_backend():
    documented = matrix.parse_table(DOC.read_text())
    assert set(documented) == {(a.name, b) for a in FAMILIES for b in matrix.BACKENDS}


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", FAMILIES, ids=lambda a: a.name
)  # one test per family: the xdist workers share them
def test_whole_matrix_matches_the_document(arch):
    cells = matrix.run_matrix([arch], matrix.BACKENDS)
    assert len(cells) == len(matrix.BACKENDS)
    check_against_doc(cells)
