"""Test-only: make the fast engine (fastokens) diverge from transformers, at its own boundary.

:func:`install` replaces ``fastokens.Tokenizer`` by a wrapper whose ``encode_batch_flat`` changes the first id of
every row containing ``mark``; packtools is not touched.  :func:`site_folder` writes a ``sitecustomize.py`` that
installs it at interpreter start-up, so that processes a test starts (pool workers are spawned; subprocess runs)
diverge too when the folder is on their ``PYTHONPATH``.
"""

from __future__ import annotations

import os

import numpy as np


def install(mark: str = "zebra") -> None:
    import fastokens

    real = getattr(fastokens.Tokenizer, "_wrapped_real", fastokens.Tokenizer)

    class Tokenizer:
        _wrapped_real = real

        def __init__(self, native):
            self._native = native

        @classmethod
        def from_file(cls, path):
            return cls(real.from_file(path))

        def __getattr__(self, name):
            return getattr(self._native, name)

        def encode_batch_flat(self, texts, add_special_tokens=True):
            ids, offsets = self._native.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
            values = np.frombuffer(ids, np.uint32).copy()
            starts = np.frombuffer(offsets, np.uint64)
            for i, text in enumerate(texts):
                if mark in text and starts[i + 1] > starts[i]:
                    j = int(starts[i])
                    values[j] = values[j] + 1 if values[j] < 10 else values[j] - 1
            return values.tobytes(), offsets

    fastokens.Tokenizer = Tokenizer


def site_folder(folder: str, mark: str = "zebra") -> str:
    """A folder with a ``sitecustomize.py`` that calls :func:`install` (put it first on ``PYTHONPATH``)."""
    os.makedirs(folder, exist_ok=True)
    tests = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(folder, "sitecustomize.py"), "w") as fh:
        fh.write(f"import sys\nsys.path.insert(0, {tests!r})\nimport _diverge\n_diverge.install({mark!r})\n")
    return folder
