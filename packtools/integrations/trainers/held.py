"""The other models a trainer holds: a ``compute_loss`` of the user's own may forward any of them on the packed
batch (a reward model, a judge, a critic, a frozen copy kept in a list), and one that drops the batch's
positions there runs each packed row as one sequence, its documents attending to each other, with no error.

:func:`held_models` finds them by a rule, not by attribute name: every language model (a module whose unwrapped
model has a ``config`` and input embeddings -- a ``transformers`` model, or a PEFT / DDP / compiled wrapper of
one) reachable from the trainer's attributes, directly or in a ``list`` / ``tuple`` / ``dict`` (of at most 64
items, nested at most 3 deep) or a module of the user's own, outermost first; those that are ``trainer.model``, a part of it or a wrapper of it
(one holding ``trainer.model`` itself) are not others -- a model that only shares some modules with it (an embedding
table, a backbone) is.
:func:`watch_held_models` guards each lazily (:func:`~.guard.watch_model`): refused only at a forward of packed
input, never for what it does on inputs of its own.  ``prepare_trainer`` runs it once, and packtools' step at the start
of each ``training_step`` / ``prediction_step`` (a model set on the trainer after ``prepare_trainer`` is seen too).
A held model's backbone called on its own (``self.judge.model(...)``) is watched with it
(:class:`~.guard.BackboneHook`); a sub-module of ``trainer.model`` called on its own (``self.model.model(...)``, its
backbone) is not.
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ..attention.backends import base_model
from .guard import watch_model

#: how deep containers of the trainer's attributes are looked into (a list of dicts of models: 2), and the
#: longest looked into (a dataset kept as a list of rows is not walked before every step)
_DEPTH, _WIDTH = 3, 64


def is_language_model(module: Any) -> bool:
    """Whether ``module`` (unwrapped: :func:`~packtools.integrations.attention.backends.base_model`) is a model
    with a ``config`` and input embeddings, as ``transformers`` models are; a loss, an embedding table or a head
    of one's own is not.

    >>> import torch
    >>> is_language_model(torch.nn.Embedding(4, 2)), is_language_model(torch.nn.CrossEntropyLoss())
    (False, False)
    """
    base = base_model(module)
    try:
        return getattr(base, "config", None) is not None and callable(
            getattr(base, "get_input_embeddings", None)
        )
    except Exception:  # noqa: BLE001 - a module of one's own whose attribute lookup raises: not a model
        return False


def _outermost_models(module: Any, torch: Any) -> list[Any]:
    """The language models in ``module``'s tree that no other language model of it contains: each module looked
    at once (a module shared by several parents, or one registered under its own child, is no endless walk)."""
    found: list[Any] = []
    seen: set[int] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if is_language_model(current):
            found.append(current)
        else:
            todo.extend(reversed(list(current.children())))
    return found


def held_models(trainer: Any) -> list[Any]:
    """The language models the trainer's attributes hold other than ``trainer.model`` (see the module
    docstring), each once, outermost first."""
    torch = require("torch", "packtools.prepare_trainer")
    model = getattr(trainer, "model", None)
    own = {id(m) for m in model.modules()} if isinstance(model, torch.nn.Module) else {id(model)}

    def mine(candidate: Any) -> bool:
        # trainer.model, a part of it (its backbone), or a wrapper of it (DDP, compiled, PEFT): one that holds
        # trainer.model itself. A model sharing only some modules with it (a tied embedding table) is another.
        return id(candidate) in own or any(m is model for m in candidate.modules())

    found: list[Any] = []
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            for candidate in _outermost_models(value, torch):
                if mine(candidate):
                    continue
                if all(candidate is not f for f in found):
                    found.append(candidate)
        elif depth < _DEPTH and isinstance(value, (list, tuple)) and len(value) <= _WIDTH:
            for item in value:
                visit(item, depth + 1)
        elif depth < _DEPTH and isinstance(value, dict) and len(value) <= _WIDTH:
            for item in value.values():
                visit(item, depth + 1)

    for value in list(vars(trainer).values()):
        visit(value, 0)
    # a model found under one attribute and, wrapped, under another: the wrapper (outermost) is the one called
    return [m for m in found if not any(m is not o and any(x is m for x in o.modules()) for o in found)]


def watch_held_models(trainer: Any) -> None:
    """Guard each of :func:`held_models` lazily (:func:`~.guard.watch_model`), recorded on the trainer."""
    for model in held_models(trainer):
        watch_model(model, owner=trainer)
