"""A packtools subclass of a live trainer's own class, swapped onto the instance and recorded for undo.

What packtools changes about a trainer's step lives in one mixin per trainer kind; :func:`swap_class` makes
``type(trainer)`` the subclass ``(mixin, type(trainer))`` (created once per pair and cached, named
``Packed<Class>``), so the mixin's methods run first and reach the trainer's own through ``super()`` -- a
user's subclass included.  The swap is recorded on ``owner`` (:func:`~packtools.integrations.compat.record`):
:func:`packtools.integrations.unprepare` gives the instance its class back.

>>> class Trainer:
...     def step(self): return "trainer"
>>> class Mixin:
...     def step(self): return "packed " + super().step()
>>> t = Trainer(); swap_class(t, Mixin, owner=t); (type(t).__name__, t.step())
('PackedTrainer', 'packed trainer')
>>> from packtools.integrations.compat import undo
>>> _ = undo(t); (type(t).__name__, t.step())
('Trainer', 'trainer')
"""

from __future__ import annotations

from typing import Any

from ...errors import PackingError
from . import record

_CLASSES: dict[tuple[type, type], type] = {}


def packed_class(cls: type, mixin: type) -> type:
    """The class ``Packed<cls>`` with ``mixin`` in front of ``cls`` (one per pair, cached)."""
    found = _CLASSES.get((cls, mixin))
    if found is None:
        name = f"Packed{cls.__name__}"
        found = type(name, (mixin, cls), {"__module__": mixin.__module__, "__qualname__": name})
        _CLASSES[(cls, mixin)] = found
    return found


def swap_class(obj: Any, mixin: type, *, owner: Any) -> None:
    """Make ``obj`` an instance of :func:`packed_class` ``(type(obj), mixin)``; recorded on ``owner``."""
    original = type(obj)
    if issubclass(original, mixin):
        raise PackingError(
            f"{original.__name__} already runs packtools' {mixin.__name__}: the trainer was prepared twice."
        )
    obj.__class__ = packed_class(original, mixin)

    def restore() -> None:
        obj.__class__ = original

    record(owner, f"{original.__name__}.__class__", restore)
