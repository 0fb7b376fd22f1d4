"""GPU check: flash-attn varlen against the PyTorch reference, and packed batches through a tiny Llama.

Usage (on a CUDA machine with flash-attn installed):
    python benchmarks/gpu_check.py [--dtypes bf16,fp16] [--seed 0] [--require-flash]
    python benchmarks/gpu_check.py --device cpu      # smoke run of the script itself (reference + sdpa only)

Part 1 runs ``packtools.batches.varlen_attention`` with ``backend="flash"`` (``flash_attn_varlen_func``, when flash-attn
is installed), with ``backend="torch"`` (PyTorch's ``torch.nn.attention.varlen.varlen_attn``, what ``"auto"``
uses on CUDA without flash-attn; torch >= 2.9) and with the reference (SDPA per sequence) on the same inputs,
forward and backward, causal and not, with grouped-query attention.  The yardstick is the reference in float32: flash passes when its error is at most twice the error
of the reference run in the same low precision, plus a small floor (the test rule flash-attn itself uses).

Part 2 packs documents with packtools, collates them with ``PaddingFreeCollator(pad_to_multiple_of=64)`` and runs
a tiny random ``LlamaForCausalLM`` (``attn_implementation="flash_attention_2"``; ``sdpa`` without flash-attn)
on the padding-free batch and on every document alone.  Logits, the token-weighted loss and all gradients of
the packed run must match the one-by-one runs about as well as the one-by-one runs match a float32 sdpa
reference.  A control run adds an all-ones ``attention_mask`` (the silent-contamination mistake) and must be
detected as wrong, which shows the check can fail.

Part 3 checks context parallelism's per-rank attention (``packtools.integrations.attention.context_parallel.shard_attention``):
a row of documents (shorter than 2·CP, one long) is laid out for CP = 2 and 4, each rank's queries attend the
keys/values of every rank concatenated rank after rank (what the all-gather hands it), through ``backend``
``flash`` / ``torch`` in low precision, and each real token's output and the gradients of the unsplit q/k/v
are compared with the float32 reference over the unsplit row, by the same rule as part 1.

Part 4 checks the token-mixing layers of hybrid models (``packtools.integrations.attention.mixers``) on CUDA: tiny Qwen3.5,
Kimi Linear, LFM2 and Nemotron-H from the model matrix, one packed row of documents, forward and backward, with
the layers on their varlen kernels (``seq_idx`` / ``cu_seq_lens`` into causal-conv1d, flash-linear-attention,
mamba-ssm; where those are installed) against the same model on packtools' per-document path, and both against
the float32 per-document run.  A kernel row passes when its error is at most twice the per-document path's in the
same precision plus the floor; a family whose kernels are not installed is reported as skipped.  A control runs
the layers over the whole row without ``seq_idx`` (the leak the varlen path prevents) and must fail the rule.

Prints a table per part; exits 0 when every check passes (or when there is no CUDA device: skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLOOR = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def max_err(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


# -- part 1: varlen attention -------------------------------------------------------------------------
def check_attention(
    torch, device: str, dtype, backends: list[str], seed: int
) -> tuple[list[list[str]], bool]:
    """Each fast backend (``flash``: flash-attn, ``torch``: torch.nn.attention.varlen.varlen_attn) against the
    float32 reference, judged by the error of the reference itself run in ``dtype``."""
    from packtools.batches import varlen_attention

    cases = [
        ([1, 17, 128, 300, 1000], 8, 8, 64, True),
        ([1, 17, 128, 300, 1000], 8, 2, 64, True),
        ([255, 256, 257, 3], 16, 4, 128, True),
        ([64, 500, 7], 8, 1, 128, False),
        ([2048], 4, 4, 64, True),
    ]
    rows, ok = [], True
    for lengths, hq, hk, d, causal in cases:
        g = torch.Generator(device="cpu").manual_seed(seed)
        total = sum(lengths)
        q32 = torch.randn(total, hq, d, generator=g).to(device)
        k32 = torch.randn(total, hk, d, generator=g).to(device)
        v32 = torch.randn(total, hk, d, generator=g).to(device)
        grad = torch.randn(total, hq, d, generator=g).to(device)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        m = max(lengths)

        def run(q, k, v, backend, cu=cu, m=m, causal=causal, grad=grad):
            q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            out = varlen_attention(q, k, v, cu, cu, m, m, causal=causal, backend=backend)
            grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
            return out, grads

        ref_out, ref_grads = run(q32, k32, v32, "reference")
        low = [x.to(dtype) for x in (q32, k32, v32)]
        lo_out, lo_grads = run(*low, "reference")
        e_lo = max_err(lo_out, ref_out)
        g_lo = max(max_err(a, b) for a, b in zip(lo_grads, ref_grads))
        for backend in backends or ["-"]:
            if backend == "-":
                verdict, fl = "SKIP (no CUDA varlen kernel)", ("-", "-")
            else:
                fl_out, fl_grads = run(*low, backend)
                e_fl = max_err(fl_out, ref_out)
                g_fl = max(max_err(a, b) for a, b in zip(fl_grads, ref_grads))
                floor = FLOOR[str(dtype).split(".")[-1]]
                passed = e_fl <= 2 * e_lo + floor and g_fl <= 2 * g_lo + floor
                ok &= passed
                verdict = "PASS" if passed else "FAIL"
                fl = (f"{e_fl:.2e}", f"{g_fl:.2e}")
            rows.append(
                [
                    f"{len(lengths)} seqs, max {m}",
                    f"{hq}/{hk}x{d}",
                    "causal" if causal else "full",
                    str(dtype).split(".")[-1],
                    backend,
                    fl[0],
                    f"{e_lo:.2e}",
                    fl[1],
                    f"{g_lo:.2e}",
                    verdict,
                ]
            )
    return rows, ok


# -- part 3: context-parallel shards against the unsplit row ------------------------------------------
def cp_shard_outputs(torch, q, k, v, lengths, cp, backend, grad):
    """Per-rank shard attention on ``q``/``k``/``v`` of the unsplit row (``(total, heads, dim)``), put back in
    row order; returns ``(output of every real token, grads of q/k/v)``.  Padding gets random inputs."""
    import math

    import numpy as np

    from packtools.batches.context_parallel import CPLayout, CPShard
    from packtools.integrations.attention.context_parallel import shard_attention

    layout = CPLayout.build(lengths, cp)
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    g = torch.Generator(device="cpu").manual_seed(1)
    local = []
    for r in range(cp):
        src = torch.from_numpy(layout.source(r)).to(q.device)
        real = src >= 0

        def take(x, src=src, real=real):
            noise = torch.randn(src.shape[0], *x.shape[1:], generator=g).to(x.device, x.dtype)
            return torch.where(real[:, None, None], x[src.clamp(min=0)], noise)

        local.append((take(q), take(k), take(v), src, real))
    keys = torch.cat([lk for _, lk, _, _, _ in local]).transpose(0, 1)[None]
    values = torch.cat([lv for _, _, lv, _, _ in local]).transpose(0, 1)[None]
    out = torch.zeros_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for r, (lq, _, _, src, real) in enumerate(local):
        shard = CPShard.build(layout, r)
        o = shard_attention(lq.transpose(0, 1)[None], keys, values, shard, scale, backend=backend)[0]
        if bool((~real).any()) and float(o[~real].detach().abs().max()) != 0.0:
            raise AssertionError(f"rank {r}: padding tokens got a non-zero attention output")
        out = out.index_put((src[real],), o[real], accumulate=True)
    placed = np.concatenate([layout.source(r) for r in range(cp)])
    if not np.array_equal(np.sort(placed[placed >= 0]), np.arange(sum(lengths))):
        raise AssertionError("the ranks' real tokens are not every token of the row once")
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    return out, grads


def check_cp(torch, device: str, dtype, backends: list[str], seed: int) -> tuple[list[list[str]], bool]:
    """Shard attention (CP = 2, 4) in ``dtype`` on each fast backend against the float32 unsplit reference."""
    from packtools.batches import varlen_attention

    rows, ok = [], True
    for lengths, cp in (([3, 200, 1, 57, 700], 2), ([3, 200, 1, 57, 700, 5], 4)):
        g = torch.Generator(device="cpu").manual_seed(seed)
        total, hq, hk, d = sum(lengths), 8, 2, 64
        q32, k32, v32 = (torch.randn(total, h, d, generator=g).to(device) for h in (hq, hk, hk))
        grad = torch.randn(total, hq, d, generator=g).to(device)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (x.detach().clone().requires_grad_(True) for x in (q32, k32, v32))
        ref = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, backend="reference")
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        low = [x.to(dtype) for x in (q32, k32, v32)]
        lo_out, lo_grads = cp_shard_outputs(torch, *low, lengths, cp, "reference", grad)
        e_lo = max_err(lo_out, ref)
        g_lo = max(max_err(a, b) for a, b in zip(lo_grads, ref_grads))
        for backend in backends or ["reference"]:
            out, grads = cp_shard_outputs(torch, *low, lengths, cp, backend, grad)
            e, ge = max_err(out, ref), max(max_err(a, b) for a, b in zip(grads, ref_grads))
            floor = FLOOR[str(dtype).split(".")[-1]]
            passed = e <= 2 * e_lo + floor and ge <= 2 * g_lo + floor
            ok &= passed
            rows.append(
                [
                    f"CP={cp}, {len(lengths)} docs",
                    str(dtype).split(".")[-1],
                    backend,
                    f"{e:.2e}",
                    f"{e_lo:.2e}",
                    f"{ge:.2e}",
                    f"{g_lo:.2e}",
                    "PASS" if passed else "FAIL",
                ]
            )
    return rows, ok


# -- part 2: tiny Llama, packed vs one by one ---------------------------------------------------------
def check_llama(torch, device: str, dtype, impl: str, seed: int) -> tuple[list[list[str]], bool]:
    import numpy as np
    import pyarrow as pa
    from transformers import LlamaConfig, LlamaForCausalLM

    from packtools import PaddingFreeCollator, pack_table

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    ref_model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device).float()
    model = copy.deepcopy(ref_model).to(dtype)
    if impl != "sdpa":
        model.set_attn_implementation(impl)
    rng = np.random.default_rng(seed)
    lengths = [37, 5, 120, 64, 1, 200, 300, 11, 2, 90]
    docs = [rng.integers(1, config.vocab_size, n).tolist() for n in lengths]
    packed = pack_table(pa.table({"input_ids": docs}), 512).to_pylist()
    batch = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=64)(packed)
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}

    def one_by_one(m):
        """Logits per document and grads of the token-weighted loss, each document run alone."""
        m.zero_grad()
        logits, total = {}, sum(n - 1 for n in lengths)
        for doc in docs:
            ids = torch.tensor([doc], device=device)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            logits[tuple(doc)] = out.logits[0].detach().float()
            if len(doc) > 1:
                (out.loss * (len(doc) - 1) / total).backward()
        return logits, {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}

    def packed_run(m, extra=None):
        m.zero_grad()
        out = m(**batch, **(extra or {}))
        out.loss.backward()
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].tolist()
        logits = {}
        for lo, hi in zip(cu[:-1], cu[1:]):
            logits[tuple(ids[lo:hi])] = out.logits[0, lo:hi].detach().float()
        return logits, {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}

    ref_logits, ref_grads = one_by_one(ref_model)
    alone_logits, alone_grads = one_by_one(model)

    def errors(logits, grads):
        e_logit = max(max_err(logits[tuple(d)], ref_logits[tuple(d)]) for d in docs)
        rel = max(
            float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)) for n in ref_grads
        )
        return e_logit, rel

    base = errors(alone_logits, alone_grads)
    dtype_name = str(dtype).split(".")[-1]
    floor = FLOOR[dtype_name]

    def row(label, errs, verdict):
        return [label, impl, dtype_name, f"{errs[0]:.2e}", f"{errs[1]:.2e}", verdict]

    def within(errs):  # as close to the reference as twice the one-by-one run's error, plus the dtype's floor
        return errs[0] <= 2 * base[0] + floor and errs[1] <= 2 * base[1] + floor

    packed = errors(*packed_run(model))
    # The silent-contamination mistake: an all-ones attention_mask next to the packed batch.  transformers then
    # derives one long sequence from the mask (flash) or skips packed-sequence detection (sdpa).
    control = errors(*packed_run(model, {"attention_mask": torch.ones_like(batch["input_ids"])}))
    passed, detected = within(packed), not within(control)
    rows = [
        row("one by one", base, "(yardstick)"),
        row("packed, padding-free", packed, "PASS" if passed else "FAIL"),
        row(
            "control: + all-ones attention_mask",
            control,
            "detected (ok)" if detected else "NOT DETECTED (check is blind)",
        ),
    ]
    return rows, passed and detected


# -- part 4: token-mixing layers, varlen kernels vs per document ------------------------------------------
def _mixer_run(torch, arch, device, seed, lengths, kernels, dt, whole_row=False):
    """One packed row through a tiny hybrid (its mixers per document, on kernels, or over the whole row)."""
    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.testing import tiny_model

    model = tiny_model(arch, "sdpa", seed).to(device, dt)
    done = None if whole_row else run_mixers_per_document(model, kernels=kernels)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, 100, (n,), generator=gen) for n in lengths])
    pos = torch.cat([torch.arange(n) for n in lengths])
    out = model(input_ids=ids[None].to(device), position_ids=pos[None].to(device), use_cache=False)
    logits = out.logits.float()
    logits.logsumexp(-1).sum().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach(), grads, done


def _within(reference, floor, errors) -> bool:
    return all(a <= 2 * b + floor for a, b in zip(errors, reference))


def check_mixers(torch, device: str, dtype, seed: int) -> tuple[list[list[str]], bool]:
    """Each hybrid family's packed row: varlen kernels vs the per-document path vs the float32 reference."""
    import importlib.util

    rows, ok = [], True
    lengths = [37, 5, 128, 64, 1, 200]
    for name in ("Qwen3.5", "Kimi Linear", "LFM2", "Nemotron-H"):
        run = functools.partial(_mixer_run, torch, name, device, seed, lengths)
        try:
            ref_logits, ref_grads, _ = run(False, torch.float32)
            per_logits, per_grads, _ = run(False, dtype)
            fast_logits, fast_grads, done = run(True, dtype)
            leak_logits, leak_grads, _ = run(False, dtype, whole_row=True)
        except Exception as err:  # noqa: BLE001 - a kernel that rejects these shapes: reported, the check fails
            rows.append(
                [
                    name,
                    str(dtype).replace("torch.", ""),
                    "-",
                    "-",
                    "-",
                    f"ERROR {type(err).__name__}: {str(err)[:80]}",
                ]
            )
            ok = False
            continue
        kernel = done is not None and "varlen kernel" in done.modes.values()
        packages = [p for p in ("causal_conv1d", "fla", "mamba_ssm") if importlib.util.find_spec(p)]
        floor = FLOOR[str(dtype).replace("torch.", "")]
        scale = max(1.0, float(ref_grads.abs().max()))
        per_err = (max_err(per_logits, ref_logits), max_err(per_grads, ref_grads) / scale)
        fast_err = (max_err(fast_logits, ref_logits), max_err(fast_grads, ref_grads) / scale)
        leak_err = (max_err(leak_logits, ref_logits), max_err(leak_grads, ref_grads) / scale)
        passes = functools.partial(_within, per_err, floor)
        verdict = (
            ("ok" if passes(fast_err) else "FAIL") if kernel else f"skipped (kernels: {packages or 'none'})"
        )
        control = "caught" if not passes(leak_err) else "NOT CAUGHT"
        ok &= (not kernel or passes(fast_err)) and control == "caught"
        rows.append(
            [
                name,
                str(dtype).replace("torch.", ""),
                f"{per_err[0]:.1e} / {per_err[1]:.1e}",
                f"{fast_err[0]:.1e} / {fast_err[1]:.1e}",
                f"{leak_err[0]:.1e} ({control})",
                verdict,
            ]
        )
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--require-flash", action="store_true", help="fail (exit 1) when flash-attn is missing"
    )
    args = parser.parse_args(argv)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (run with --device cpu for a smoke run of this script).")
        return 0
    try:
        import flash_attn

        flash_version = flash_attn.__version__
    except ImportError:
        flash_version = None
    flash = flash_version is not None and args.device.startswith("cuda")
    if args.require_flash and not flash:
        print("FAIL: flash-attn is not importable (pip install 'packtools[flash]').")
        return 1
    from packtools.batches.attention import _torch_varlen

    torch_varlen = _torch_varlen() is not None and args.device.startswith("cuda")
    backends = (["flash"] if flash else []) + (["torch"] if torch_varlen else [])
    fast = bool(backends)
    dtypes = [getattr(torch, DTYPES[d]) for d in args.dtypes.split(",")] if fast else [torch.float32]
    if not fast:
        print(
            "no CUDA varlen kernel (not on CUDA, or neither flash-attn nor torch varlen_attn): rows skipped."
        )
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"device {name}; torch {torch.__version__}; flash-attn {flash_version}\n")

    ok = True
    att_rows = []
    for dtype in dtypes:
        rows, passed = check_attention(torch, args.device, dtype, backends, args.seed)
        att_rows += rows
        ok &= passed
    print(
        "Part 1: varlen_attention, flash-attn and torch varlen_attn vs reference "
        "(max abs error against the float32 reference)"
    )
    print(
        table(
            att_rows,
            [
                "sequences",
                "heads q/kv x dim",
                "mask",
                "dtype",
                "backend",
                "out err fast",
                "out err ref lowp",
                "grad err fast",
                "grad err ref lowp",
                "verdict",
            ],
        )
    )
    llama_rows = []
    impl = "flash_attention_2" if flash else "sdpa"
    for dtype in dtypes:
        rows, passed = check_llama(torch, args.device, dtype, impl, args.seed)
        llama_rows += rows
        ok &= passed
    print("\nPart 2: tiny LlamaForCausalLM, error against float32 sdpa one-by-one runs")
    print(table(llama_rows, ["run", "attention", "dtype", "max logit err", "max rel grad err", "verdict"]))
    cp_rows = []
    for dtype in dtypes:
        rows, passed = check_cp(torch, args.device, dtype, backends, args.seed)
        cp_rows += rows
        ok &= passed
    print("\nPart 3: context-parallel shard attention vs the unsplit row (float32 reference)")
    print(
        table(
            cp_rows,
            [
                "row",
                "dtype",
                "backend",
                "out err",
                "out err ref lowp",
                "grad err",
                "grad err ref lowp",
                "verdict",
            ],
        )
    )
    mixer_rows = []
    if args.device.startswith("cuda"):
        for dtype in dtypes:
            rows, passed = check_mixers(torch, args.device, dtype, args.seed)
            mixer_rows += rows
            ok &= passed
        print(
            "\nPart 4: token-mixing layers, varlen kernels vs per document (logit err / rel grad err vs fp32)"
        )
        print(
            table(
                mixer_rows,
                ["model", "dtype", "per-document", "varlen kernels", "whole row (control)", "verdict"],
            )
        )
    print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
