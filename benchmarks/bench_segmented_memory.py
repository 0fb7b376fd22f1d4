"""Peak memory of a ``packtools_sdpa`` forward over one long packed row vs its documents run one by one.

Usage:
    python benchmarks/bench_segmented_memory.py [--tokens 32768] [--docs 8] [--grad] [--no-mask-baseline]

A one-layer tiny Llama (hidden 64, 4 heads, 2 key/value heads, fp32, CPU) and one row of ``--tokens`` tokens
holding ``--docs`` documents of equal length.  Cases, each in its own fresh process (``--case``):

* ``packed``: the row as one padding-free batch (``PaddingFreeCollator``: ``position_ids``, ``cu_seq_lens``) on
  ``packtools_sdpa``;
* ``one_by_one``: each document alone, one forward after the other, on transformers' ``sdpa``;
* ``batched``: the documents as ``--docs`` rows of one batch on transformers' ``sdpa`` (plain causal, no mask):
  the same tokens, hence the same activations, as the packed row, with attention costing ``sum(L_i²)``;
* ``sdpa_mask`` (the baseline packtools_sdpa had before, skipped with ``--no-mask-baseline``): the same
  padding-free row on transformers' ``sdpa``, which builds the ``[1, 1, T, T]`` block-diagonal mask.

Method: peak resident memory of the forward, measured as ``VmHWM`` after the forward minus ``VmRSS`` before it,
with ``VmHWM`` reset just before the forward by writing ``5`` to ``/proc/self/clear_refs`` (Linux); model and
inputs are built before the reset, so the figure is what the forward itself adds.  ``--grad`` runs the forward
with autograd on (the activations it keeps count), else under ``torch.no_grad()``.  Ratios are against
``one_by_one`` (the issue's target: at most 1.5) and ``batched``.  A forward over ``T`` tokens holds ``T``
tokens' activations (embeddings, projections, MLP, logits) whatever the attention does, while ``one_by_one``
holds ``T / docs`` at a time: the ``one_by_one`` ratio is about ``docs`` when activations dominate (small
heads, short documents) and tends to 1 when attention dominates; ``batched`` is the like-for-like measure of an
attention that costs ``sum(L_i²)``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_case(case: str, tokens: int, docs: int, grad: bool) -> dict:
    import torch
    import transformers

    from packtools import PaddingFreeCollator
    from packtools.integrations import segmented

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).float()
    if case == "packed":
        model.set_attn_implementation(segmented.register())
    length = tokens // docs
    ids = torch.randint(1, 97, (docs, length)).tolist()
    batch = PaddingFreeCollator(0)([{"input_ids": sum(ids, []), "seq_lengths": [length] * docs}])
    batch = {k: v for k, v in batch.items() if k != "labels"}
    alone = [torch.tensor([row]) for row in ids]
    rows = torch.tensor(ids)

    def forward() -> None:
        if case == "one_by_one":
            for row in alone:
                model(input_ids=row, use_cache=False).logits.sum().item()
        elif case == "batched":
            model(input_ids=rows, use_cache=False).logits.sum().item()
        else:
            model(**batch, use_cache=False).logits.sum().item()

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    if grad:
        forward()
    else:
        with torch.no_grad():
            forward()
    return {"case": case, "peak": _status("VmHWM") - before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--no-mask-baseline", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens, args.docs, args.grad)))
        return 0
    cases = ["packed", "one_by_one", "batched"] + ([] if args.no_mask_baseline else ["sdpa_mask"])
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
        ]
        out = subprocess.run(
            cmd + (["--grad"] if args.grad else []), check=True, capture_output=True, text=True
        )
        results[case] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    mode = "forward with autograd" if args.grad else "forward under no_grad"
    print(f"one-layer Llama, T = {args.tokens}, {args.docs} documents, {mode}; peak = VmHWM - VmRSS before")
    alone, batched = results["one_by_one"], results["batched"]
    for case in cases:
        print(
            f"  {case:11s} {results[case] / 2**20:9.1f} MiB   {results[case] / alone:7.2f}x one_by_one"
            f"   {results[case] / batched:6.2f}x batched"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
