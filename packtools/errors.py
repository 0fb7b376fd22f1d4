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


class TokensDroppedWarning(UserWarning):
    """Packing or truncation dropped tokens (filter with ``warnings.filterwarnings``)."""


class EmptyRowsWarning(UserWarning):
    """Rows of no tokens were left out (nothing to train on them): said, never silent (filter with
    ``warnings.filterwarnings``)."""


def empty_rows_message(empty: int, rows: int, what: str, fate: str) -> str:
    """The :class:`EmptyRowsWarning` text: ``empty`` of ``rows`` rows of ``what`` hold no token, and ``fate``
    says what became of them."""
    return (
        f"{what}: {empty:,} of {rows:,} rows hold no token (nothing to train): {fate}. Filter them out first "
        f"(the rows whose input_ids is empty; in datasets: ds.filter(lambda r: len(r['input_ids']) > 0)) to "
        f"silence this."
    )


def check_choice(param: str, value: Any, choices: Sequence[str], use: str | None = None) -> Any:
    """Return ``value`` if it is one of ``choices``; else refuse it, naming ``param`` and what to use instead
    (``use``, where the choices need a word each, or the choices listed)."""
    if value not in choices:
        raise PackingError(
            f"{param}={value!r} is unknown; use {use or 'one of ' + ', '.join(choices)}.", param=param
        )
    return value
