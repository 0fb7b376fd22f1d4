"""The package's shape, read from the tree: layers import downward only (cli -> pipeline -> integrations/profiling
-> batches/io -> core/compat), no import circle between modules, functions of at most 6 positional parameters,
Arrow IPC files opened through one door, and docs/architecture.md naming every layer and every module.

Modules are named by their dotted names (``packtools.core.plan``), never by paths, so the checks hold wherever a
module lives; each check has a negative control that injects a violation.  Module size has no cap: a module ends
where its concept ends (STYLE.md)."""

import ast
import functools
import pathlib
import re

import pytest

import packtools

ROOT = pathlib.Path(packtools.__file__).parent
DOC = ROOT.parent / "docs" / "architecture.md"
# Layer of each part (a top-level module or subpackage of packtools); a module may import its own part and any
# lower layer, nothing above.
LAYERS = {
    "errors": 0,
    "constants": 0,
    "_optional": 0,
    "_format": 0,
    "_progress": 0,
    "_atomic": 0,
    "_lazy": 0,
    "_interrupts": 0,
    "_gc": 0,
    "core": 1,
    # compat: the reads and patches of other libraries' internals, below every layer that meets those libraries'
    # objects (it imports only layer 0 and itself)
    "compat": 1,
    "io": 2,
    "batches": 2,
    "integrations": 3,
    "profiling": 3,
    "pipeline": 4,
    # packtools.testing: tiny models of the verified families, for users' own checks (builds on integrations)
    "testing": 4,
    "cli": 5,
    # a namespace of the front door (like packtools/__init__.py): re-exports DPO names of lower layers lazily
    "dpo": 6,
}


@functools.cache
def parse(source: str) -> ast.Module:
    """The syntax tree of a module's source (cached: several checks read every module; never modified)."""
    return ast.parse(source)


def part_of(module: str) -> str:
    """``packtools.core.plan`` -> ``core``; ``packtools.compat.trl`` (or, where it lived before,
    ``packtools.compat.trl``) -> ``compat``."""
    parts = module.split(".")
    return "compat" if parts[1:3] == ["integrations", "compat"] else parts[1]


def path_of(module: str) -> pathlib.Path:
    """The file of ``packtools.x.y`` (a package: its ``__init__.py``)."""
    base = ROOT.parent.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def read_as(monkeypatch, module: str, source: str) -> pathlib.Path:
    """Make every check read ``source`` as the text of ``module`` (a negative control); its path."""
    fake = path_of(module)
    real = pathlib.Path.read_text
    monkeypatch.setattr(
        pathlib.Path, "read_text", lambda self, *a, **k: source if self == fake else real(self)
    )
    return fake


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, packtools module)`` for every import in ``path``, relative ones resolved, lazy ones included."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    found = []
    for node in ast.walk(parse(path.read_text())):
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
                # from package import module: the module (a name the package defines stays the package)
                subs = [f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}")]
                found += [(node.lineno, sub) for sub in subs] or [(node.lineno, target)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("packtools.")]
    return found


