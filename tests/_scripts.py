"""The documented recipes and checks under ``benchmarks/`` loaded as the programs under test (by path, once per
process; ``benchmarks/`` is on ``sys.path`` only while a script's module runs, as for a program, so a recipe
imports the sibling recipes it builds on): a test runs ``cp_loop.plain_cp_step`` because docs/training.md tells
users to write that loop, never to borrow data or models (those live in tests/, e.g. ``_cp_fixtures``)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (registered as ``benchmarks_<name>``, so pickling finds it)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
