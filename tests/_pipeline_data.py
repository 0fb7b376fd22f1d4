"""Shared helpers for the pipeline tests: a tiny BPE tokenizer trained offline, saved as a transformers folder."""

from __future__ import annotations

import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML; assistant turns (content and <|im_end|>) wrapped in generation markers in the first template only.
CHATML_GENERATION = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# A template that rewrites earlier assistant turns (drops them): prefixes are not prefixes of the whole.
CHATML_UNSTABLE = (
    "{% for m in messages %}"
    "{% if m['role'] != 'assistant' or loop.last %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "what is two plus two? two plus two is four.",
    "user assistant system question answer tokens",
    "packing sequences into rows of max length tokens",
] * 20


def build_tokenizer(path: str, chat_template: str | None = CHATML_GENERATION) -> str:
    """Train a byte-level BPE (vocab 400) on CORPUS and save it with ``save_pretrained`` into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=chat_template
    )
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


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