def is_module(name: str) -> bool:
    """Whether ``packtools.x.y`` is a module or package of packtools."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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


def tree_parts() -> set[str]:
    return {part_of("packtools." + ".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in modules()}


def test_every_part_has_a_layer_and_every_layer_a_part():
    parts = tree_parts()
    assert parts - set(LAYERS) == set(), "give the new part a layer in LAYERS (and in docs/architecture.md)"
    assert set(LAYERS) - parts == set(), "gone from the tree: remove from LAYERS"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_downward(path):
    assert violations(path) == []


def test_the_check_catches_an_upward_import(monkeypatch):
    # A core module importing the pipeline must be reported (the check can fail).
    source = path_of("packtools.core.plan").read_text() + "\nfrom ..pipeline.run import pack_files\n"
    fake = read_as(monkeypatch, "packtools.core.plan", source)
    assert any("pipeline.run" in v for v in violations(fake))


# -- no import circle ------------------------------------------------------------------------------------
# Every import counts: module level, inside functions (lazy) and under `if TYPE_CHECKING:` (the modules still
# depend on each other), as imports_of reads them.  An allowed edge needs a reason; one no longer on a circle fails
# test_the_cycle_allow_list_is_current, so the list cannot outlive the circles.  None is allowed now.
CYCLE_EDGES_ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: pathlib.Path) -> str:
    """``.../packtools/core/plan.py`` -> ``packtools.core.plan``; a package's ``__init__.py``: the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {module it imports: line}}`` over every module of packtools (``__init__`` included)."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        graph[name] = {}
        for line, target in imports_of(path):
            if target != name and is_module(target):
                graph[name].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            nxt = next((t for t in targets if t not in index or t in on_stack), None)
            if nxt is not None:
                if nxt in index:
                    low[node] = min(low[node], index[nxt])
                else:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, {}))))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def import_cycles(allowed=CYCLE_EDGES_ALLOWED) -> list[str]:
    """Each circle left once the allowed edges are taken out, with its imports (``a:line -> b``)."""
    skip = {(f"packtools.{a}", f"packtools.{b}") for a, b in allowed}
    graph = {m: {t: n for t, n in ts.items() if (m, t) not in skip} for m, ts in import_graph().items()}
    return [
        ", ".join(f"{m}:{graph[m][t]} -> {t}" for m in group for t in sorted(graph[m]) if t in group)
        for group in strongly_connected(graph)
    ]


def test_no_import_cycle():
    assert import_cycles() == []


def test_the_cycle_allow_list_is_current():
    graph = import_graph()
    groups = [set(g) for g in strongly_connected(graph)]
    stale = [
        (a, b)
        for a, b in CYCLE_EDGES_ALLOWED
        if f"packtools.{b}" not in graph.get(f"packtools.{a}", {})
        or not any({f"packtools.{a}", f"packtools.{b}"} <= g for g in groups)
    ]
    assert stale == [], "no longer on a circle: remove from CYCLE_EDGES_ALLOWED"


def test_the_check_catches_an_import_cycle(monkeypatch):
    # A circle inside one layer (the layer check cannot see it): core.plan, which core.pack imports, importing
    # core.pack back, lazily inside a function.
    before = import_cycles()
    source = (
        path_of("packtools.core.plan").read_text() + "\n\ndef _back():\n    from .pack import pack_table\n"
    )
    read_as(monkeypatch, "packtools.core.plan", source)
    new = [c for c in import_cycles() if c not in before]
    assert len(new) == 1 and "packtools.core.plan:" in new[0] and "-> packtools.core.pack" in new[0], new
    # and an allowed edge is really left out: allowing the new edge takes the circle away again
    assert import_cycles({**CYCLE_EDGES_ALLOWED, ("core.plan", "core.pack"): "test"}) == before


# -- few positional parameters ---------------------------------------------------------------------------
MAX_POSITIONAL = 6
# (module, qualified name): why it takes more positional parameters (self and cls are not counted).
POSITIONAL_ALLOWED = {
    ("packtools.core.kernels", "view_segments"): "an @njit kernel: numba compiles no keyword-only parameters",
    ("packtools.integrations.attention.segmented", "attention_function.forward"): (
        "transformers' attention functions: AttentionInterface fixes the signature (sdpa_attention_forward's)"
    ),
    ("packtools.batches.attention", "varlen_attention"): (
        "mirrors flash_attn_varlen_func (q, k, v, cu_seqlens_*, max_seqlen_*)"
    ),
    ("packtools.batches.attention", "_reference"): "the exact reference of varlen_attention, called as it",
    ("packtools.integrations.rl.grpo", "PackedRLStep._get_per_token_logps_and_entropies"): (
        "overrides TRL's GRPOTrainer/RLOOTrainer method, which TRL calls positionally"
    ),
}


