"""Other libraries' internals are touched only in packtools/compat/, each module with a current
CHECKED range; a version outside it is said once, as a warning naming the range (review-2026-12b F8,
newcomer-2026-12b 13)."""

from __future__ import annotations

import importlib
import pathlib
import re
import warnings

import pytest

from packtools import compat

ROOT = pathlib.Path(__file__).parents[1] / "packtools"
COMPAT = {
    "transformers": "packtools.compat.transformers",
    "accelerate": "packtools.compat.accelerate",
    "datasets": "packtools.compat.datasets",
    "trl": "packtools.compat.trl",
    "torch": "packtools.compat.torch",
}


@pytest.mark.parametrize("library", sorted(COMPAT))
def test_the_installed_versions_are_inside_the_checked_ranges(library):
    """What CI installs is what CHECKED says was checked (a stale range fails here, not silently)."""
    pytest.importorskip(library)
    module = importlib.import_module(COMPAT[library])
    installed = compat.version(library)
    assert compat.within(installed, module.CHECKED), (
        f"{library} {installed} is outside CHECKED {module.CHECKED}"
    )


def test_ranges_and_releases():
    assert compat.release("5.25.0.dev0") == (5, 25, 0) and compat.release("2.13") == (2, 13, 0)
    assert compat.within("5.25.0", "5.15.0 - 5.25.0") and compat.within("2.13.0+cpu", "2.13.0")
    assert not compat.within("5.26.0", "5.15.0 - 5.25.0") and not compat.within("5.14.1", "5.15.0 - 5.25.0")


def test_a_version_outside_the_range_is_said_once(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda name: {"fakelib": "9.1.0"}.get(name))
    monkeypatch.setattr(compat, "_WARNED", set())
    with pytest.warns(
        compat.UncheckedVersionWarning, match=r"fakelib 9\.1\.0 .* checked against fakelib 1\.0 - 2\.0"
    ):
        compat.warn_unchecked("fakelib", "1.0 - 2.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_unchecked("fakelib", "1.0 - 2.0")  # once: no second warning
        compat.warn_unchecked("fakelib", "9.0 - 9.2")  # inside: none
        compat.warn_unchecked("absentlib", "1.0")  # not installed: none


def test_importing_a_compat_module_warns_on_an_unchecked_version(monkeypatch):
    import packtools.compat.accelerate as acc

    monkeypatch.setattr(compat, "version", lambda name: "99.0.0")
    monkeypatch.setattr(compat, "_WARNED", set())
    with pytest.warns(
        compat.UncheckedVersionWarning, match=r"accelerate 99\.0\.0.*accelerate 1\.10\.1 - 1\.16\.0"
    ):
        importlib.reload(acc)


PRIVATE = [
    r"_current_graph_task_id",
    r"get_temporary_cache_files_directory",
    r"MemoryMappedTable",
    r"\._broken\b|\"_broken\"",
    r"\._processes\b|\"_processes\"",
]


def private_touches_outside_compat(root=ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if "compat" in path.relative_to(root).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in PRIVATE):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return found


def test_private_internals_are_touched_in_compat_only(tmp_path):
    assert private_touches_outside_compat() == []
    # negative control: the old touch in batches/tree.py is found by the same scan
    (tmp_path / "tree.py").write_text('task = getattr(torch._C, "_current_graph_task_id", None)\n')
    assert private_touches_outside_compat(tmp_path) != []


def test_in_backward_tells_a_recomputation_from_a_forward():
    torch = pytest.importorskip("torch")
    from packtools.compat.torch import in_backward

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", in_backward(torch)))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", in_backward(torch)))
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [("forward", False), ("backward", True)]
