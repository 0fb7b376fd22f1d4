"""Shard-parallel packing: one process, a local process pool and Ray, side by side against one global plan.

Usage::

    python benchmarks/bench_scale.py                      # the full run: 1M rows in 8 parquet files, 2 workers
    python benchmarks/bench_scale.py --rows 100000        # a quick check
    python benchmarks/bench_scale.py --cases local,ray --workers 2 --markdown scale.md --json scale.json

Input (written once to ``--data``, reused while the parameters match): ``--rows`` sequence lengths
``max(1, floor(x))``, ``x ~ lognormal(mean=5.5, sigma=1.0)`` from ``numpy.random.default_rng(--seed)`` (mean ~403
tokens, ~400M tokens for 1M rows, 1.6 GB of int32), tokens int32 in ``[0, 32000)``, one ``input_ids``
``list<int32>`` column, split in ``--files`` equal parquet files (pyarrow defaults, 128k-row groups).
``--token-scale s`` divides every length by ``s`` (at least 1 token) for smaller disks; 1 by default.

Cases, each in a fresh subprocess while this process samples the resident memory of that subprocess and all of
its descendants every 20 ms (peak of the sum: Ray's GCS, raylet and workers, the pool's workers, all counted;
pages shared between processes are counted once per process) and their CPU time (user + system of every process
seen, whole subprocess: imports, warm-up and ``ray.init`` included; on a shared machine the wall times move with
the load, printed beside each case, while CPU time moves much less):

- ``local``: ``pack_shards(files, out, max_length, strategy, shard_rows=--shard-rows)`` in that process.
- ``pool``: the same with ``executor="pool", workers=--workers`` (spawned processes).
- ``ray``: ``ray.init(num_cpus=--workers)`` then the same with ``executor="ray"``; the time of ``ray.init`` is
  printed apart and the ``ray`` column counts only the packing (``ray+init`` counts both).
- ``rerun``: ``pack_shards`` again on the output of ``local``: every shard skipped (the cost of idempotency).

``--repeat N`` runs the list N times, interleaved, and keeps each case's fastest run (peak RSS: the highest
seen).  Every case first runs ``packtools.warmup()`` (Numba's on-disk cache).  The input files are read once before the
cases so the page cache is warm for all.  Rows are compared with ``plan(all lengths)`` (one global plan) and
with the lower bound ``ceil(tokens kept / max_length)``; outputs are checked identical shard by shard (sha256).
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

VOCAB = 32000
TARGET_SPEEDUP = 1.3
TARGET_EXTRA_ROWS = 0.0001  # 0.01%


# -- input -----------------------------------------------------------------------------------------------
def make_data(args: argparse.Namespace) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    params = {k: getattr(args, k) for k in ("rows", "files", "seed", "token_scale")}
    os.makedirs(args.data, exist_ok=True)
    stamp = os.path.join(args.data, "params.json")
    paths = [os.path.join(args.data, f"part-{i:03d}.parquet") for i in range(args.files)]
    if os.path.exists(stamp) and json.load(open(stamp)) == params and all(map(os.path.exists, paths)):
        return paths
    rng = np.random.default_rng(args.seed)
    lengths = np.maximum(1, np.floor(rng.lognormal(5.5, 1.0, args.rows) / args.token_scale)).astype(np.int64)
    tok_rng = np.random.default_rng(args.seed + 1)
    bounds = [args.rows * i // args.files for i in range(args.files + 1)]
    for path, a, b in zip(paths, bounds[:-1], bounds[1:]):
        offsets = np.concatenate(([0], np.cumsum(lengths[a:b]))).astype(np.int32)
        values = tok_rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        pq.write_table(pa.table({"input_ids": col}), path, row_group_size=128 * 1024)
    with open(stamp, "w") as fh:
        json.dump(params, fh)
    return paths


def global_plan(paths: list[str], max_length: int, strategy: str) -> dict[str, int]:
    import pyarrow.parquet as pq

    import packtools
    from packtools.core.arrow import column_lengths

    lengths = np.concatenate([column_lengths(pq.read_table(p).column("input_ids")) for p in paths])
    start = time.perf_counter()
    p = packtools.plan(lengths, max_length, strategy)
    return {
        "rows_out": p.num_rows,
        "lower_bound": p.lower_bound,
        "tokens": int(lengths.sum()),
        "plan_s": time.perf_counter() - start,
    }


# -- one case (in its own process) -----------------------------------------------------------------------
def run_case(args: argparse.Namespace) -> None:
    import packtools
    from packtools import pack_shards

    packtools.warmup()
    paths = json.loads(args.paths)
    out = os.path.join(args.out_root, "local" if args.case == "rerun" else args.case)
    kwargs = dict(shard_rows=args.shard_rows or None, retries=0)
    init_s = 0.0
    if args.case == "ray":
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
        init_s = time.perf_counter() - t0
        kwargs.update(executor="ray")
    elif args.case == "pool":
        kwargs.update(executor="pool", workers=args.workers)
    if args.case != "rerun":
        shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    report = pack_shards(paths, out, args.max_length, args.strategy, **kwargs)
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "init_s": init_s, "totals": report.totals(), "ok": report.ok}
    result["shards"] = {s.shard_id: [s.stats.get("rows_out"), s.output_bytes] for s in report.shards}
    print("RESULT " + json.dumps(result), flush=True)
    if args.case == "ray":
        import ray

        ray.shutdown()


def measure(cmd: list[str]) -> tuple[dict, float, float]:
    """Run ``cmd``; return its RESULT line, the peak summed RSS (bytes) of it and its descendants, and their
    CPU seconds (user + system, each process's last sample, summed)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
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
    stdout, _ = proc.communicate()
    stop.set()
    t.join()
    if proc.returncode:
        raise SystemExit(f"case failed ({proc.returncode}): {' '.join(cmd)}")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), peak[0], sum(cpu.values())