def positional_counts() -> dict[tuple[str, str], int]:
    """``{(module, qualified name): positional parameters}`` of every function and method of packtools."""
    counts = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        todo: list[tuple[ast.AST, str]] = [(parse(path.read_text()), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [a.arg for a in child.args.posonlyargs + child.args.args]
                    if names[:1] in (["self"], ["cls"]):
                        names = names[1:]
                    counts[(name, prefix + child.name)] = len(names)
                scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                todo.append((child, f"{prefix}{child.name}." if scope else prefix))
    return counts


def too_many_positional(allowed=POSITIONAL_ALLOWED) -> dict[tuple[str, str], int]:
    return {k: n for k, n in positional_counts().items() if n > MAX_POSITIONAL and k not in allowed}


def test_functions_take_few_positional_parameters():
    assert too_many_positional() == {}, (
        f"make the parameters after the {MAX_POSITIONAL}th keyword-only (or bundle them)"
    )


def test_the_positional_allow_list_is_current():
    counts = positional_counts()
    stale = sorted(k for k in POSITIONAL_ALLOWED if counts.get(k, 0) <= MAX_POSITIONAL)
    assert stale == [], "within the limit (or gone): remove from POSITIONAL_ALLOWED"


def test_the_check_catches_many_positional_parameters(monkeypatch):
    source = path_of("packtools.pipeline.run").read_text() + (
        "\n\ndef _seven(a, b, c, d, e, f, g):\n    pass\n"
        "\n\ndef _six_then_keywords(a, b, c, d, e, f, *, g):\n    pass\n"
        "\n\nclass _C:\n    def method(self, a, b, c, d, e, f):\n        pass\n\n"
        "    def wide(self, a, b, c, d, e, f, /, g):\n        pass\n"
    )
    before = too_many_positional()
    read_as(monkeypatch, "packtools.pipeline.run", source)
    new = {k: n for k, n in too_many_positional().items() if k not in before}
    assert new == {("packtools.pipeline.run", "_seven"): 7, ("packtools.pipeline.run", "_C.wide"): 7}


def test_compat_sits_below_the_layers_that_read_through_it(monkeypatch):
    # compat may not import upward (integrations proper, batches, core), and core may not import compat.
    source = path_of("packtools.compat").read_text() + (
        "\nfrom packtools.integrations.trainers.transformers import prepare_trainer\nfrom packtools.core.plan import plan\n"
    )
    fake = read_as(monkeypatch, "packtools.compat", source)
    found = violations(fake)
    assert any("integrations.trainers.transformers" in v for v in found) and any(
        "core.plan" in v for v in found
    )
    source2 = path_of("packtools.core.arrow").read_text() + (
        "\nfrom packtools.compat.datasets import dataset_table\n"
    )
    core = read_as(monkeypatch, "packtools.core.arrow", source2)
    assert any("compat" in v for v in violations(core))


# -- one Arrow door --------------------------------------------------------------------------------------------
#: the module that opens Arrow IPC files (IpcReader, open_ipc, mapped_table); every other module goes through it
ARROW_DOOR = "packtools.io.files"
#: pyarrow calls that open or map an Arrow IPC file or stream for reading
IPC_OPENERS = {
    "open_file",
    "open_stream",
    "memory_map",
    "RecordBatchFileReader",
    "RecordBatchStreamReader",
    "read_feather",
}


def ipc_openers() -> list[str]:
    """``module:line call`` of every pyarrow IPC opener called outside the door."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        if name == ARROW_DOOR:
            continue
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in IPC_OPENERS:
                    found.append(f"{name}:{node.lineno} {ast.unparse(func)}")
    return found


def test_arrow_ipc_files_are_opened_through_one_door():
    assert ipc_openers() == [], f"open Arrow IPC files with {ARROW_DOOR}.open_ipc / mapped_table / IpcReader"


def test_the_check_catches_an_arrow_file_opened_elsewhere(monkeypatch):
    source = path_of("packtools.profiling.packed").read_text() + (
        "\n\ndef _own(path):\n    return pa.ipc.open_file(pa.memory_map(path)).read_all()\n"
    )
    read_as(monkeypatch, "packtools.profiling.packed", source)
    assert [f.split(" ", 1)[1] for f in ipc_openers()] == ["pa.ipc.open_file", "pa.memory_map"]


# -- the map in docs/architecture.md -------------------------------------------------------------------------
def doc_layers(text: str) -> dict[str, int]:
    """``{part: layer}`` of the layer diagram (``layer N  core/ ...``, continuation lines indented; layer 0
    lists its modules by name)."""
    found, layer = {}, None
    for line in text.split("```")[1].splitlines():
        head = re.match(r"^layer (\d+)\s+(.*)$", line)
        if head:
            layer, rest = int(head.group(1)), head.group(2)
        elif line.startswith(" ") and layer is not None:
            rest = line.strip()
        else:
            continue
        first = rest.split("  ")[0].strip()
        if first.endswith("/"):
            found[part_of("packtools." + first.rstrip("/").replace("/", "."))] = layer
        elif first.endswith(".py"):
            found[first.removesuffix(".py")] = layer
        else:  # layer 0: names, comma separated
            for name in first.split(","):
                found[name.strip()] = layer
    return found


def test_the_layer_diagram_is_the_tree():
    assert doc_layers(DOC.read_text()) == LAYERS, "docs/architecture.md's diagram and LAYERS disagree"


def test_the_check_catches_a_wrong_layer_in_the_diagram():
    text = DOC.read_text().replace("layer 4  pipeline/", "layer 2  pipeline/")
    assert doc_layers(text) != LAYERS and doc_layers(text)["pipeline"] == 2


def doc_modules(text: str) -> set[str]:
    """Modules named in the first cell of the module table's rows (``| `core/plan.py` | ...``)."""
    found = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            cell = line.split(" | ")[0]
            found |= {
                "packtools." + m.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                for m in re.findall(r"`([\w/]+\.py)`", cell)
            }
    return found


def tree_modules() -> set[str]:
    """Every module of packtools; a package's ``__init__.py`` only when it holds more than its docstring and
    lazy re-exports (namespaces are described in their own table)."""
    found = set()
    for path in ROOT.rglob("*.py"):
        if path.name == "__init__.py":
            body = [n for n in parse(path.read_text()).body if not isinstance(n, ast.Expr)]
            if all(isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign, ast.Delete)) for n in body):
                continue
        if path.name == "__main__.py":
            continue
        found.add(module_name(path))
    return found


