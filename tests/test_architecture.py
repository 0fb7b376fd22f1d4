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
    """``packtools.core.plan`` -> ``core``."""
    return module.split(".")[1]


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
    own = rel.parts[1] if len(rel.parts) > 1 else rel.parts[0]
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
    parts = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in modules()}
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


# -- no import circles (lazy imports inside functions and TYPE_CHECKING blocks count) -------------------------
CIRCLE_FREE = ("core", "batches", "profiling")


def module_edges(path: pathlib.Path) -> set[str]:
    """The packtools modules ``path`` imports (``from ..core import kernels`` is ``packtools.core.kernels``)."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if _is_module(sub) else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("packtools.") and _is_module(m)}


def _is_module(name: str) -> bool:
    return ROOT.parent.joinpath(*name.split(".")).with_suffix(".py").is_file()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` found by a depth-first walk (each as the path that closes it)."""
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def _graph(parts=CIRCLE_FREE) -> dict[str, set[str]]:
    graph = {}
    for path in modules():
        rel = path.relative_to(ROOT.parent).with_suffix("")
        if rel.parts[1] in parts and rel.name != "__init__":
            graph[".".join(rel.parts)] = module_edges(path)
    return graph


def test_no_import_circles_in_core_batches_profiling():
    assert circles(_graph()) == []


def test_the_circle_check_catches_a_circle():
    graph = _graph()
    assert "packtools.batches.collate" in graph["packtools.batches.loader"]
    graph["packtools.batches.collate"] = graph["packtools.batches.collate"] | {"packtools.batches.loader"}
    assert ["packtools.batches.collate", "packtools.batches.loader", "packtools.batches.collate"] in circles(
        graph
    )
    assert "packtools.profiling.tradeoffs" in module_edges(ROOT / "profiling" / "profile.py")
