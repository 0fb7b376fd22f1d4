"""The lower bounds of pyproject.toml are the versions the lowest-versions job (.ci/run-lowest) pins in .ci/lowest.txt."""

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).parents[1]


def lower_bounds() -> dict[str, set[str]]:
    """``name -> {lower bounds}`` over the dependencies and every extra of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    bounds: dict[str, set[str]] = {}
    for spec in specs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][0-9.]*)", spec)
        assert m, f"{spec!r}: a dependency is written name>=version"
        bounds.setdefault(m.group(1).lower(), set()).add(m.group(2))
    return bounds


def pins() -> dict[str, str]:
    lines = (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
    return dict(ln.split("==") for ln in lines if ln and not ln.startswith("#"))


def same(a: str, b: str) -> bool:
    """``2.13`` and ``2.13.0`` name the same release."""
    pad = lambda v: [int(x) for x in v.split(".")] + [0] * (3 - v.count(".") - 1)  # noqa: E731
    return pad(a) == pad(b)


def mismatches(bounds: dict[str, set[str]], pinned: dict[str, str]) -> list[str]:
    bad = [f"{name}: pinned {v}, not a dependency" for name, v in pinned.items() if name not in bounds]
    bad += [
        f"{name}: pinned {v}, lower bounds {sorted(bounds[name])}"
        for name, v in pinned.items()
        if name in bounds and not all(same(b, v) for b in bounds[name])
    ]
    return bad


def test_every_pin_is_the_lower_bound_everywhere():
    assert mismatches(lower_bounds(), pins()) == []


def test_the_check_catches_a_stale_bound():
    # One extra keeping an old bound (the mismatch this file guards against) is reported; 1.15 is 1.15.0.
    bounds = lower_bounds()
    bounds["transformers"] = bounds["transformers"] | {"4.54"}
    assert [m.split(":")[0] for m in mismatches(bounds, pins())] == ["transformers"]
    assert same("1.15", "1.15.0") and mismatches(lower_bounds(), {**pins(), "nope": "1.0"}) != []


def test_the_libraries_an_integration_touches_are_pinned():
    assert {"transformers", "trl", "datasets", "accelerate", "peft", "tokenizers", "torch"} <= set(pins())
    assert {"numpy", "pyarrow", "numba", "fastokens"} <= set(pins())


@pytest.mark.parametrize("extra", ["hf", "trl", "vision", "all"])
def test_trainer_extras_bring_what_the_trainer_needs(extra):
    # `pip install 'packtools[hf]'` (the hint packtools' own errors give) then the training pages: transformers'
    # Trainer refuses to start without accelerate >= its ACCELERATE_MIN_VERSION
    transformers_utils = pytest.importorskip("transformers.utils")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = dict(s.split(">=") for s in project["optional-dependencies"][extra])
    assert "accelerate" in specs, f"the {extra!r} extra lacks accelerate"
    have = [int(x) for x in specs["accelerate"].split(".")]
    need = [int(x) for x in transformers_utils.ACCELERATE_MIN_VERSION.split(".")]
    assert have >= need