def undocumented(text: str) -> tuple[list[str], list[str]]:
    """(modules the table lacks, rows naming no module of the tree)."""
    doc, tree = doc_modules(text), tree_modules()
    return sorted(tree - doc), sorted(doc - tree - {"packtools"})


def test_docs_architecture_lists_every_module():
    missing, stale = undocumented(DOC.read_text())
    assert missing == [], "add a row for each module to docs/architecture.md's module table"
    assert stale == [], "no such module: remove its row from docs/architecture.md"


def test_the_check_catches_a_missing_and_a_stale_row():
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `core/ragged.py`"))
    text = text.replace(row + "\n", "") + "\n| `core/gone.py` | a module that is not there. |\n"
    assert undocumented(text) == (["packtools.core.ragged"], ["packtools.core.gone"])


# -- one owner per decision ------------------------------------------------------------------------------
#: the tokenizer engine's state (issue 29): only BatchTokenizer's own methods assign it; other modules call its
#: transitions (choose/adopt at load, take_pending, a part's verdict, the fallback) and read fast/report/pending
ENGINE_STATE = {
    "fast",
    "report",
    "pending",
    "_fast",
    "_report",
    "_pending",
    "_loaded",
    "_fast_load",
    "fast_source",
    "proof_recorded",
    "_reference_batch_done",
}
ENGINE_OWNER = ("packtools.pipeline.tokenizer.batch", "BatchTokenizer")


