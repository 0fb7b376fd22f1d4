"""Labels of a batch: the one place tokens are taken out of the loss.

Two rules, used by every collator and gatherer of :mod:`packtools.batches` (rows as dicts, ``PackedRows``,
``PackedView``, the preference and tree collators): :func:`masked_labels` (a row's own ``labels``, else -100
where a 0/1 mask is 0) and :func:`ignore_starts` (-100 at every sequence start, so no sequence learns to
predict the next one's first token: the contract of padding-free batches).

>>> ids = np.array([5, 6, 7, 8])
>>> masked_labels(ids, None, [np.array([0, 1, 1, 1]), np.array([1, 1, 0, 1])]).tolist()
[-100, 6, -100, 8]
>>> masked_labels(ids, None, []) is None, ignore_starts(ids.copy(), [0, 2]).tolist()
(True, [-100, 6, -100, 8])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..constants import IGNORE_INDEX, MASK_COLUMNS


def mask_keys(completion_only_loss: bool = True, assistant_only_loss: bool = True) -> tuple[str, ...]:
    """The mask columns a collator applies: ``completion_mask`` / ``assistant_masks`` unless switched off."""
    return tuple(key for key, on in zip(MASK_COLUMNS, (completion_only_loss, assistant_only_loss)) if on)


def masked_labels(
    input_ids: np.ndarray, labels: np.ndarray | None, masks: Iterable[np.ndarray]
) -> np.ndarray | None:
    """The labels of the tokens ``input_ids`` (int64, one row or many laid end to end).

    ``labels`` (the row's own column) are returned as they are: they already say which tokens are learned, and
    the masks are not read.  Otherwise each of ``masks`` (0/1 values aligned with ``input_ids``; an iterable, so
    a caller may gather them lazily) sets -100 where it is 0.  ``None`` when there are neither labels nor
    masks: every token is learned, and the caller copies ``input_ids`` once for the whole batch.
    """
    if labels is not None:
        return labels
    out = None
    for mask in masks:
        if out is None:
            out = input_ids.copy()
        out[np.asarray(mask) == 0] = IGNORE_INDEX
    return out


def labels_of(input_ids: np.ndarray, labels: np.ndarray | None, masks: Iterable[np.ndarray]) -> np.ndarray:
    """:func:`masked_labels`, with a copy of ``input_ids`` where there is nothing to mask."""
    out = masked_labels(input_ids, labels, masks)
    return input_ids.copy() if out is None else out


def ignore_starts(labels: Any, starts: Any) -> Any:
    """Set -100 at ``starts`` (the first token of every sequence, or a boolean mask of them), in place."""
    labels[starts] = IGNORE_INDEX
    return labels
