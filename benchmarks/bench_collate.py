"""Tokens/s of padding-free collation: packtools vs TRL and transformers, in one run.

Usage:
    python benchmarks/bench_collate.py [--rows 8] [--max-length 4096] [--iters 50] [--repeats 5]

Builds packed rows of ``--max-length`` tokens with packtools (BFD over synthetic lognormal lengths, mean ~400
tokens; ``--rows`` full rows drawn at random), then times, on the same ``--rows`` rows:

* TRL ``DataCollatorForLanguageModeling(padding_free=True)`` on rows as Python lists (and as NumPy arrays),
* transformers ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` on the
  documents inside the rows, one by one (it has no notion of packed rows),
* ``packtools.PaddingFreeCollator`` on rows as Python lists and as NumPy arrays,
* the Arrow-native path (``PackedRows`` + ``ArrowCollator``) reading the rows from a ``datasets.Dataset``.

"collate" starts from rows already in memory; "fetch+collate" starts from the ``datasets.Dataset`` (the list
collators then need ``[ds[i] for i in batch]``, what a ``DataLoader`` does).  Each case is warmed up, then run
``--iters`` times per repeat; the best repeat is reported.  Ratios are against TRL on list rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best_time(fn, iters: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def make_rows(num_rows: int, max_length: int, seed: int = 0):
    import datasets

    import packtools

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 20 * num_rows * max_length // 300), 1, max_length).astype(
        np.int64
    )
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    import pyarrow as pa

    table = pa.table(
        {"input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))}
    )
    packed = packtools.pack_table(table, max_length)
    full = np.flatnonzero(packtools.plan(lengths, max_length).row_lengths == max_length)
    if full.size < num_rows:
        raise SystemExit(f"only {full.size} full rows; use a smaller --rows")
    full = np.sort(rng.choice(full, num_rows, replace=False))  # typical rows, not only BFD's first ones
    ds = datasets.Dataset(packed.take(pa.array(full)))
    return ds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    import transformers
    import trl
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from packtools import PaddingFreeCollator
    from packtools.batches import ArrowCollator, PackedRows

    torch.set_num_threads(1)
    ds = make_rows(args.rows, args.max_length)
    idx = list(range(args.rows))
    list_rows = ds.to_list()
    np_rows = [{k: np.asarray(v) for k, v in r.items()} for r in list_rows]
    docs = []
    for r in list_rows:
        start = 0
        for n in r["seq_lengths"]:
            docs.append({"input_ids": r["input_ids"][start : start + n]})
            start += n
    tokens = sum(len(r["input_ids"]) for r in list_rows)

    trl_c = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    hf_c = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    ours = PaddingFreeCollator(pad_token_id=0)
    rows = PackedRows(ds)
    arrow = ArrowCollator(rows, ours)

    # Same output everywhere (transformers' on the documents one by one).
    ref = trl_c(list_rows)
    for name, out in [
        ("list", ours(list_rows)),
        ("numpy", ours(np_rows)),
        ("arrow", arrow(idx)),
        ("transformers", hf_c(docs)),
    ]:
        for key in ref:
            same = (
                torch.equal(ref[key], out[key])
                if isinstance(ref[key], torch.Tensor)
                else ref[key] == out[key]
            )
            if not same:
                raise SystemExit(f"{name}: {key} differs from TRL's output")

    def fetch():
        return [ds[i] for i in idx]

    cases = [
        (
            "TRL DataCollatorForLanguageModeling",
            "list rows",
            lambda: trl_c(list_rows),
            lambda: trl_c(fetch()),
        ),
        ("TRL DataCollatorForLanguageModeling", "numpy rows", lambda: trl_c(np_rows), None),
        ("transformers DataCollatorWithFlattening", "list documents", lambda: hf_c(docs), None),
        ("packtools PaddingFreeCollator", "list rows", lambda: ours(list_rows), lambda: ours(fetch())),
        ("packtools PaddingFreeCollator", "numpy rows", lambda: ours(np_rows), None),
        ("packtools PackedRows + ArrowCollator", "Arrow buffers", lambda: arrow(idx), lambda: arrow(idx)),
    ]
    results = []
    for name, kind, collate, fetch_collate in cases:
        t = best_time(collate, args.iters, args.repeats)
        tf = best_time(fetch_collate, max(args.iters // 5, 3), args.repeats) if fetch_collate else None
        results.append((name, kind, t, tf))
    base = results[0][2]
    base_f = results[0][3]

    print(
        f"{args.rows} packed rows x {args.max_length} tokens = {tokens} tokens, "
        f"{sum(len(r['seq_lengths']) for r in list_rows)} sequences; torch {torch.__version__}, "
        f"trl {trl.__version__}, transformers {transformers.__version__}; 1 torch thread\n"
    )
    header = "| collator | input | collate ms/batch | collate Mtok/s | x TRL | fetch+collate ms | x TRL |"
    print(header)
    print("|" + "---|" * 7)
    for name, kind, t, tf in results:
        f_ms = f"{tf * 1e3:.2f}" if tf is not None else "-"
        f_x = f"{base_f / tf:.1f}" if tf is not None else "-"
        print(
            f"| {name} | {kind} | {t * 1e3:.3f} | {tokens / t / 1e6:.1f} | {base / t:.1f} | {f_ms} | {f_x} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
