"""The docstring examples of the public modules run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import packtools

# Modules whose examples need optional extras are still collected; they skip if the extra is missing.
NEEDS = {"packtools.integrations.datasets": "datasets", "packtools.integrations.isolation": "transformers"}
# Command-line front ends and plumbing: exercised by their own tests rather than by docstring examples.
WITHOUT_EXAMPLES = {
    "packtools.core.arrow",
    "packtools.core.kernels",  # plumbing under plan/pack; tests/test_kernels.py and test_nojit.py run it
    "packtools.core.reference",  # the oracle; tests/test_kernels.py compares the kernels with it
    "packtools.io.pages",
    "packtools.cli.main",
    "packtools.cli.demo",
    "packtools.cli.pack",
    "packtools.cli.profile",
    "packtools.cli.shards",
    "packtools.constants",
    "packtools.errors",
    "packtools.pipeline.preference",  # a pipeline step; tests/test_pipeline_tokenize.py runs it end to end
    "packtools._atomic",
    "packtools.integrations.ray",  # its example needs a Ray runtime (skipped); tests/test_ray.py runs it
    "packtools.profiling.tradeoffs",
}


def modules():
    for info in pkgutil.walk_packages(packtools.__path__, "packtools."):
        leaf = info.name.rsplit(".", 1)[1]
        if not info.ispkg and not leaf.startswith("_"):
            yield info.name


@pytest.mark.parametrize("name", sorted(modules()))
def test_docstring_examples(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    # Every module outside this list documents itself with examples; a module losing them fails here.
    assert (result.attempted == 0) == (name in WITHOUT_EXAMPLES), result


def test_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, packtools; heavy = [m for m in ('torch', 'datasets', 'transformers', 'matplotlib', 'ray')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_import_compiles_nothing():
    import subprocess
    import sys

    code = (
        "import packtools, packtools.core.kernels as k; "
        "print(sum(len(f.signatures) for f in vars(k).values() if hasattr(f, 'signatures')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
