"""Every touch of ``torch`` internals by packtools, checked against :data:`CHECKED`.

* ``Tensor._version`` (:func:`tensor_version`): the in-place version counter the segmented attention keys its
  cached boundaries on (no public getter; inference-mode tensors have none).
* ``torch._C._current_graph_task_id`` (:func:`in_backward`): whether autograd is running a backward pass (a
  checkpointed forward recomputed there), the guard of prompt-shared DPO's tree attention against counting a
  recomputation as a forward (no public API says so).
* ``Module.register_forward_pre_hook(hook, with_kwargs=True)`` (:func:`forward_pre_hook`, public) and
  ``register_forward_hook(hook, always_call=True)`` (:func:`forward_hook`, public): the guard's and the
  per-document mixers' hooks, recorded on their owner so that :func:`~packtools.compat.unprepare` removes it again
  (a model's own ``forward`` is never rebound here; token-mixing layers' are, in
  :func:`~packtools.compat.transformers.replace_mixer_forward`).

An object without the shape checked here raises :func:`~packtools.compat.unknown_shape`.

>>> import torch
>>> t = torch.zeros(2)
>>> before = tensor_version(t)
>>> _ = t.add_(1)
>>> tensor_version(t) == before + 1
True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from . import record, unknown_shape, warn_unchecked

#: The ``torch`` versions whose shapes this module was checked against: 2.13.0, the lowest and the one CI runs;
#: 2.14.1 and 2.15.0 (the CUDA builds on the package index, run on the CPU) read against their sources and run
#: under the test suite by hand (docs/development.md).
CHECKED = "2.13.0 - 2.15.0"
warn_unchecked("torch", CHECKED)  # once per process, when the installed torch is outside it


def tensor_version(tensor: Any) -> int | None:
    """The tensor's in-place version counter; ``None`` for an inference-mode tensor (it has none)."""
    try:
        return int(tensor._version)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    except AttributeError:
        raise unknown_shape("torch", CHECKED, f"{type(tensor).__name__} has no _version counter") from None


def forward_pre_hook(module: Any, hook: Callable[..., Any], *, owner: Any) -> Any:
    """Register ``hook(module, args, kwargs) -> (args, kwargs)`` before ``module``'s forward; returns the handle.

    Recorded on ``owner``: undoing it removes the hook.
    """
    return _register(
        module, "register_forward_pre_hook", "with_kwargs", hook, "forward pre-hook", owner=owner
    )


def forward_hook(module: Any, hook: Callable[..., Any], *, owner: Any) -> Any:
    """Register ``hook(module, args, output)`` after ``module``'s forward, called even when the forward raises
    (``always_call=True``); returns the handle.  Recorded on ``owner``: undoing it removes the hook."""
    return _register(module, "register_forward_hook", "always_call", hook, "forward hook", owner=owner)


def _register(
    module: Any, method: str, option: str, hook: Callable[..., Any], what: str, *, owner: Any
) -> Any:
    """``module.<method>(hook, <option>=True)``, refused where that method takes no such option."""
    register = getattr(module, method, None)
    if not callable(register) or option not in inspect.signature(register).parameters:
        raise unknown_shape("torch", CHECKED, f"{type(module).__name__}.{method} takes no {option}")
    handle = register(hook, **{option: True})
    record(owner, f"{type(module).__name__} {what}", handle.remove)
    return handle


def in_backward(torch: Any) -> bool:
    """Whether the current thread runs inside autograd's backward (a checkpointed forward being recomputed)."""
    task = getattr(getattr(torch, "_C", None), "_current_graph_task_id", None)
    if not callable(task):
        raise unknown_shape(
            "torch", CHECKED, "torch._C has no _current_graph_task_id (is a backward pass running?)"
        )
    return task() != -1
