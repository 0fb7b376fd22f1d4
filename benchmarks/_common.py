"""Pieces the benchmark programs share: the printed (and optionally saved) report, the folder a run writes its
data to, one case run in a fresh process, the peak of live tensor memory, the bytes autograd saves for a step,
the small Llama the model benchmarks run and the word-level tokenizer of the trainer benchmarks.

Imported by the benchmarks that run as programs (``python benchmarks/bench_pack.py``: this folder is then on
``sys.path``); the ones the tests also load by path (``bench_mixers.py``, ``bench_dpo.py``, ``bench_grpo.py``)
put this folder on ``sys.path`` themselves (the tests' loader, ``tests/_scripts.py``, puts it there while a
script's module runs).  The documented recipes (``train_loop.py``, ``dpo_loop.py``, ``cp_loop.py``,
``cp_dpo_loop.py``) are read as the programs of their pages: ``train_loop`` takes only the config of its demo
model from here (no code a page shows imports this module), the others build on their sibling
recipes (``dpo_loop`` trains with ``train_loop``'s loop and model; the CP recipes take their demo data, model
and options and the summed SGD step of the plain steps from them).  ``gpu_check.py`` and ``model_matrix.py`` do
not import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

#: The line a case process prints its result on (JSON after it); the last one counts.
RESULT = "RESULT "


def print_report(text: str, markdown: str | None) -> None:
    """Print ``text`` (a report's tables) after a blank line; also write it to the file ``markdown`` if given."""
    print("\n" + text)
    if markdown:
        with open(markdown, "w") as fh:
            fh.write(text + "\n")


@contextlib.contextmanager
def work_folder(given: str | None, prefix: str) -> Iterator[str]:
    """The folder a run writes its data to: ``given`` (``--workdir``; made if missing, kept after, so a later run
    reuses its data), or a new temporary folder named ``prefix...``, removed when the run ends or fails."""
    path = given or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def run_case_process(script: str, case: dict[str, Any]) -> dict[str, Any]:
    """``case`` with the result of ``python script --case JSON`` merged in: each case runs in a fresh process
    (its own imports, compilation and peak memory), which prints its result on a :data:`RESULT` line."""
    cmd = [sys.executable, os.path.abspath(script), "--case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"case {case} failed with exit status {proc.returncode}")
    return {**case, **json.loads(lines[-1][len(RESULT) :])}


def live_peak(
    run: Callable[[], Any], label: Callable[[Any, Any], str] | None = None, top: int = 8
) -> tuple[int, list[tuple[int, str]]]:
    """``(peak bytes, largest storages at the peak)`` of live tensors during ``run()``.

    Counted at the dispatcher, so on any device (the CPU has no allocator statistics): the output storages of
    every op, each while a tensor views it.  ``label(op, tensor)`` names a storage when it appears; with it, the
    ``top`` largest storages alive at the peak come back as ``(bytes, label)`` (an empty list without it).
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[tuple[int, int], list] = {}  # storage -> [tensors alive, bytes, label]
            self.now = self.peak = 0
            self.at_peak: list[tuple[int, str]] = []

        def _gone(self, key: tuple[int, int]) -> None:
            entry = self.storages[key]
            entry[0] -= 1
            if not entry[0]:
                self.now -= entry[1]
                del self.storages[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = (storage.data_ptr(), storage.nbytes())
                    if key not in self.storages:
                        self.storages[key] = [0, storage.nbytes(), label(func, t) if label else ""]
                        self.now += storage.nbytes()
                    self.storages[key][0] += 1
                    weakref.finalize(t, self._gone, key)
            if self.now > self.peak:
                self.peak = self.now
                if label is not None:
                    self.at_peak = sorted(((v[1], v[2]) for v in self.storages.values()), reverse=True)[:top]
            return out

    live = Live()
    with live:
        run()
    return live.peak, live.at_peak


def small_llama_config(
    vocab_size: int,
    num_hidden_layers: int,
    max_position_embeddings: int,
    hidden_size: int = 64,
    mlp_factor: int = 2,
    **extra: Any,
) -> Any:
    """``transformers.LlamaConfig`` of the benchmarks' small Llama: hidden ``hidden_size`` (64), an MLP
    ``mlp_factor`` (2) times as wide, 4 heads over 2 key/value heads (grouped-query attention), ``sdpa``;
    ``extra`` on top."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=mlp_factor * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        attn_implementation="sdpa",
        **extra,
    )


def saved_bytes(step: Callable[[], Any]) -> int:
    """Bytes of the tensors autograd saves for backward while ``step()`` runs (the activations a training step
    keeps: bench_dpo, bench_grpo)."""
    import torch

    total = [0]

    def pack(t: Any) -> Any:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total[0]


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level ``transformers`` tokenizer of ``vocab_size`` ids: ``<pad>`` 0, ``<eos>`` 1, and the words
    ``w2`` ... ``w{vocab_size - 1}`` (each its own id), split on white space: the synthetic text of the trainer
    benchmarks (bench_dpo, bench_grpo) tokenizes to known ids, with no tokenizer to download."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
