"""Peak memory of a ``packtools_sdpa`` forward over one long packed row vs its documents run one by one.

Usage:
    python benchmarks/bench_segmented_memory.py [--tokens 32768] [--docs 8] [--grad] [--no-mask-baseline]
        [--backend default|math] [--live] [--cases packed,batched,sdpa_mask]

A one-layer tiny Llama (hidden 64, 4 heads of 16, 2 key/value heads, MLP 128, vocabulary 97, fp32, CPU) and one
row of ``--tokens`` tokens holding ``--docs`` documents of equal length.  Cases, each in its own fresh process:

* ``packed``: the row as one padding-free batch (``PaddingFreeCollator``: ``position_ids``, ``cu_seq_lens``) on
  ``packtools_sdpa``;
* ``one_by_one``: each document alone, one forward after the other, on transformers' ``sdpa`` (the same model,
  seed, kernel and ``no_grad`` setting as ``packed``; a single document never reaches the per-document loop);
* ``batched``: the documents as ``--docs`` rows of one batch on transformers' ``sdpa`` (plain causal, no mask):
  the same tokens, hence the same activations, as the packed row, with attention costing ``sum(L_i²)``;
* ``sdpa_mask`` (the baseline packtools_sdpa had before, skipped with ``--no-mask-baseline``): the same
  padding-free row on transformers' ``sdpa``, which builds the ``[1, 1, T, T]`` block-diagonal mask.

Method: peak resident memory of the forward, measured as ``VmHWM`` after the forward minus ``VmRSS`` before it,
with ``VmHWM`` reset just before the forward by writing ``5`` to ``/proc/self/clear_refs`` (Linux); model and
inputs are built before the reset, so the figure is what the forward itself adds.  ``--grad`` runs the forward
with autograd on (the activations it keeps count), else under ``torch.no_grad()``.  ``--backend math`` runs
every case under ``sdpa_kernel(SDPBackend.MATH)``, the kernel that materializes each call's ``heads × L × L``
scores (the attention-dominated configuration); the default lets torch pick (on CPU and CUDA a flash kernel,
whose memory is linear in the tokens).  ``--live`` adds, from a second forward in the same process, the peak of
the bytes held by live tensors (a ``TorchDispatchMode`` that counts every op's output storages while a tensor
viewing them lives) and the largest tensors at that peak, named ``module:op shape``: resident memory adds to
that a per-process constant (about 9 MiB: lazy initialization) and what glibc keeps of freed blocks (run with
``MALLOC_MMAP_THRESHOLD_=131072`` and ``packed`` drops from 120 to 85 MiB, ``one_by_one`` from 26 to 18 MiB).
Ratios are against ``one_by_one`` (the issue's target: at most 1.5) and ``batched``.

Measured (2 cores, torch 2.13, transformers 5.25; resident figures vary by up to 8 MiB from run to run, live tensors not at all):

``python benchmarks/bench_segmented_memory.py --live`` (T = 32,768, 8 documents, ``no_grad``)::

    packed        120-128 MiB  4.4-4.9x one_by_one  1.1-1.2x batched  live tensors  76.5 MiB (8.0x)
    one_by_one     24-27 MiB                                          live tensors   9.5 MiB
    batched       105-113 MiB                                         live tensors  72.5 MiB (7.6x)
    sdpa_mask         5.2 GiB                                         live tensors   5.1 GiB

The packed peak is in the MLP, as ``batched``'s is: 3 × 16 MiB (``gate``/``silu``, ``up``, their product:
T × 128 × 4 B), 3 × 8 MiB hidden states (embeddings, the attention's residual sum, the norm: T × 64 × 4 B) and
4 MiB of rotary ``cos``/``sin`` over T positions (``batched`` shares one set of 4096 positions: 0.5 MiB); the
documents one by one hold an eighth of each.  No forward over T tokens gets below ``batched``: on this model
1.5x ``one_by_one`` is out of reach for any attention.  Before commit 5ea0ea3 ``packtools_sdpa``'s own attention
step peaked at the same 76.5 MiB (keys and values repeated over the row for GQA, 2 × 8 MiB; the documents'
outputs, their ``cat`` and a transposed copy, 3 × 8 MiB); it now peaks at 52.5 MiB, under the MLP.  With
``--grad`` (live tensors): packed 185.2 MiB (193.2 before), ``batched`` 173.7, ``one_by_one`` 22.3 (8.3x); the
11.5 MiB over ``batched`` are the rotary tables and a second copy of the attention output (the flash kernel
keeps each document's output for its backward, the concatenation feeds ``o_proj``).

``python benchmarks/bench_segmented_memory.py --backend math --no-mask-baseline --live`` (attention-dominated)::

    packed        721 MiB  1.09x one_by_one  0.15x batched  live tensors  624.5 MiB (1.07x)
    one_by_one    664 MiB                                   live tensors  583.5 MiB
    batched      4770 MiB                                   live tensors 4216.5 MiB (7.2x)

Documents run one after another, so the attention's scratch follows ``max L_i²`` (one document's
``4 × 4096 × 4096`` scores, 256 MiB, twice, plus its causal mask) like ``one_by_one``'s, where ``batched``
holds all of them at once (``sum L_i²``).  With ``--grad`` the math kernel keeps each document's probabilities
for the backward, so the packed forward holds ``sum L_i²`` of them: 2.4 GiB of live tensors, 4.2x
``one_by_one``'s 586 MiB (which frees each document's graph before the next) -- the ``batched`` cost, and the
flash kernel's reason to exist.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from _common import live_peak, small_llama_config


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _live_peak(forward, model) -> tuple[int, list[tuple[int, str]]]:
    """Peak bytes of live tensors during ``forward()`` and the largest ones at the peak (module:op shape)."""
    where = ["-"]
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, a, n=name: where.append(n or "model") and None)
        module.register_forward_hook(lambda m, a, o: where.pop() and None)
    return live_peak(forward, lambda func, t: f"{where[-1]}:{func.__name__} {tuple(t.shape)}")


def run_case(
    case: str, tokens: int, docs: int, grad: bool, backend: str = "default", live: bool = False
) -> dict:
    import contextlib

    import torch
    import transformers

    from packtools import PaddingFreeCollator
    from packtools.integrations.attention import segmented

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = small_llama_config(97, 1, tokens)
    model = transformers.LlamaForCausalLM(config).float()
    if case == "packed":
        model.set_attn_implementation(segmented.register())
    length = tokens // docs
    ids = torch.randint(1, 97, (docs, length)).tolist()
    batch = PaddingFreeCollator(0)([{"input_ids": sum(ids, []), "seq_lengths": [length] * docs}])
    batch = {k: v for k, v in batch.items() if k != "labels"}
    alone = [torch.tensor([row]) for row in ids]
    rows = torch.tensor(ids)

    if backend == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def kernel() -> Any:
            return sdpa_kernel(SDPBackend.MATH)
    else:
        kernel = contextlib.nullcontext

    def forward() -> None:
        with kernel(), contextlib.nullcontext() if grad else torch.no_grad():
            run()

    def run() -> None:
        if case == "one_by_one":
            for row in alone:
                model(input_ids=row, use_cache=False).logits.sum().item()
        elif case == "batched":
            model(input_ids=rows, use_cache=False).logits.sum().item()
        else:
            model(**batch).logits.sum().item()

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    forward()
    result = {"case": case, "peak": _status("VmHWM") - before}
    if live:  # a second forward, after the resident figure was taken
        result["live"], result["at_peak"] = _live_peak(forward, model)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--no-mask-baseline", action="store_true")
    parser.add_argument("--backend", choices=["default", "math"], default="default")
    parser.add_argument("--live", action="store_true")
    parser.add_argument("--cases", help="comma-separated subset of the cases (one_by_one is always run)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens, args.docs, args.grad, args.backend, args.live)))
        return 0
    cases = ["packed", "one_by_one", "batched"] + ([] if args.no_mask_baseline else ["sdpa_mask"])
    if args.cases:
        wanted = set(args.cases.split(",")) | {"one_by_one"}
        cases = [case for case in ("packed", "one_by_one", "batched", "sdpa_mask") if case in wanted]
    results = {}
    for case in cases:
        cmd = [
            sys.executable,
            __file__,
            "--case",
            case,
            "--tokens",
            str(args.tokens),
            "--docs",
            str(args.docs),
            "--backend",
            args.backend,
        ] + (["--live"] if args.live else [])
        out = subprocess.run(
            cmd + (["--grad"] if args.grad else []), check=True, capture_output=True, text=True
        )
        results[case] = json.loads(out.stdout.strip().splitlines()[-1])
    mode = "forward with autograd" if args.grad else "forward under no_grad"
    print(
        f"one-layer Llama, T = {args.tokens}, {args.docs} documents, {mode}, sdpa backend {args.backend}; "
        "peak = VmHWM - VmRSS before"
    )
    alone = results["one_by_one"]["peak"]
    batched = results["batched"]["peak"] if "batched" in results else None
    for case in cases:
        peak = results[case]["peak"]
        line = f"  {case:11s} {peak / 2**20:9.1f} MiB   {peak / alone:7.2f}x one_by_one"
        if batched:
            line += f"   {peak / batched:6.2f}x batched"
        if args.live:
            live, live_alone = results[case]["live"], results["one_by_one"]["live"]
            line += f"   live tensors {live / 2**20:8.1f} MiB ({live / live_alone:5.2f}x one_by_one)"
        print(line)
    if args.live:
        for case in cases:
            print(f"  live tensors at the peak of {case}:")
            for size, label in results[case]["at_peak"]:
                print(f"    {size / 2**20:8.2f} MiB  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
