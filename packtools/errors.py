"""The one exception family for bad data and arguments."""

from __future__ import annotations


class PackingError(ValueError):
    """Input data or arguments that packtools cannot pack; the message names the culprit and the fix."""
