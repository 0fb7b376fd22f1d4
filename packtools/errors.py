"""The one exception family for bad data and arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PackingError(ValueError):
    """Input data or arguments that packtools cannot pack; the message names the culprit and the fix.

    ``param`` names the Python argument the error is about (``"columns"``, ``"max_length"``), when there is
    one, so front ends (the CLI) can point at their own flag without rewriting the message.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_choice(param: str, value: Any, choices: Sequence[str], use: str | None = None) -> Any:
    """Return ``value`` if it is one of ``choices``; else refuse it, naming ``param`` and what to use instead
    (``use``, where the choices need a word each, or the choices listed)."""
    if value not in choices:
        raise PackingError(
            f"{param}={value!r} is unknown; use {use or 'one of ' + ', '.join(choices)}.", param=param
        )
    return value
