"""The package's layers import downward only: cli -> pipeline -> integrations/profiling -> batches/io -> core."""

import ast
import pathlib

import pytest

import packtools

ROOT = pathlib.Path(packtools.__file__).parent
# Layer of each top-level part; a module may import its own subpackage and any lower layer, nothing above.
LAYERS = {
    "errors": 0,
    "constants": 0,
    "_optional": 0,
    "_format": 0,
    "_progress": 0,
    "_atomic": 0,
    "_lazy": 0,
    "core": 1,
    # integrations/compat: the reads and patches of other libraries' internals, below every layer that meets
    # those libraries' objects (it imports only layer 0 and itself)
    "compat": 1,
    "io": 2,
    "batches": 2,
    "integrations": 3,
    "profiling": 3,
    "pipeline": 4,
    "cli": 5,
    # a namespace of the front door (like packtools/__init__.py): re-exports DPO names of lower layers lazily
    "dpo": 6,
}


def part_of(module: str) -> str:
    """``packtools.core.plan`` -> ``core``; ``packtools.integrations.compat.trl`` -> ``compat``."""
    parts = module.split(".")
    return "compat" if parts[1:3] == ["integrations", "compat"] else parts[1]


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, packtools module)`` for every import in ``path``, relative ones resolved, lazy ones included."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x: x is a module of that package
                    found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
                    continue
            else:
                target = node.module or ""
            if target.startswith("packtools."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("packtools.")]
    return found


def modules():
    return sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.name != "__init__.py")


def violations(path: pathlib.Path) -> list[str]:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    own = part_of(".".join(rel.parts)) if len(rel.parts) > 1 else rel.parts[0]
    own_layer = LAYERS[own.removesuffix(".py")]
    bad = []
    for line, target in imports_of(path):
        part = part_of(target)
        if part == "__init__" or part not in LAYERS:
            bad.append(f"{rel}:{line} imports {target} (not a known layer)")
        elif part != own and LAYERS[part] >= own_layer:
            bad.append(f"{rel}:{line} imports {target} ({part}, layer {LAYERS[part]} >= {own} {own_layer})")
    return bad


def test_every_part_has_a_layer():
    parts = {part_of("packtools." + ".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in modules()}
    assert parts <= set(LAYERS), parts - set(LAYERS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_downward(path):
    assert violations(path) == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    # A core module importing the pipeline must be reported (the check can fail).
    fake = ROOT / "core" / "plan.py"
    source = fake.read_text() + "\nfrom ..pipeline.run import pack_files\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source if self == fake else open(self).read())
    assert any("pipeline.run" in v for v in violations(fake))


def test_compat_sits_below_the_layers_that_read_through_it(tmp_path, monkeypatch):
    # compat may not import upward (integrations proper, batches, core), and core may not import compat.
    fake = ROOT / "integrations" / "compat" / "__init__.py"
    source = fake.read_text() + "\nfrom ..transformers import guard_model\nfrom ...core.plan import plan\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source if self == fake else open(self).read())
    found = violations(fake)
    assert any("integrations.transformers" in v for v in found) and any("core.plan" in v for v in found)
    core = ROOT / "core" / "arrow.py"
    source2 = core.read_text() + "\nfrom ..integrations.compat.datasets import dataset_table\n"
    monkeypatch.setattr(
        pathlib.Path, "read_text", lambda self: source2 if self == core else open(self).read()
    )
    assert any("compat" in v for v in violations(core))