def engine_state_assignments() -> list[str]:
    """``module:line attr`` of every assignment to the engine's state outside its owner's own methods."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        todo: list[tuple[ast.AST, str | None]] = [(parse(path.read_text()), None)]
        while todo:
            node, cls = todo.pop()
            for child in ast.iter_child_nodes(node):
                todo.append((child, child.name if isinstance(child, ast.ClassDef) else cls))
                if isinstance(child, ast.Assign):
                    targets = child.targets
                elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                    targets = [child.target]
                else:
                    continue
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for t in flat:
                    if not isinstance(t, ast.Attribute) or t.attr not in ENGINE_STATE:
                        continue
                    own = (
                        isinstance(t.value, ast.Name) and t.value.id == "self" and (name, cls) == ENGINE_OWNER
                    )
                    if not own:
                        found.append(f"{name}:{t.lineno} {ast.unparse(t)}")
    return sorted(found)


def test_the_engine_state_is_assigned_by_its_owner_only():
    assert engine_state_assignments() == [], (
        "call BatchTokenizer's transitions instead of assigning its state"
    )


def test_the_check_catches_an_engine_state_assignment(monkeypatch):
    source = path_of("packtools.pipeline.tokenizer.proof").read_text() + (
        "\n\ndef _bad(bt):\n    bt.fast = None\n    bt._loaded, x = (None, None), 1\n"
    )
    read_as(monkeypatch, "packtools.pipeline.tokenizer.proof", source)
    assert [f.split(" ", 1)[1] for f in engine_state_assignments()] == ["bt.fast", "bt._loaded"]


# What a prepared trainer's step is made of: changed only by the step owner (one class per trainer kind, swapped
# onto the trainer) and by compat/ (other libraries' internals, version-checked).
STEP_OWNERS = ("integrations/trainers/step.py",)
TRAINER_STEP_NAMES = {
    "compute_loss",
    "compute_loss_func",
    "get_batch_samples",
    "get_train_dataloader",
    "get_eval_dataloader",
    "get_test_dataloader",
    "evaluate",
    "predict",
    "prediction_step",
    "training_step",
    "__class__",
}


def trainer_patches() -> list[str]:
    """``module:line what`` of every place outside compat/ and the step owner that assigns a step method (or the
    class) on a live object: ``x.compute_loss = ...``, ``set_attr(x, "get_batch_samples", ...)``,
    ``setattr(x, "__class__", ...)``, a bound method made with ``types.MethodType`` and set, or ``wrap_method``."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("compat/") or rel in STEP_OWNERS:
            continue
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in TRAINER_STEP_NAMES:
                        found.append(f"{rel}:{node.lineno} {ast.unparse(t)} =")
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func).rsplit(".", 1)[-1]
                if name == "wrap_method":
                    found.append(f"{rel}:{node.lineno} wrap_method")
                if name not in ("set_attr", "setattr") or len(node.args) < 3:
                    continue
                attr, value = node.args[1], node.args[2]
                named = isinstance(attr, ast.Constant) and attr.value in TRAINER_STEP_NAMES
                bound = isinstance(value, ast.Call) and ast.unparse(value.func).endswith("MethodType")
                if named or bound:
                    found.append(f"{rel}:{node.lineno} {name}({ast.unparse(attr)})")
    return sorted(found)


def test_no_module_but_the_step_owner_patches_a_trainers_step():
    assert trainer_patches() == [], (
        "change a trainer's step in its step owner (packtools/integrations/trainers/step.py: a mixin method calling "
        "super()), or a library internal in compat/"
    )


def test_the_check_catches_a_trainer_patch(monkeypatch):
    fake = ROOT / "integrations" / "trainers" / "context_parallel.py"
    source = fake.read_text() + (
        "\n\ndef _bad(trainer, types, f):\n    trainer.compute_loss = f\n"
        "    set_attr(trainer, 'get_batch_samples', f, owner=trainer)\n"
        "    setattr(trainer, 'x', types.MethodType(f, trainer))\n    wrap_method(trainer, 'evaluate', f)\n"
    )
    parse.cache_clear()
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source if self == fake else open(self).read())
    found = [f.split(" ", 1)[1] for f in trainer_patches()]
    parse.cache_clear()
    assert found == ["trainer.compute_loss =", "set_attr('get_batch_samples')", "setattr('x')", "wrap_method"]
