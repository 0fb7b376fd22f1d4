"""Executors side by side: the same mixed input packed by ``local``, ``pool`` and ``ray``; same bytes, same rows.

Usage::

    python benchmarks/bench_scale.py                          # 1M tokenized rows + 1M raw-text rows, 2 workers
    python benchmarks/bench_scale.py --rows 100000 --raw-rows 20000   # a quick check
    python benchmarks/bench_scale.py --variants tokenized --cases local,ray --markdown scale.md

Inputs (written once under ``--data``, reused while the parameters match), each a mix of the three input kinds
the engine reads (40% of the rows in a parquet file of 65,536-row groups, 30% in a JSON-lines file, 30% in a
``datasets`` ``save_to_disk`` folder of 2 shards):

- ``tokenized``: ``--rows`` rows of ``input_ids`` (int32 in ``[0, 32000)``) with lengths ``max(1, floor(x /
  --token-scale))``, ``x ~ lognormal(5.5, 1.0)`` (mean ~403 / scale), seed 0;
- ``raw``: ``--raw-rows`` rows of ``text`` (the standard library's definitions, the demo corpus, repeated),
  tokenized during the run by a byte-level BPE (vocab 8,000) trained here and saved as a transformers folder.

Cases, each ``packtools pack INPUTS --out OUT --max-length 4096`` in a fresh subprocess (``--executor local``,
``--executor pool --workers N``, ``--executor ray --workers N``: packtools starts and stops its own local Ray)
while this process samples the resident memory of that subprocess and all of its descendants every 20 ms (peak
of the sum: Ray's GCS, raylet and workers, the pool's workers, all counted) and their CPU time.  Checks: the
output folders are byte-identical across executors (every file, manifest included), and the rows equal the
global plan of all the sequence lengths (``packtools.plan`` over the lengths read back from ``seq_lengths``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
from _common import print_report

VOCAB = 32000


# -- inputs ----------------------------------------------------------------------------------------------
def _split_write(table, folder: str) -> list[str]:
    """Write ``table`` as parquet (40%), JSON lines (30%) and a save_to_disk folder (30%)."""
    import datasets
    import pyarrow.parquet as pq

    n = table.num_rows
    a, b = int(n * 0.4), int(n * 0.7)
    paths = [os.path.join(folder, "a.parquet"), os.path.join(folder, "b.jsonl"), os.path.join(folder, "c")]
    pq.write_table(table.slice(0, a), paths[0], row_group_size=65536)
    with open(paths[1], "w") as fh:
        for batch in table.slice(a, b - a).to_batches(max_chunksize=8192):
            fh.write("".join(json.dumps(r) + "\n" for r in batch.to_pylist()))
    datasets.Dataset(table.slice(b)).save_to_disk(paths[2], num_shards=2)
    return paths


def make_tokenized(folder: str, rows: int, scale: float, seed: int = 0) -> list[str]:
    import pyarrow as pa

    rng, vals = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    lengths = np.maximum(1, np.floor(rng.lognormal(5.5, 1.0, rows) / scale)).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    ids = vals.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids)).cast(pa.list_(pa.int32()))
    return _split_write(pa.table({"input_ids": col}), folder)


def make_raw(folder: str, rows: int) -> tuple[list[str], str]:
    import pyarrow as pa
    from bench_pipeline import build_tokenizer  # the same local byte-level BPE (vocab 8000)

    from packtools.pipeline.demo import stdlib_definitions

    pieces = [t.decode("utf-8", errors="replace") for t in stdlib_definitions()]
    tok_dir = build_tokenizer(pieces[::10], os.path.join(folder, "tokenizer"))
    texts = [pieces[i % len(pieces)] for i in range(rows)]
    return _split_write(pa.table({"text": texts}), folder), tok_dir


def inputs(args: argparse.Namespace, variant: str) -> tuple[list[str], list[str]]:
    """The input paths and extra CLI options of ``variant`` (made once per parameter set)."""
    params = (
        {"rows": args.rows, "scale": args.token_scale} if variant == "tokenized" else {"rows": args.raw_rows}
    )
    folder = os.path.join(args.data, variant)
    stamp = os.path.join(folder, "params.json")
    if not (os.path.exists(stamp) and json.load(open(stamp)) == params):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        t = time.perf_counter()
        if variant == "tokenized":
            make_tokenized(folder, args.rows, args.token_scale)
        else:
            make_raw(folder, args.raw_rows)
        with open(stamp, "w") as fh:
            json.dump(params, fh)
        print(f"wrote the {variant} input in {time.perf_counter() - t:.0f} s", flush=True)
    paths = [os.path.join(folder, n) for n in ("a.parquet", "b.jsonl", "c")]
    extra = [] if variant == "tokenized" else ["--tokenizer", os.path.join(folder, "tokenizer")]
    return paths, extra


# -- measuring -------------------------------------------------------------------------------------------
def measure(cmd: list[str]) -> tuple[float, float, float]:
    """Run ``cmd``; return its wall time, the peak summed RSS (bytes) of it and its descendants, and their CPU
    seconds (user + system, each process's last sample, summed)."""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]
    cpu: dict[int, float] = {}
    stop = threading.Event()

    def sample() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    total += p.memory_info().rss
                    times = p.cpu_times()
                    cpu[p.pid] = times.user + times.system
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total)
            stop.wait(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    stop.set()
    t.join()
    if proc.returncode:
        raise SystemExit(f"case failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    return wall, peak[0], sum(cpu.values())


def digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        h.update(name.encode())
        with open(os.path.join(folder, name), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def global_rows(folder: str) -> tuple[int, int]:
    """Rows of one global plan over the packed sequence lengths, and the rows written."""
    import datasets

    import packtools

    table = datasets.load_from_disk(folder).data.table
    lengths = table.column("seq_lengths").combine_chunks().values.to_numpy()
    return packtools.plan(lengths, 4096, "bfd").num_rows, table.num_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="tokenized rows")
    ap.add_argument("--raw-rows", type=int, default=1_000_000, help="raw-text rows")
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--variants", default="tokenized,raw")
    ap.add_argument("--cases", default="local,pool,ray")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", default="/tmp/packtools-bench-scale/data")
    ap.add_argument("--out-root", default="/tmp/packtools-bench-scale/out")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    lines = []
    for variant in args.variants.split(","):
        paths, extra = inputs(args, variant)
        rows = {}
        for case in args.cases.split(","):
            out = os.path.join(args.out_root, variant, case)
            shutil.rmtree(out, ignore_errors=True)
            cmd = [
                sys.executable,
                "-m",
                "packtools.cli",
                "pack",
                *paths,
                "--out",
                out,
                "--max-length",
                "4096",
            ]
            cmd += [*extra, "--quiet", "--executor", case]
            if case != "local":
                cmd += ["--workers", str(args.workers)]
            wall, peak, cpu = measure(cmd)
            with open(os.path.join(out, "manifest.json")) as fh:
                stats = json.load(fh)["stats"]
            rows[case] = {"wall": wall, "peak": peak, "cpu": cpu, "digest": digest(out), "stats": stats}
            print(
                f"{variant} {case}: {wall:.1f} s, peak RSS {peak / 1e9:.2f} GB, CPU {cpu:.0f} s", flush=True
            )
        first = next(iter(rows))
        want, _ = global_rows(os.path.join(args.out_root, variant, first))
        s = rows[first]["stats"]
        lines += [
            f"### {variant}: {s['rows_in']:,} rows, {s['tokens_in']:,} tokens (parquet + JSONL + save_to_disk), "
            f"max_length 4096, bfd, {args.workers} workers",
            "",
            "| executor | wall (s) | vs local | CPU (s) | peak RSS, all processes (GB) | rows out | over global plan "
            "| same bytes as " + first + " |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for case, r in rows.items():
            lines.append(
                f"| {case} | {r['wall']:.1f} | {rows[first]['wall'] / r['wall']:.2f}x | {r['cpu']:.0f} | "
                f"{r['peak'] / 1e9:.2f} | {r['stats']['rows_out']:,} | {r['stats']['rows_out'] - want:+,} | "
                f"{r['digest'] == rows[first]['digest']} |"
            )
        lines.append("")
    print_report("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
