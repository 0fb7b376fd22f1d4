"""The front door is small, every namespace lists and resolves its names, and the names that left the front
door (the never-released 0.1 API) are read from their namespaces only."""

import doctest
import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import warnings

import pytest

import packtools

NAMESPACES = [
    "packtools",
    "packtools.core",
    "packtools.batches",
    "packtools.integrations",
    "packtools.pipeline",
    "packtools.profiling",
    "packtools.dpo",
]
# name that left the front door -> its home
MOVED = {
    "STRATEGIES": "packtools.core",
    "truncate_table": "packtools.core",
    "unpack": "packtools.core",
    "warmup": "packtools.core",
    "ArrowCollator": "packtools.batches",
    "PackedRows": "packtools.batches",
    "PackedView": "packtools.batches",
    "TokenBudgetBatchSampler": "packtools.batches",
    "choose_buckets": "packtools.batches",
    "varlen_attention": "packtools.batches",
    "truncate_dataset": "packtools.integrations",
    "pack_ray_dataset": "packtools.integrations",
    "packed_sft_config": "packtools.integrations",
    "use_segmented_sdpa": "packtools.integrations",
    "check_isolation": "packtools.integrations",
    "pack_preference": "packtools.dpo",
    "PreferenceCollator": "packtools.dpo",
    "sequence_logps": "packtools.dpo",
    "LengthProfile": "packtools.profiling",
}
NEEDS = {"packtools.integrations": "datasets", "packtools.dpo": "datasets"}


def test_front_door_is_small():
    """The front door serves its table of lazy names and the error, and no more than the 13 names of today: a
    name more is a decision taken here, not a side effect."""
    front_door = {"PackingError", *packtools._EXPORTS}
    assert set(packtools.__all__) == front_door and len(front_door) <= 13
    public = {n for n in dir(packtools) if not n.startswith("_")}
    # dir() lists the lazily imported names too, and no name that moved away
    assert front_door <= public and not public & set(MOVED)


@pytest.mark.parametrize("name", NAMESPACES)
def test_namespace_lists_and_resolves_its_names(name):
    module = importlib.import_module(name)
    lazy = module._EXPORTS
    for attr in module.__all__:
        assert attr in dir(module), f"{name}.{attr} missing from dir()"
        if attr in lazy and not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "trl")):
            continue  # needs an optional extra this environment lacks
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a listed name never warns
            obj = getattr(module, attr)
        if attr in lazy:  # the very object its defining module holds
            assert obj is getattr(importlib.import_module(lazy[attr]), attr)


@pytest.mark.parametrize("name", NAMESPACES)
def test_no_exported_name_is_also_a_submodule(name):
    """Importing a submodule sets it as an attribute of its package, so an exported name that is also a
    submodule's name turns into that module once anything imports the submodule (a doctest run, a user's
    ``import``), and the lazy ``__getattr__`` is never asked again."""
    module = importlib.import_module(name)
    lazy = module._EXPORTS
    submodules = {info.name for info in pkgutil.iter_modules(getattr(module, "__path__", []))}
    assert not submodules & set(lazy), sorted(submodules & set(lazy))


def test_unknown_name_is_an_attribute_error():
    for name in NAMESPACES:
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            importlib.import_module(name).nope  # noqa: B018


@pytest.mark.parametrize("name", sorted(MOVED))
def test_names_of_the_unreleased_0_1_api_are_gone_from_the_front_door(name):
    """The never-released 0.1 API's names at the top level, and pack_shards, were removed (issue 29): each is
    read from its namespace."""
    home = MOVED[name]
    if home in NEEDS:
        pytest.importorskip(NEEDS[home])
    with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
        getattr(packtools, name)
    assert name in importlib.import_module(home).__all__
    with pytest.raises(AttributeError):
        packtools.pack_shards  # noqa: B018


@pytest.mark.parametrize("name", [*(n for n in NAMESPACES if n != "packtools"), "packtools._lazy"])
def test_namespace_docstring_example_runs(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_namespaces_import_light():
    code = (
        "import sys, packtools, packtools.batches, packtools.integrations, packtools.pipeline, packtools.dpo, "
        "packtools.profiling; print(sorted(m for m in ('torch', 'datasets', 'transformers', 'trl', 'matplotlib', "
        "'ray', 'packtools.pipeline.run') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_import_and_the_cli_parser_do_not_import_numba_or_pandas():
    """`import packtools` and building the CLI's parser import neither Numba (kernels load on first use) nor
    pandas; a kernel call does import Numba (the control)."""
    code = (
        "import sys, packtools, packtools.core, packtools.cli.main as m; m.build_parser(); "
        "print(sorted(x for x in ('numba', 'pandas') if x in sys.modules)); "
        "packtools.plan([3, 2], max_length=4); print('numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"]
