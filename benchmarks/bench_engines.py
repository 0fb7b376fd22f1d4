"""Tokenizer engines compared on the same text and threads, ids compared: fastokens (packtools' engine) and
gigatoken (``pip install gigatoken``, in a separate environment if you like: this script needs only it,
fastokens and pyarrow).

Usage::

    python benchmarks/bench_engines.py DOCS.jsonl TOKENIZER_DIR --repeat 3

``DOCS.jsonl`` holds ``{"text": ...}`` lines (``bench_tokenize.py --case data`` or ``bench_phases.py --workdir``
writes one); ``TOKENIZER_DIR`` a ``tokenizer.json``.  The texts are read into memory once; then, per repeat and
alternating between the engines, each engine is loaded fresh (load timed), and the whole text encoded in batches
of 1,000 on the engine's default threads (both cores here), without special tokens (gigatoken adds none) and,
for fastokens, with them too.  gigatoken's own JSONL reader + encode (``encode_files``) is timed as well.  Every
document's ids are compared between the engines; an engine is adoptable only with zero differences.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs")
    ap.add_argument("tokenizer")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import fastokens
    import pyarrow.json as pj

    try:
        import gigatoken
    except ImportError:
        gigatoken = None
    texts = pj.read_json(args.docs).column("text").to_pylist()
    mb = sum(len(t.encode()) for t in texts) / 1e6
    path = os.path.join(args.tokenizer, "tokenizer.json")
    best: dict[str, float] = {}
    ids: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    for _ in range(args.repeat):
        t = time.perf_counter()
        fast = fastokens.Tokenizer.from_file(path)
        keep("fastokens load", time.perf_counter() - t)
        for special in (False, True):
            t = time.perf_counter()
            flat, lengths = [], []
            for i in range(0, len(texts), 1000):
                values, offsets = fast.encode_batch_flat(texts[i : i + 1000], add_special_tokens=special)
                flat.append(np.frombuffer(values, np.uint32))
                lengths.append(np.diff(np.frombuffer(offsets, np.uint64).astype(np.int64)))
            keep(f"fastokens encode_batch_flat (special tokens {special})", time.perf_counter() - t)
            if not special:
                ids["fastokens"] = (np.concatenate(flat), np.concatenate(lengths))
        if gigatoken is None:
            continue
        t = time.perf_counter()
        with open(path, "rb") as fh:
            giga = gigatoken.Tokenizer.from_json(fh.read())
        keep("gigatoken load", time.perf_counter() - t)
        t = time.perf_counter()
        flat, lengths = [], []
        import awkward as ak

        for i in range(0, len(texts), 1000):
            arr = giga.encode_batch(texts[i : i + 1000])
            flat.append(np.asarray(ak.flatten(arr)))
            lengths.append(np.asarray(ak.num(arr)))
        keep("gigatoken encode_batch", time.perf_counter() - t)
        ids["gigatoken"] = (np.concatenate(flat), np.concatenate(lengths))
        t = time.perf_counter()
        giga.encode_files(gigatoken.JsonlFileSource([args.docs], field="text"))
        keep("gigatoken encode_files (its JSONL reader + encode)", time.perf_counter() - t)
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    print(f"{len(texts):,} documents, {mb:.1f} MB, best of {args.repeat} interleaved, load average {load}")
    print("| step | s | MB/s |\n|---|---|---|")
    for name, s in best.items():
        print(f"| {name} | {s:.2f} | {'' if 'load' in name else f'{mb / s:.0f}'} |")
    if "gigatoken" in ids:
        (fv, fl), (gv, gl) = ids["fastokens"], ids["gigatoken"]
        starts_f, starts_g = np.cumsum(fl) - fl, np.cumsum(gl) - gl
        differ = [
            i
            for i in range(len(fl))
            if fl[i] != gl[i]
            or not np.array_equal(
                fv[starts_f[i] : starts_f[i] + fl[i]], gv[starts_g[i] : starts_g[i] + gl[i]]
            )
        ]
        print(f"documents whose ids differ (fastokens vs gigatoken, no special tokens): {len(differ):,}"
              + (f"; first: {differ[:5]}" if differ else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
