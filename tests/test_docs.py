"""The docstring examples of the public modules run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import packtools

# Modules whose examples need optional extras are still collected; they skip if the extra is missing.
NEEDS = {
    "packtools.integrations.data.datasets": "datasets",
    "packtools.integrations.data.views": "datasets",
    "packtools.integrations.preference.data": "datasets",
    "packtools.integrations.trainers.rope_rows": "datasets",
    "packtools.compat.datasets": "datasets",
    "packtools.integrations.attention.isolation": "transformers",
    "packtools.integrations.trainers.evaluation": "transformers",
    "packtools.testing": "transformers",
}
# Command-line front ends and plumbing: exercised by their own tests rather than by docstring examples.
WITHOUT_EXAMPLES = {
    "packtools.core.kernels",  # plumbing under plan/pack; tests/test_kernels.py and test_nojit.py run it
    "packtools.core.reference",  # the oracle; tests/test_kernels.py compares the kernels with it
    "packtools.io.pages",
    "packtools.cli.demo",
    "packtools.cli.pack",
    "packtools.cli.profile",
    "packtools.constants",
    "packtools.errors",
    "packtools.pipeline.preference",  # a pipeline step; tests/test_pipeline_tokenize.py runs it end to end
    "packtools.pipeline.tokenizer.reference_check",  # a child process and its pipes; tests/test_first_run_check.py
    "packtools._atomic",
    "packtools.integrations.data.ray",  # its example needs a Ray runtime (skipped); tests/test_ray.py runs it
    "packtools.integrations.trainers.context_parallel",  # needs a multi-process Trainer; tests/test_cp_training.py runs it
    "packtools.integrations.preference.context_parallel",  # needs a multi-process DPOTrainer; tests/test_cp_dpo.py runs it
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


def test_import_compiles_nothing():
    import subprocess
    import sys

    code = (
        "import packtools, packtools.core.kernels as k; "
        "print(sum(len(f.signatures) for f in vars(k).values() if hasattr(f, 'signatures')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


# -- documented defaults match the code -------------------------------------------------------------------
def _doc(name):
    import pathlib

    return (pathlib.Path(__file__).parent.parent / name).read_text()


def _cli_default(command, dest):
    from packtools.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and command in a.choices)
    return sub.choices[command].get_default(dest)


def test_documented_defaults_match_the_code():
    import re

    from packtools.core.pairs import default_prompt_budget
    from packtools.pipeline import stage_cache
    from packtools.profiling import recommend

    pipeline, profiling = _doc("docs/pipeline.md"), _doc("docs/profiling.md")
    # --max-prompt-length: `max_length // N` in the docs, N from the code
    for text in (pipeline, _doc("docs/preference.md")):
        for n in re.findall(r"default `max_length // (\d+)`", text):
            assert default_prompt_budget(1 << 12) == (1 << 12) // int(n), n
    assert re.search(r"default `max_length // \d+`", pipeline)
    assert "not packed" not in pipeline  # preference data is packed, by pairs
    # the recommendation's default rule and shares, the flag threshold, the CLI defaults
    assert "sequence rule at 0.99" in profiling and recommend.DEFAULT_KEEP_SEQUENCES == 0.99
    assert f"`--max-context` (default {recommend.COMMON_CONTEXT})" in profiling
    assert _cli_default("profile", "max_context") == recommend.COMMON_CONTEXT
    assert (
        _cli_default("profile", "keep_tokens") is None and _cli_default("profile", "keep_sequences") is None
    )
    m = re.search(r"`--multiple-of` \(default (\d+)\)", profiling)
    assert m and int(m.group(1)) == _cli_default("profile", "multiple_of")
    m = re.search(r"`--batch-size` \(padded-batches column, default (\d+)\)", profiling)
    assert m and int(m.group(1)) == _cli_default("profile", "batch_size")
    m = re.search(r"`\$PACKTOOLS_STAGE_CACHE_MAX_GB` \(default (\d+)\)", pipeline)
    assert m and float(m.group(1)) == stage_cache.DEFAULT_MAX_GB
    # the README's reruns sentence: the same --out is not refused when no run holds it
    assert "a second run into the same `--out` refuses" not in _doc("README.md")