def digests(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".parquet"):
            h = hashlib.sha256()
            with open(os.path.join(folder, name), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
            out[name] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--strategy", default="bfd")
    ap.add_argument("--shard-rows", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cases", default="local,pool,ray,rerun")
    ap.add_argument(
        "--repeat", type=int, default=1, help="run the cases N times, interleaved; keep the fastest"
    )
    ap.add_argument("--data", default="/tmp/packtools-bench-scale/data")
    ap.add_argument("--out-root", default="/tmp/packtools-bench-scale/out")
    ap.add_argument("--keep", action="store_true", help="keep the packed outputs")
    ap.add_argument("--markdown")
    ap.add_argument("--json")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        run_case(args)
        return

    t0 = time.perf_counter()
    paths = make_data(args)
    print(
        f"input: {args.rows:,} rows in {len(paths)} files under {args.data} ({time.perf_counter() - t0:.1f} s)"
    )
    g = global_plan(paths, args.max_length, args.strategy)  # also warms the page cache
    size = sum(os.path.getsize(p) for p in paths)
    print(
        f"{g['tokens']:,} tokens ({size / 1e9:.2f} GB of parquet); global plan {g['rows_out']:,} rows, lower "
        f"bound {g['lower_bound']:,} ({g['plan_s']:.2f} s); max_length {args.max_length}, {args.strategy}, "
        f"shard_rows {args.shard_rows:,}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    shutil.rmtree(args.out_root, ignore_errors=True)
    os.makedirs(args.out_root)
    cases = args.cases.split(",")
    results = {}
    for rep in range(args.repeat):
        for case in cases:
            cmd = [sys.executable, __file__, "--case", case, "--paths", json.dumps(paths)]
            for k in ("max_length", "strategy", "shard_rows", "workers", "out_root"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            res, peak, cpu = measure(cmd)
            res.update(peak_rss=peak, cpu_s=cpu, load=os.getloadavg()[0])
            print(
                f"  run {rep + 1} {case}: {res['wall_s']:.2f} s (+{res['init_s']:.2f} s init), peak RSS "
                f"{peak / 1e9:.2f} GB, CPU {cpu:.1f} s, load {res['load']:.2f}",
                flush=True,
            )
            best = results.get(case)
            if best is None or res["wall_s"] < best["wall_s"]:
                results[case] = {**res, "peak_rss": max(peak, best["peak_rss"] if best else 0)}
            else:
                best["peak_rss"] = max(best["peak_rss"], peak)

    same = None
    done = [c for c in ("local", "pool", "ray") if c in results]
    if len(done) > 1:
        ref = digests(os.path.join(args.out_root, done[0]))
        same = all(digests(os.path.join(args.out_root, c)) == ref for c in done[1:])
    base = results.get("local", {}).get("wall_s")
    header = [
        "case",
        "wall s",
        "speedup vs local",
        "CPU s",
        "peak RSS GB",
        "shards",
        "rows out",
        "over lower bound",
        "over global plan",
    ]
    rows = [header]
    for case, res in results.items():
        t = res["totals"]
        extra = t["rows_out"] - g["rows_out"]
        walls = (
            [("ray+init" if case == "ray" else None, res["wall_s"] + res["init_s"])] if case == "ray" else []
        )
        for name, wall in [(case, res["wall_s"]), *walls]:
            rows.append(
                [
                    name,
                    f"{wall:.2f}",
                    f"{base / wall:.2f}x" if base and case != "rerun" else "-",
                    f"{res['cpu_s']:.1f}",
                    f"{res['peak_rss'] / 1e9:.2f}",
                    f"{t['shards']} ({t['skipped']} skipped)",
                    f"{t['rows_out']:,}",
                    f"{t['rows_over_bound']:,}",
                    f"{extra:+,} ({100 * extra / g['rows_out']:.4f}%)",
                ]
            )
    rows.append(
        [
            "global plan",
            f"{g['plan_s']:.2f}",
            "(plan only)",
            "-",
            "-",
            "1",
            f"{g['rows_out']:,}",
            f"{g['rows_out'] - g['lower_bound']:,}",
            "0",
        ]
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )
    print()
    print(table)
    if same is not None:
        print(f"outputs identical shard by shard (sha256) across {', '.join(done)}: {same}")
    if "ray" in results and base:
        sp = base / results["ray"]["wall_s"]
        print(
            f"target: ray >= {TARGET_SPEEDUP}x single process: {sp:.2f}x "
            f"({base / (results['ray']['wall_s'] + results['ray']['init_s']):.2f}x with ray.init)"
        )
    if "local" in results:
        extra = (results["local"]["totals"]["rows_out"] - g["rows_out"]) / g["rows_out"]
        print(f"target: <= {100 * TARGET_EXTRA_ROWS:.2f}% extra rows vs one global plan: {100 * extra:.4f}%")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
            for r in rows[1:]:
                fh.write("| " + " | ".join(r) + " |\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "global": g, "results": results, "identical": same}, fh, indent=1)
    if not args.keep:
        shutil.rmtree(args.out_root, ignore_errors=True)


if __name__ == "__main__":
    main()
