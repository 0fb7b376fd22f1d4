"""The sidecar of a staged part (``.npz``, written last: its presence means the part is done): each row's
length, first label position and trained tokens, each conversation's head, the closing ids of a template with
``{% generation %}`` markers, the data file to gather from and the tokenizer engine report.

>>> import os, tempfile, numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), "s.npz")
>>> _save_sidecar(path, np.array([3, 1]), np.array([1, 1]), np.array([2, 0]), "data.arrow")
>>> load_sidecar(path)[0].tolist(), [a.tolist() for a in sidecar_turns(path)]
([3, 1], [[2, 0], [], []])
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def _save_sidecar(
    path: str,
    lengths: np.ndarray,
    first: np.ndarray,
    trained: np.ndarray,
    data: str,
    *,
    report: dict[str, Any] | None = None,
    heads: np.ndarray | None = None,
    closing: np.ndarray | None = None,
) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.savez(
            fh,
            lengths=lengths,
            first_label=first,
            trained=trained,
            heads=heads if heads is not None else np.zeros(0, np.int64),
            closing=closing if closing is not None else np.zeros(0, np.int64),
            data=np.array(data),
            tokenizer=np.array(json.dumps(report, sort_keys=True) if report else ""),
        )
    os.replace(tmp, path)


def load_sidecar(path: str) -> tuple[np.ndarray, np.ndarray, str]:
    """``(lengths, first_label, data path)`` of a staged part."""
    with np.load(path, allow_pickle=False) as z:
        return z["lengths"], z["first_label"], str(z["data"])


def sidecar_turns(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trained tokens, head length)`` of each row of a staged part (empty arrays: the part has no labels,
    resp. no heads: every head is 0), and the ids a turn's closing text has after its labelled span
    (:func:`packtools.pipeline.chat_head.closing_ids`; empty for most templates)."""
    with np.load(path, allow_pickle=False) as z:
        return z["trained"], z["heads"], z["closing"]


def sidecar_report(path: str) -> dict[str, Any] | None:
    """The tokenizer engine report a staged part was written with (None for tokenized input)."""
    with np.load(path, allow_pickle=False) as z:
        text = str(z["tokenizer"]) if "tokenizer" in z.files else ""
    return json.loads(text) if text else None
