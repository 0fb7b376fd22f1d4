"""The documented plain PyTorch loops (benchmarks/train_loop.py, benchmarks/dpo_loop.py) run as the programs the
pages tell users to run, and each page shows its loop function verbatim.  Their exactness is checked by
tests/test_train_loop.py and tests/test_dpo_loop.py."""

import inspect
import math

import pytest
from _scripts import BENCHMARKS, script

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

#: recipe -> (its loop function, the page that shows it, a short run's arguments, the optimizer steps it takes)
RECIPES = {
    "train_loop": (
        "train",
        "training.md",
        ["--sequences", "100", "--max-length", "64", "--max-steps", "3"],
        3,
    ),
    "dpo_loop": (
        "train_dpo",
        "preference.md",
        ["--pairs", "80", "--max-length", "128", "--max-steps", "2"],
        2,
    ),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_recipe_runs_as_a_program(name):
    _, _, argv, steps = RECIPES[name]
    losses = script(name).main(argv)
    assert len(losses) == steps and all(math.isfinite(x) and x > 0 for x in losses)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_page_shows_the_recipes_loop_verbatim(name):
    function, page, _, _ = RECIPES[name]
    shown = (BENCHMARKS.parent / "docs" / page).read_text()
    assert inspect.getsource(getattr(script(name), function)) in shown
