"""The one exception family for bad data and arguments."""

from __future__ import annotations


class PackingError(ValueError):
    """Input data or arguments that packtools cannot pack; the message names the culprit and the fix.

    ``param`` names the Python argument the error is about (``"columns"``, ``"max_length"``), when there is
    one, so front ends (the CLI) can point at their own flag without rewriting the message.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
