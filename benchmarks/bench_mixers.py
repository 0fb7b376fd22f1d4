"""Cost of running token-mixing layers per document (``packtools.integrations.attention.mixers``) on a packed row.

Usage::

    python benchmarks/bench_mixers.py [--archs Qwen3.5 Nemotron-H] [--docs 4 16 64] [--repeat 5] [--no-memory]

Each architecture is the matrix's tiny model (``benchmarks/model_matrix.py``: hidden 32, ``sdpa``, float32, CPU,
one thread).  A row holds ``--docs`` documents of 8-48 tokens (seeded).  Three ways, forward + backward of the
summed token loss, the best of ``--repeat`` runs each:

* ``per-document``: the packed row (``position_ids`` restarting per document) on the model prepared by
  ``run_mixers_per_document``: its token-mixing layers run one document at a time, attention and MLPs over the
  row; the result equals the documents run alone (``tests/test_mixers.py``);
* ``one-by-one``: each document alone through the unprepared model, one forward + backward after the other, in
  the same process (what exactness costs without packing);
* ``whole-row``: the packed row on the unprepared model (its mixers over the whole row: wrong across documents,
  the memory yardstick only).

Time ratio: ``per-document / one-by-one`` (target at most 1.3).  Memory: the peak bytes of live tensors during
forward + backward (a ``TorchDispatchMode`` counting every op's output storages while a tensor viewing them
lives), ``per-document`` against ``whole-row`` (target at most 1.0: the per-document path holds nothing of the
row's size that the row does not).

Measured (2 shared cores, torch 2.13, transformers 5.25; ``python benchmarks/bench_mixers.py``; times vary with the
machine's load, the ratios less)::

    | model      | documents | tokens | per-document s | one-by-one s | ratio | peak MiB per-document | whole-row    |
    | Qwen3.5    | 4         | 128    | 0.0999         | 0.1712       | 0.58x | 1.70                  | 2.06 (0.82x) |
    | Qwen3.5    | 16        | 481    | 0.3710         | 0.7122       | 0.52x | 6.74                  | 8.07 (0.83x) |
    | Qwen3.5    | 64        | 1742   | 0.5193         | 0.7920       | 0.66x | 32.45                 | 37.19 (0.87x)|
    | Nemotron-H | 4         | 128    | 0.0487         | 0.0615       | 0.79x | 1.31                  | 1.28 (1.02x) |
    | Nemotron-H | 16        | 481    | 0.1909         | 0.2472       | 0.77x | 5.37                  | 5.33 (1.01x) |
    | Nemotron-H | 64        | 1742   | 0.9610         | 1.1351       | 0.85x | 27.85                 | 28.23 (0.99x)|

Over the five runs made while building it (the first two on earlier code) the time ratio stayed between 0.44x and
0.87x.  Memory: each document's chunked scan runs at its
own chunk size (``compat.transformers.document_scan``: the PyTorch scans pad every call to a multiple of their
chunk, 64 for gated DeltaNet), and each document's output is written into the row's buffer as it comes
(``mixers._write_into``, no ``cat``), so Qwen3.5 holds less than the whole row; Nemotron-H's Mamba-2 layer keeps
a few small per-document tensors for its backward (its convolution's edge, each document's chunk sums), 1-2% over
the whole row on rows of 4-16 documents of this tiny model, the peak itself being in the LM head's backward.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import live_peak  # noqa: E402


def documents(count: int, seed: int, vocab: int) -> list[Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    return [torch.as_tensor(rng.integers(3, vocab, int(rng.integers(8, 49)))) for _ in range(count)]


def step(model: Any, ids: Any, positions: Any | None) -> None:
    kwargs = {"position_ids": positions} if positions is not None else {}
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits
    loss = logits.float().logsumexp(-1).sum()
    loss.backward()


def best(run: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(arch_name: str, count: int, repeat: int, memory: bool) -> dict[str, Any]:
    import torch
    from model_matrix import ARCHS, build

    from packtools.integrations.attention.mixers import run_mixers_per_document

    arch = next(a for a in ARCHS if a.name == arch_name)
    plain = build(arch, "sdpa")
    prepared = build(arch, "sdpa")
    done = run_mixers_per_document(prepared)
    docs = documents(count, 0, plain.config.vocab_size)
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    runs = {
        "per-document": lambda: step(prepared, ids, positions),
        "one-by-one": lambda: [step(plain, d[None], None) for d in docs],
        "whole-row": lambda: step(plain, ids, positions),
    }
    for run in runs.values():  # warm up (lazy initialization, allocator)
        run()
    out: dict[str, Any] = {"arch": arch_name, "docs": count, "tokens": int(ids.shape[1])}
    out["layers"] = len(done.modes)
    for name in ("per-document", "one-by-one"):
        out[name] = best(runs[name], repeat)
    if memory:
        out["mem per-document"] = live_peak(runs["per-document"])[0]
        out["mem whole-row"] = live_peak(runs["whole-row"])[0]
    plain.zero_grad(set_to_none=True)
    prepared.zero_grad(set_to_none=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="*", default=["Qwen3.5", "Nemotron-H"])
    parser.add_argument("--docs", nargs="*", type=int, default=[4, 16, 64])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(
        "| model | documents | tokens | per-document s | one-by-one s | ratio | peak MiB per-document | whole-row |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        for count in args.docs:
            r = measure(arch, count, args.repeat, not args.no_memory)
            ratio = r["per-document"] / r["one-by-one"]
            mem = ""
            if "mem per-document" in r:
                a, b = r["mem per-document"] / 2**20, r["mem whole-row"] / 2**20
                mem = f"{a:.2f} | {b:.2f} ({a / b:.2f}x)"
            print(
                f"| {arch} | {count} | {r['tokens']} | {r['per-document']:.4f} | {r['one-by-one']:.4f} | "
                f"{ratio:.2f}x | {mem} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
