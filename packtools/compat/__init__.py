"""Every touch of another library's internals, one module per library, recorded so it can be undone.

``compat.transformers``, ``compat.trl``, ``compat.datasets``, ``compat.accelerate`` and ``compat.torch`` each
name the versions their shapes were checked against (``CHECKED``) and refuse, with a
:class:`~packtools.errors.PackingError`, an object whose shape they do not know, instead of patching it
silently.  What they change on a live object (an attribute, a bound method, a registry entry) goes through
:func:`set_attr`, which records the old value in the object's :class:`Patches`; :func:`undo` puts every
recorded value back, newest first (``packtools.integrations.unprepare``).

>>> class T: pass
>>> t = T(); t.x = 1
>>> set_attr(t, "x", 2, owner=t); set_attr(t, "y", 3, owner=t); (t.x, t.y)
(2, 3)
>>> undo(t)
['T.x', 'T.y']
>>> (t.x, hasattr(t, "y"))
(1, False)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import PackingError

_PATCHES_ATTR = "_packtools_patches"
_MISSING = object()


@dataclass
class Patches:
    """The changes packtools made for one owner (a trainer, a model), oldest first, each with its undo."""

    undos: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def add(self, what: str, undo_fn: Callable[[], None]) -> None:
        self.undos.append((what, undo_fn))

    def names(self) -> list[str]:
        return [what for what, _ in self.undos]

    def undo(self, keep: int = 0) -> None:
        """Undo the changes after the first ``keep``, newest first."""
        while len(self.undos) > keep:
            _, fn = self.undos.pop()
            fn()


def patches_of(owner: Any) -> Patches:
    """The :class:`Patches` recorded on ``owner`` (created on first use)."""
    found = owner.__dict__.get(_PATCHES_ATTR) if hasattr(owner, "__dict__") else None
    if found is None:
        found = Patches()
        object.__setattr__(owner, _PATCHES_ATTR, found)
    return found


def set_attr(obj: Any, name: str, value: Any, *, owner: Any) -> None:
    """``setattr(obj, name, value)``, recorded on ``owner`` so :func:`undo` restores (or deletes) it."""
    old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
    setattr(obj, name, value)
    patches_of(owner).add(f"{type(obj).__name__}.{name}", RestoreAttr(obj, name, old))


class RestoreAttr:
    """The undo of :func:`set_attr`: ``obj.name`` set back to ``old`` (deleted where it had none).  A class, not a
    closure, so an owner holding it (a guarded model's own record) pickles and deep-copies: a copy's undo restores
    the copy."""

    def __init__(self, obj: Any, name: str, old: Any) -> None:
        self.obj, self.name = obj, name
        self.missing = old is _MISSING
        self.old = None if self.missing else old

    def __call__(self) -> None:
        if self.missing:
            if self.name in getattr(self.obj, "__dict__", {}):
                delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.old)


def record(owner: Any, what: str, undo_fn: Callable[[], None]) -> None:
    """Record a change made some other way (a registry entry, a callback) with the function that undoes it."""
    patches_of(owner).add(what, undo_fn)


def undo(owner: Any) -> list[str]:
    """Undo every change recorded on ``owner``, newest first; returns what was undone (oldest first)."""
    found = owner.__dict__.get(_PATCHES_ATTR) if hasattr(owner, "__dict__") else None
    if found is None:
        return []
    names = found.names()
    found.undo()
    return names


@contextlib.contextmanager
def all_or_nothing(owner: Any) -> Iterator[None]:
    """Within the block, the changes recorded on ``owner`` are undone again (newest first) if the block raises,
    so a refused trainer is left as it came; changes recorded before the block stay."""
    patches = patches_of(owner)
    mark = len(patches.undos)
    try:
        yield
    except BaseException:
        patches.undo(mark)
        raise


def version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class UncheckedVersionWarning(UserWarning):
    """A library whose internals packtools touches is installed in a version outside its ``CHECKED`` range."""


_WARNED: set[str] = set()


def release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string (``"5.25.0.dev0"`` -> ``(5, 25, 0)``), padded to three parts."""
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    parts = tuple(int(x) for x in found.group(0).split(".")) if found else ()
    return parts + (0,) * (3 - len(parts))


def within(installed: str, checked: str) -> bool:
    """Whether ``installed`` falls in ``checked`` (``"A - B"``, both ends included, or one version ``"A"``)."""
    low, _, high = checked.partition(" - ")
    return release(low) <= release(installed) <= release(high or low)


def warn_unchecked(library: str, checked: str) -> None:
    """Warn once per process when the installed ``library`` is outside ``checked`` (nothing when it is absent):
    packtools still refuses shapes it does not know (:func:`unknown_shape`), but its exactness was measured on
    the checked versions only."""
    installed = version(library)
    if installed is None or library in _WARNED or within(installed, checked):
        return
    _WARNED.add(library)
    warnings.warn(
        f"{library} {installed} is installed; packtools touches {library} internals and was checked against "
        f"{library} {checked}. It refuses shapes it does not know, but results on this version are unmeasured: "
        f"install a version in that range, or run the test suite against this one.",
        UncheckedVersionWarning,
        stacklevel=3,
    )


def unknown_shape(library: str, checked: str, what: str, fix: str | None = None) -> PackingError:
    """The error for an object whose internals are not the shape packtools checked (never patch blindly);
    ``fix`` defaults to installing a checked version."""
    if fix is None:
        article = "an" if library[0] in "aeiou" else "a"
        fix = f"Install {article} {library} version packtools was checked against (see CHECKED), or report the new shape."
    return PackingError(
        f"packtools does not know this {library} {version(library) or '(unknown version)'}: {what}. "
        f"packtools was checked against {library} {checked}. {fix}"
    )


def unprepare(trainer: Any) -> Any:
    """Undo what ``prepare_trainer`` / ``prepare_dpo_trainer`` changed on ``trainer`` (and the objects it holds).

    Every change packtools makes to a trainer, its model, its collator or a library registry for it is recorded
    on the trainer (``owner=trainer``), so this puts the trainer back as it was built.  Returns the trainer.
    """
    undo(trainer)
    return trainer
