"""Lazy re-exports: a namespace lists its public names and imports each one's module on first use.

The front door (``packtools``) and the namespace packages (``packtools.batches``, ``packtools.pipeline``, ...)
keep ``import packtools`` light: a name that needs torch, transformers or the pipeline is imported only when it
is first read.  ``dir()`` lists every public name, imported yet or not.

>>> ns = {"__name__": "demo"}
>>> getattr_, dir_ = lazy_exports(ns, {"PackingError": "packtools.errors"})
>>> getattr_("PackingError").__name__, "PackingError" in dir_()
('PackingError', True)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module whose globals are ``namespace``; ``exports`` maps a public name
    to the module that defines it."""
    name_of = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value  # read once; later reads are plain attribute reads
            return value
        raise AttributeError(f"module {name_of!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def lazy_module(name: str) -> ModuleType:
    """Module ``name``, imported when one of its attributes is first read (``importlib.util.LazyLoader``).

    The kernels module imports Numba (a quarter to half a second); modules that only call kernels in some of
    their functions hold it this way, so that ``packtools pack`` reads and tokenizes its first part before
    paying for Numba.  Already imported: the module itself.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: held by a thread while it loads a lazy module (Python 3.11's ``LazyLoader`` is not safe for two threads at once)
_LOADING = threading.Lock()


def load_now(name: str) -> ModuleType:
    """Module ``name`` fully loaded, safely from any thread: one thread at a time completes a :func:`lazy_module`
    (the pipeline loads the kernels in one thread while another reads tokenized JSON with one of them)."""
    with _LOADING:
        module = importlib.import_module(name)
        module.__dict__  # noqa: B018 - reading an attribute of a lazy module loads it
        return sys.modules[name]
