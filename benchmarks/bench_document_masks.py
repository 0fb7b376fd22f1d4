"""What Gemma 3's per-document masks cost in ``packtools_sdpa``: each image document's block built per layer (as
before) or once per forward and shared by the layers of a type (``DocumentBlockMask.block(..., dtype)``), beside
the dense ``[1, 1, T, T]`` mask read by ``packtools_sdpa`` and by plain ``sdpa``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_document_masks.py [--tokens 4096] [--document 512] [--image 256]
        [--layers 6] [--heads 8] [--kv-heads 4] [--head-dim 64] [--repeats 3] [--device cpu]

One attention call per layer (all layers share the row's mask object, as transformers hands it to every layer of
a type), forward and backward, on random queries, keys and values; documents of ``--document`` tokens, each with
one image of ``--image`` tokens after 8 text tokens.  Printed side by side: the median time of a forward and
backward over the layers and its ratio to the per-layer build (warmed up once, the variants interleaved), and the
bytes of mask tensors autograd holds for the backward (counted with ``saved_tensors_hooks``: no clock).  Wall-clock
ratios on a shared machine are indicative only; the held bytes are exact.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from packtools.batches.vision import DocumentBlockMask, image_block_masks
from packtools.integrations.attention.segmented import segmented_sdpa_forward


class PerLayerBlocks(DocumentBlockMask):
    """The old behaviour: each layer builds each image document's boolean block again (the dtype is ignored)."""

    def block(self, start, end, device=None, dtype=None):
        return super().block(start, end, device)


class Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def row(tokens: int, document: int, image: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    bounds = list(range(0, tokens, document)) + [tokens]
    is_image = np.zeros(tokens, bool)
    for start in bounds[:-1]:
        is_image[start + 8 : min(start + 8 + image, tokens)] = True
    positions = np.concatenate([np.arange(b - a) for a, b in zip(bounds, bounds[1:])])
    return bounds, is_image, positions


def step(mask, qkv, layers: int, module, cu) -> dict:
    """Forward and backward over ``layers`` calls; the bytes of distinct ``[1, 1, L, L]`` masks saved."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.dim() == 4 and t.shape[:2] == (1, 1) and t.shape[-1] == t.shape[-2]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v = (t.detach().requires_grad_() for t in qkv)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = q
        for _ in range(layers):
            out, _ = segmented_sdpa_forward(module, h, k, v, mask, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
            h = out.transpose(1, 2)
        h.sum().backward()
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "held": sum(seen.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--document", type=int, default=512)
    p.add_argument("--image", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    bounds, is_image, positions = row(a.tokens, a.document, a.image)
    cu = torch.tensor(bounds, dtype=torch.int32, device=a.device)
    q = torch.randn(1, a.heads, a.tokens, a.head_dim, device=a.device)
    k, v = (torch.randn(1, a.kv_heads, a.tokens, a.head_dim, device=a.device) for _ in range(2))
    module = Layer(a.heads // a.kv_heads)
    dense = torch.from_numpy(image_block_masks(positions, is_image, None)["full_attention"]).to(a.device)
    variants = {
        "per layer (before)": lambda: PerLayerBlocks(bounds, is_image, None),
        "once per forward": lambda: DocumentBlockMask(bounds, is_image, None),
        "dense [1,1,T,T]": lambda: dense,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    held: dict[str, int] = {}
    for name, make in variants.items():  # warm-up
        held[name] = step(make(), (q, k, v), a.layers, module, cu)["held"]
    for _ in range(a.repeats):
        for name, make in variants.items():
            times[name].append(step(make(), (q, k, v), a.layers, module, cu)["seconds"])
    base = statistics.median(times["per layer (before)"])
    print(
        f"{a.tokens} tokens, {len(bounds) - 1} documents of {a.document} (image {a.image}), {a.layers} layers, "
        f"{a.heads}/{a.kv_heads} heads x {a.head_dim}, {a.device}, packtools_sdpa, forward + backward"
    )
    print(f"{'mask':<20} {'median s':>9} {'ratio':>7} {'mask bytes held for backward':>30}")
    for name in variants:
        t = statistics.median(times[name])
        print(f"{name:<20} {t:9.3f} {t / base:7.3f} {held[name] / 2**20:26.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
