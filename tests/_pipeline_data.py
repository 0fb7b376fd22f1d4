"""Shared helpers for the pipeline tests: the tiny BPE tokenizer (``packtools.testing.tiny_tokenizer``, as
``build_tokenizer``), a template that rewrites earlier turns, and fast-engine faults injected by monkeypatch."""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# The tiny tokenizer of the pipeline tests is packtools.testing's (one owner; benchmarks read it there too).
from packtools.testing import (  # noqa: E402, F401
    CHATML_GENERATION,
    CHATML_PLAIN,
    EOS,
    IM_END,
    IM_START,
)
from packtools.testing import TOKENIZER_CORPUS as CORPUS  # noqa: E402, F401
from packtools.testing import tiny_tokenizer as build_tokenizer  # noqa: E402, F401

# A template that rewrites earlier assistant turns (drops them): prefixes are not prefixes of the whole.
CHATML_UNSTABLE = (
    "{% for m in messages %}"
    "{% if m['role'] != 'assistant' or loop.last %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load(path: str):
    return transformers.AutoTokenizer.from_pretrained(path)


def hold_fast_engine_load(monkeypatch):
    """Make the fast engine's background load wait until the returned ``threading.Event`` is set, and count the
    test tokenizer as a large vocabulary (one whose load the pipeline overlaps with its first batches)."""
    import threading

    from packtools.pipeline.tokenizer import load as tokenizer_load

    release = threading.Event()
    real = tokenizer_load.FastLoad._load

    def slow(self):
        release.wait(30)
        real(self)

    monkeypatch.setattr(tokenizer_load.FastLoad, "_load", slow)
    monkeypatch.setattr(tokenizer_load, "OVERLAP_MIN_BYTES", 0)  # the test tokenizer is small
    return release


def corrupt_fast_engine(monkeypatch, when) -> None:
    """Make the fast engine change the first id of every text for which ``when(text)`` holds."""
    from packtools.pipeline.tokenizer import fast as fast_tokenize

    real = fast_tokenize.FastEncoder.encode

    def encode(self, texts, special):
        got = real(self, texts, special)
        values = got.values.copy()
        for i, t in enumerate(texts):
            if when(t) and got.offsets[i + 1] > got.offsets[i]:
                values[got.offsets[i]] = (values[got.offsets[i]] + 1) % 300
        return type(got)(got.offsets, values)

    monkeypatch.setattr(fast_tokenize.FastEncoder, "encode", encode)


def fail_fast_engine(monkeypatch, when, error: type[Exception], message: str) -> None:
    """Make the fast engine raise ``error(message)`` on every batch with a text for which ``when(text)`` holds."""
    from packtools.pipeline.tokenizer import fast as fast_tokenize

    real = fast_tokenize.FastEncoder.encode

    def encode(self, texts, special):
        if any(when(t) for t in texts):
            raise error(message)
        return real(self, texts, special)

    monkeypatch.setattr(fast_tokenize.FastEncoder, "encode", encode)
