"""``git clone`` names the folder ``packtools``; Python started in the folder that holds the clone used to import
that folder (no ``__init__.py``) as an empty namespace package, because setuptools' editable install was a
meta-path finder, which Python asks only after the plain path search (newcomer 2026-12c, section 1).  The
project now maps the package root to the clone's root, so the editable install is a ``.pth`` line: the clone's
root on ``sys.path``, where the path search finds the real package before settling for a namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_editable_install_is_a_path_and_imports_from_the_clones_parent(tmp_path):
    pytest.importorskip("setuptools")
    clone = tmp_path / "packtools"  # what `git clone` names it
    clone.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "packtools", clone / "packtools", ignore=shutil.ignore_patterns("__pycache__"))
    out = str(tmp_path / "whl")
    build = f"from setuptools import build_meta; print(build_meta.build_editable({out!r}))"
    run = subprocess.run(
        [sys.executable, "-c", build], cwd=clone, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    wheel = zipfile.ZipFile(tmp_path / "whl" / run.stdout.strip().splitlines()[-1])
    top = [n for n in wheel.namelist() if "/" not in n]
    assert not [n for n in top if n.endswith(".py")], f"a meta-path finder, not a path: {top}"
    (pth,) = [n for n in top if n.endswith(".pth")]
    entry = wheel.read(pth).decode().strip()
    assert Path(entry).resolve() == clone.resolve()
    # what site does with that .pth line, then `import packtools` from the folder holding the clone
    probe = (
        f"import sys; sys.path.append({entry!r}); import packtools; print(packtools.pack_dataset.__module__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the .pth line may find it
    got = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert got.returncode == 0 and got.stdout.strip().startswith("packtools"), got.stderr[-2000:]
