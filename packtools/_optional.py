"""Imports of optional dependencies, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

_EXTRA_OF = {
    "datasets": "datasets",
    "torch": "torch",
    "matplotlib": "plot",
    "transformers": "hf",
    "tokenizers": "hf",  # comes with transformers
    "trl": "trl",
    "flash_attn": "flash",
    "ray": "ray",
    "PIL": "vision",
}


def is_instance(obj: object, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module`` (false when it is not installed).

    >>> is_instance(object(), "datasets", "Dataset")
    False
    """
    return any(t.__module__.split(".")[0] == module and t.__name__ == cls for t in type(obj).__mro__)


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` telling how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised by tests with the module hidden
        top = module.split(".")[0]
        extra = _EXTRA_OF.get(top, top)
        raise ImportError(
            f"{feature} needs the optional dependency '{top}'. Install it with: pip install 'packtools[{extra}]'"
        ) from exc
