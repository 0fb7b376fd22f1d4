"""Cost of running token-mixing layers per document (``packtools.integrations.attention.mixers``) on a packed row.

Usage::

    python benchmarks/bench_mixers.py [--archs Qwen3.5 Nemotron-H] [--docs 4 16 64] [--repeat 5] [--no-memory]

Each architecture is the matrix's tiny model (``packtools.testing.tiny_model``: hidden 32, ``sdpa``, float32, CPU,
one thread).  A row holds ``--docs`` documents of 8-48 tokens (seeded).  Three ways, forward + backward of the
summed token loss, the best of ``--repeat`` runs each:

* ``per-document``: the packed row (``position_ids`` restarting per document) on the model prepared by
  ``run_mixers_per_document``: its token-mixing layers run one document at a time, attention and MLPs over the
  row; the result equals the documents run alone (``tests/test_mixers.py``);
* ``one-by-one``: each document alone through the unprepared model, one forward + backward after the other, in
  the same process (what exactness costs without packing);
* ``whole-row``: the packed row on the unprepared model (its mixers over the whole row: wrong across documents,
  the memory yardstick only).

Time ratio: ``per-document / one-by-one`` (target at most 1.3), CPU time of this process (one thread), so the
load of other processes on a shared machine stays out of it.  Memory: the peak bytes of live tensors during
forward + backward (a ``TorchDispatchMode`` counting every op's output storages while a tensor viewing them
lives), ``per-document`` against ``whole-row`` (target at most 1.0: the per-document path holds nothing of the
row's size that the row does not).

Measured (2 shared cores, torch 2.13, transformers 5.25; ``python benchmarks/bench_mixers.py``)::

    | model      | documents | tokens | per-document s | one-by-one s | ratio | peak MiB per-document | whole-row    |
    | Qwen3.5    | 4         | 128    | 0.0149         | 0.0257       | 0.58x | 1.70                  | 2.06 (0.82x) |
    | Qwen3.5    | 16        | 481    | 0.0476         | 0.0844       | 0.56x | 6.74                  | 8.07 (0.83x) |
    | Qwen3.5    | 64        | 1742   | 0.2784         | 0.4162       | 0.67x | 32.45                 | 37.19 (0.87x)|
    | Nemotron-H | 4         | 128    | 0.0213         | 0.0227       | 0.94x | 0.90                  | 1.28 (0.70x) |
    | Nemotron-H | 16        | 481    | 0.0824         | 0.0862       | 0.96x | 3.06                  | 5.33 (0.57x) |
    | Nemotron-H | 64        | 1742   | 0.3541         | 0.2919       | 1.21x | 18.81                 | 28.23 (0.67x)|
    | LFM2       | 4         | 128    | 0.0083         | 0.0136       | 0.61x | 0.94                  | 1.05 (0.90x) |
    | LFM2       | 16        | 481    | 0.0272         | 0.0519       | 0.52x | 3.98                  | 4.35 (0.92x) |
    | LFM2       | 64        | 1742   | 0.1863         | 0.2027       | 0.92x | 22.82                 | 24.11 (0.95x)|

Two runs of this code (load 6 on the 2 cores) gave time ratios 0.54-0.67x (Qwen3.5), 0.91-1.21x (Nemotron-H) and
0.52-0.92x (LFM2); the memory figures are the same in every run.
Memory: each document's chunked scan runs at its own chunk size (``compat.transformers.document_scan``: the
PyTorch scans pad every call to a multiple of their chunk, 64 for gated DeltaNet), and each document's output is
written into the row's buffer as it comes (``mixers._write_into``, no ``cat``), so Qwen3.5 holds less than the
whole row.  Mamba-2 and short convolutions kept, per document, a zero start state, a partial chunk and the
convolution's edge for backward: 0.99-1.02x (Nemotron-H) and 1.00x (LFM2) the whole row before their documents
were recomputed in backward (``mixers.RECOMPUTED``), which costs one more forward of those layers (Nemotron-H
0.71-0.95x the one-by-one time before, 0.91-1.21x after, in the same session).
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
    """The least CPU time of this process over ``repeat`` runs (one thread: other processes' load stays out)."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times)


def measure(arch_name: str, count: int, repeat: int, memory: bool) -> dict[str, Any]:
    import torch

    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.testing import tiny_model

    plain = tiny_model(arch_name, "sdpa")
    prepared = tiny_model(arch_name, "sdpa")
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
    parser.add_argument("--archs", nargs="*", default=["Qwen3.5", "Nemotron-H", "LFM2"])
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
