"""Lazy re-exports: a namespace lists its public names and imports each one's module on first use.

The front door (``packtools``) and the namespace packages (``packtools.batches``, ``packtools.pipeline``, ...)
keep ``import packtools`` light: a name that needs torch, transformers or the pipeline is imported only when it
is first read.  ``dir()`` lists every public name, imported yet or not.

>>> ns = {"__name__": "demo", "__package__": "packtools"}
>>> lazy_exports(ns, {".errors": ("PackingError",)})
{'PackingError': 'packtools.errors'}
>>> ns["__getattr__"]("PackingError").__name__, "PackingError" in ns["__dir__"]()
('PackingError', True)
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from types import ModuleType
from typing import Any


def lazy_exports(namespace: dict[str, Any], modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """Give the module whose globals are ``namespace`` a ``__getattr__`` and a ``__dir__`` that serve the names
    ``modules`` lists, each imported from its module on first read.

    ``modules`` maps a module, written as in a relative import from the namespace (``".plan"``), to the public
    names it defines.  Returns every served name -> the absolute name of its module (the namespace's
    ``__all__`` is built from it; the namespace test checks each name against its module).
    """
    package = namespace["__package__"]
    home = {
        name: importlib.util.resolve_name(module, package)
        for module, names in modules.items()
        for name in names
    }
    name_of = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in home:
            value = getattr(importlib.import_module(home[name]), name)
            namespace[name] = value  # read once; later reads are plain attribute reads
            return value
        raise AttributeError(f"module {name_of!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(home))

    namespace["__getattr__"], namespace["__dir__"] = __getattr__, __dir__
    return home


def lazy_module(name: str) -> ModuleType:
    """Module ``name``, imported when one of its attributes is first read.

    Modules that only call the kernels (which import Numba) in some of their functions hold them this way, so
    that ``packtools pack`` reads and tokenizes its first part before paying for Numba.  Safe for threads that
    read it first at once (two runs in one process): see :class:`_LazyModule`.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    return _LazyModule(name)


class _LazyModule(ModuleType):
    """Stands for module ``__name__``, which it imports at its first attribute read and forwards every read to.

    It imports through the import system, which makes a second thread that reads meanwhile wait for the first
    thread's import (its lock per module).  ``importlib.util.LazyLoader`` did not: before Python 3.12 it marks
    its module loaded before running it, so another thread could read a half-run module.
    """

    def __getattr__(self, attr: str) -> Any:  # called for the names the stand-in itself lacks
        module = self.__dict__.get("_module")
        if module is None:
            module = self.__dict__["_module"] = load_now(self.__name__)
        return getattr(module, attr)

    def __dir__(self) -> list[str]:
        return dir(load_now(self.__name__))

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # pickled as the module it stands for, by name, as cloudpickle (Ray) and dill pickle a module found in
        # sys.modules (the stand-in is not there, and their table of reducers matches ``ModuleType`` exactly):
        # a function pickled by value that reads it unpickles it as that module, not as an error
        return importlib.import_module, (self.__name__,)


def load_now(name: str) -> ModuleType:
    """Module ``name`` fully loaded, safely from any thread: a thread that asks while another imports it waits
    for that import (the pipeline loads the kernels in one thread while another reads tokenized JSON with one
    of them)."""
    return importlib.import_module(name)
